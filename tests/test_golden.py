"""Golden test of the generated code for the linears example.

On an intended change, regenerate with ``CUBE_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py``
and review the diff.
"""
import difflib
import os
from pathlib import Path

import torch

from cube.compiler import generate_code
from examples.mlp.linears import MLP
from policies.single import PASSingle

GOLDEN = Path(__file__).parent / "golden"


def _check(name: str, source: str):
    path = GOLDEN / name
    if os.environ.get("CUBE_UPDATE_GOLDEN") == "1":
        path.write_text(source)
    expected = path.read_text()
    if source != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), source.splitlines(True),
                                            f"golden/{name}", "generated"))
        raise AssertionError(f"generated code differs from golden/{name}:\n{diff}")


def test_linears_single_golden():
    torch.manual_seed(0)
    model = MLP(dim=16, nlayers=3)
    sources = generate_code(model, torch.randn(4, 16), PASSingle, world_size=1)
    _check("linears_single_rank0.py", sources[0])


def test_linears_replicated_two_ranks_match_golden():
    torch.manual_seed(0)
    model = MLP(dim=16, nlayers=3)
    sources = generate_code(model, torch.randn(4, 16), PASSingle, world_size=2)
    # a replicated plan: both ranks run the whole single-device code, only the headers differ
    golden = (GOLDEN / "linears_single_rank0.py").read_text()
    assert sources[0] == golden.replace("rank 0 of 1", "rank 0 of 2")
    assert sources[1] == golden.replace("rank 0 of 1", "rank 1 of 2").replace("rank 0:", "rank 1:")


def test_linears_partitioned_plans_golden():
    """Data, Megatron, column and row plans of the linears example on 2 ranks (rank 1's code)."""
    from policies.data import PASData
    from policies.gallery import PASCol, PASRow
    from policies.megatron import PASMegatronTP
    for label, policy in (("data", PASData), ("megatron", PASMegatronTP), ("col", PASCol), ("row", PASRow)):
        torch.manual_seed(0)
        model = MLP(dim=16, nlayers=4)
        sources = generate_code(model, torch.randn(4, 16), policy, world_size=2)
        _check(f"linears_{label}_rank1.py", sources[1])
