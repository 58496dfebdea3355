"""examples/bigmodel/train.py: a meta-built Llama under tp2 x pp2 on 4 ranks trains as in one process."""
import re

import pytest

from tests.launch import ROOT, single, torchrun

SCRIPT = ROOT / "examples" / "bigmodel" / "train.py"
ARGS = ["--layers", "2", "--hidden", "64", "--intermediate", "128", "--vocab", "256", "--seq", "32", "--steps", "3"]


def _losses(stdout: str) -> list:
    # not anchored at line starts: torchrun ranks share stdout, so another rank's line may run into it
    steps = {int(k): float(x) for k, x in re.findall(r"step (\d+): loss ([0-9.]+)", stdout)}
    return [steps[k] for k in sorted(steps)]


def _rank_lines(stdout: str) -> dict:
    return {int(r): (reads, int(taken)) for r, reads, taken in
            re.findall(r"rank (\d+): reads batch tensors (\[[0-9, ]*\]) .*?took (\d+) batches", stdout)}


@pytest.mark.multirank
def test_example_on_4_ranks_equals_one_process():
    one = _losses(single(SCRIPT, ARGS).stdout)
    out = torchrun(SCRIPT, 4, ARGS + ["--per-rank-data"], timeout=400).stdout
    four = _losses(out)
    assert len(one) == len(four) == 3, (one, four)
    for a, b in zip(four, one):
        assert abs(a - b) / abs(b) <= 1e-5, (four, one)
    ranks = _rank_lines(out)
    assert sorted(ranks) == [0, 1, 2, 3], out
    # 3 steps of one global batch each; compile's first batch is handed back, so 2 are taken after it
    assert all(taken == 2 for _, taken in ranks.values()), ranks


@pytest.mark.multirank
@pytest.mark.slow   # the default tier: tests/test_bigmodel.py::test_middle_pipeline_stages_never_take_a_batch
def test_middle_stages_never_read_a_batch():
    """--tp 1 --pp 4: ranks 1 and 2 hold middle stages; after compile they take no batch."""
    out = torchrun(SCRIPT, 4, ["--layers", "4"] + ARGS[2:] + ["--tp", "1", "--pp", "4", "--nmicros", "4",
                                                          "--batch", "8"],
                   timeout=400).stdout
    ranks = _rank_lines(out)   # (ranks print at once: a line may follow another rank's text)
    assert sorted(ranks) == [0, 1, 2, 3], out
    assert ranks[1] == ("[]", 0) and ranks[2] == ("[]", 0), ranks
    assert ranks[0][1] == ranks[3][1] == 3 - 1, ranks   # one global batch a step (4 micro-batches)
    assert len(_losses(out)) == 3
