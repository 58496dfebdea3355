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
            for kind in ("fwd", "bwd", "adj", "nograd")}


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


def test_region_indexes_each_box_once_and_reads_any_box(monkeypatch):
    """A region is the box's view for tuples, lists and boxes over fewer dims; a box's index is
    made once (not per message) and the remembered ones stay bounded."""
    x = torch.arange(24.0).view(4, 6)
    assert torch.equal(C.region(x, ((1, 3), (2, 4))), x[1:3, 2:4])
    assert torch.equal(C.region(x, [[1, 3], [2, 4]]), x[1:3, 2:4])
    assert torch.equal(C.region(x, ((1, 3),)), x[1:3])
    assert C.region(x, ((0, 2), (0, 6))).data_ptr() == x.data_ptr()   # a view
    assert C.box_index(((1, 3), (2, 4))) is C.box_index(((1, 3), (2, 4)))
    monkeypatch.setattr(C, "_INDEX", {})
    monkeypatch.setattr(C, "_INDEX_MAX", 3)
    for i in range(10):
        assert C.box_index(((i, i + 1),)) == (slice(i, i + 1),)
    assert 0 < len(C._INDEX) <= 3
    assert C.wire(torch.device("cpu")) == torch.device("cpu")


def test_p2p_calls_the_default_group_directly_unless_torch_distributed_is_replaced(tmp_path, monkeypatch):
    """Messages skip ``dist.isend``'s argument checks (the group's own ``send``); the in-process
    world, which replaces ``dist.isend``, and a test's stand-in still get every message."""
    import cube.debug
    from cube.runtime import p2p

    assert p2p._world() is None   # no group: torch's functions raise their own error
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert p2p._world() is dist.GroupMember.WORLD
        sent = []
        with monkeypatch.context() as m:
            m.setattr(dist, "isend", lambda x, dst, tag=0: sent.append((x, dst, tag)))
            assert p2p._world() is None
            x = torch.arange(6.0).reshape(2, 3).t()   # not contiguous: sent as a contiguous copy
            p2p._send_work(p2p.to_wire(x), 1, 7)
        assert len(sent) == 1 and sent[0][1:] == (1, 7) and sent[0][0].is_contiguous()
        assert torch.equal(sent[0][0], x)
        assert cube.debug.run(lambda: p2p._world() is None, 2) == [True, True]
    finally:
        dist.destroy_process_group()
    assert p2p._world() is None
