"""Golden test of the generated code for the linears example.

On an intended change, regenerate with ``CUBE_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py``
and review the diff. In that mode the tests only write the files and are skipped (a comparison with
what was just written could not fail); run them again without it to compare.
"""
import difflib
import os
from pathlib import Path

import pytest
import torch

from cube.compiler import generate_code
from examples.mlp.linears import MLP
from cube.policies.single import PASSingle

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("CUBE_UPDATE_GOLDEN") == "1"


def _check_all(sources: dict):
    """Compares each ``{golden file name: generated text}`` with its file; with ``CUBE_UPDATE_GOLDEN=1``
    writes them all instead and skips the test (nothing is compared)."""
    if UPDATE:
        for name, source in sources.items():
            (GOLDEN / name).write_text(source)
        pytest.skip(f"CUBE_UPDATE_GOLDEN=1: wrote {', '.join(f'golden/{n}' for n in sources)}; "
                    f"review the diff and run again without it to compare")
    for name, source in sources.items():
        expected = (GOLDEN / name).read_text()
        if source != expected:
            diff = "".join(difflib.unified_diff(expected.splitlines(True), source.splitlines(True),
                                                f"golden/{name}", "generated"))
            raise AssertionError(f"generated code differs from golden/{name}:\n{diff}")


def _check(name: str, source: str):
    """``_check_all`` of one file."""
    _check_all({name: source})


def test_linears_single_golden():
    torch.manual_seed(0)
    model = MLP(dim=16, nlayers=3)
    sources = generate_code(model, torch.randn(4, 16), PASSingle, world_size=1)
    _check_all({"linears_single_rank0.py": sources[0]})


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
    from cube.policies.data import PASData
    from cube.policies.gallery import PASCol, PASRow
    from cube.policies.megatron import PASMegatronTP
    generated = {}
    for label, policy in (("data", PASData), ("megatron", PASMegatronTP), ("col", PASCol), ("row", PASRow)):
        torch.manual_seed(0)
        model = MLP(dim=16, nlayers=4)
        sources = generate_code(model, torch.randn(4, 16), policy, world_size=2)
        generated[f"linears_{label}_rank1.py"] = sources[1]
    _check_all(generated)
