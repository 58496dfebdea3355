"""Communication primitives: no-ops on one rank, adjoint pairs on 2 and 4 gloo ranks."""
import json

import pytest
import torch
import torch.distributed as dist

from cube.runtime import collectives as C
from tests.launch import ROOT, torchrun

WORKER = ROOT / "tests" / "workers" / "collectives_worker.py"
PRIMITIVES = ("all_reduce", "identity_fw_all_reduce_bw", "all_gather", "all_gather_keep", "reduce_scatter",
              "all_to_all", "chunk", "p2p")
SUITES = {2: ("world", "rev"), 4: ("world", "rev", "pair", "lazy")}


def expected_checks(nproc: int) -> set:
    return {f"{suite}.{prim}.{kind}" for suite in SUITES[nproc] for prim in PRIMITIVES
            for kind in ("fwd", "bwd", "adj")}


@pytest.mark.multirank
@pytest.mark.parametrize("nproc", [2, 4])
def test_primitives_match_references_and_are_adjoint(nproc, tmp_path):
    torchrun(WORKER, nproc, [tmp_path])
    for rank in range(nproc):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), path
        result = json.loads(path.read_text())
        assert result["rank"] == rank and result["world"] == nproc
        checks = result["checks"]
        assert set(checks) == expected_checks(nproc)
        bad = {name: e for name, e in checks.items() if not e <= 1e-6}
        assert not bad, (rank, bad)


def test_single_rank_primitives_are_noops_without_process_group():
    assert not dist.is_initialized()
    x = torch.randn(4, 6, requires_grad=True)
    ops = [lambda t: C.all_reduce(t, (0,)),
           lambda t: C.identity_fw_all_reduce_bw(t, [0]),
           lambda t: C.all_gather(t, (0,), 1),
           lambda t: C.reduce_scatter(t, (0,), 0),
           lambda t: C.all_to_all(t, (0,), 0, 1),
           lambda t: C.chunk(t, (0,), 1),
           lambda t: C.p2p_shift(t, 0, 0, t.shape, t.dtype)]
    for op in ops:
        y = op(x)
        assert y is x
        g = torch.randn_like(x)
        (gx,) = torch.autograd.grad(y, x, g)
        assert torch.equal(gx, g)
    assert not dist.is_initialized()



def test_all_to_all_over_a_subgroup_in_the_in_process_world():
    """Ranks 2 and 0 of three swap halves (torch's P2POp would look the in-process group up in
    torch's own registry and refuse it)."""
    import cube.debug

    def body():
        rank = cube.debug.rank()
        if rank == 1:
            return None
        x = torch.arange(4.0).reshape(2, 2) + 10 * rank
        return C.all_to_all(x, (2, 0), 0, 1)

    out = cube.debug.run(body, 3)
    x0, x2 = torch.arange(4.0).reshape(2, 2), torch.arange(4.0).reshape(2, 2) + 20
    # ranks order (2, 0): rank 2 keeps row 0 of each, rank 0 row 1, concatenated along dim 1 in that order
    assert torch.equal(out[2], torch.cat([x2[:1], x0[:1]], dim=1))
    assert torch.equal(out[0], torch.cat([x2[1:], x0[1:]], dim=1))
