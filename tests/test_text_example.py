"""examples/text: the corpus and batches are deterministic, the splits disjoint, and a short run
prints the same train and validation losses in one process and under PASData on 2 ranks."""
import re

import pytest
import torch

from examples.text.data import Batches, TextData, decode, default_corpus, encode, stdlib_text
from tests.launch import ROOT, single, torchrun

SCRIPT = ROOT / "examples" / "text" / "train.py"
ARGS = ["--layers", "1", "--dim", "32", "--heads", "2", "--seq", "16", "--batch", "4", "--steps", "3",
        "--warmup", "2", "--eval-every", "2", "--eval-batches", "2", "--log-every", "1"]


def _losses(stdout: str):
    train = [float(x) for x in re.findall(r"^step \d+: loss ([0-9.]+) \|", stdout, re.M)]
    val = [float(x) for x in re.findall(r"^step \d+: val loss ([0-9.]+)$", stdout, re.M)]
    return train, val


def test_corpus_is_deterministic_and_cached(tmp_path):
    path = default_corpus(tmp_path)
    assert path.parent == tmp_path / "text" and path.read_bytes() == stdlib_text().encode("utf-8")
    assert default_corpus(tmp_path) == path   # read back, not rewritten
    assert len(path.read_bytes()) > 300_000
    assert decode(encode("héllo\n")) == "héllo\n" and encode("é").tolist() == [0xC3, 0xA9]


def test_batches_are_deterministic_and_splits_disjoint(tmp_path):
    data = tmp_path / "t.txt"
    data.write_bytes(bytes(range(256)) * 40)
    text = TextData(data, seq=16)
    n = len(text.tokens)
    assert len(text.train) == int(0.9 * n) and torch.equal(torch.cat([text.train, text.val]), text.tokens)
    one, two = text.batches("train", 8, seed=3), text.batches("train", 8, seed=3)
    first = [next(one) for _ in range(4)]
    for a, b in zip(first, (next(two) for _ in range(4))):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(first[0][0], first[1][0])
    resumed = next(text.batches("train", 8, seed=3, start=2))   # batch i depends on i alone
    assert torch.equal(resumed[0], first[2][0])
    x, y = first[0]
    assert x.shape == y.shape == (8, 16) and torch.equal(x[:, 1:], y[:, :-1])
    # windows of positions: every train window lies in [0, cut), every validation one in [cut, n)
    cut = len(text.train)
    positions = torch.arange(n)
    for _ in range(20):
        tx, ty = next(Batches(positions[:cut], 8, 16, seed=5))
        vx, vy = next(Batches(positions[cut:], 8, 16, seed=5))
        assert int(ty.max()) < cut <= int(vx.min())
        assert torch.equal(tx[:, 1:] - tx[:, :-1], torch.ones(8, 15, dtype=torch.long))
    with pytest.raises(ValueError, match="validation split"):
        short = tmp_path / "short.txt"
        short.write_bytes(b"x" * 100)
        TextData(short, seq=16)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """The cache (the default corpus and the generated code) and the losses of one process, run once."""
    env = {"CUBE_CACHE_DIR": str(tmp_path_factory.mktemp("text") / "cache")}
    one = _losses(single(SCRIPT, ARGS + ["--policy", "PASSingle"], env=env).stdout)
    assert len(one[0]) == 3 and len(one[1]) == 2 and one[1][0] != one[1][1], one   # the model learned between
    return env, one


@pytest.mark.multirank
# the slow tier (CUBE_SLOW=1): PASMegatronTP, whose plan of a GPT tests/test_parallel.py checks on gloo
# ranks; PASData (saving, merging and sampling too) stays in the default tier
@pytest.mark.parametrize("policy", ["PASData", pytest.param("PASMegatronTP", marks=pytest.mark.slow)])
def test_two_ranks_print_the_losses_of_one_process(single_run, policy, tmp_path):
    env, one = single_run
    extra = ["--save", tmp_path / "ckpt", "--sample", "8"] if policy == "PASData" else []
    out = torchrun(SCRIPT, 2, ARGS + ["--policy", policy] + extra, env=env).stdout
    two = _losses(out)
    assert len(two[0]) == 3 and len(two[1]) == 2, (policy, out)
    for a, b in zip(one[0] + one[1], two[0] + two[1]):
        assert abs(a - b) / abs(b) <= 1e-5, (policy, one, two)
    if extra:   # the checkpoint saved, merged on rank 0 and sampled from
        assert "sample: def " in out and (tmp_path / "ckpt" / "meta.json").exists(), out


def test_metrics_paused_leaves_time_out_of_the_step():
    import time
    import cube
    metrics = cube.Metrics(None, tokens_per_step=10, flops_per_token=1.0, log_every=100, rich=False)
    with metrics.paused():
        time.sleep(0.3)
    record = metrics.step(1.0)
    assert record["step_time"] < 0.2 and record["elapsed"] >= 0.3, record
