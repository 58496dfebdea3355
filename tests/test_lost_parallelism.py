"""No silent loss of parallelism: a split the policy asked for that the plan cannot keep is logged
(one line per op, with its model line and the bytes it gathers), listed in ``plan.txt``, and an
error under ``strict=True``, also when the compiled code comes from the cache."""
import inspect
import logging

import pytest
import torch
import torch.nn as nn

import cube
import cube.debug
from cube.ir import lost
from tests.models import build
from tests.parity import compile_step


class FlipsTheBatch(nn.Module):
    """A linear, then the batch reversed (``torch.flip`` along dim 0 mixes samples: no batch split
    can run it), then a linear and a mean squared error."""

    def __init__(self, dim=8):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, y):
        h = torch.flip(self.inp(x), dims=[0])
        return ((self.out(h) - y) ** 2).mean()


def _flip_line() -> str:
    """``test_lost_parallelism.py:N``: the model line with the flip."""
    lines, first = inspect.getsourcelines(FlipsTheBatch.forward)
    n = first + next(i for i, text in enumerate(lines) if "torch.flip(" in text)
    return f"test_lost_parallelism.py:{n}"


def _flip_sample(batch=4, dim=8):
    torch.manual_seed(0)
    return FlipsTheBatch(dim), (torch.randn(batch, dim), torch.randn(batch, dim))


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "cube" and r.levelno == logging.WARNING]


def test_op_without_a_batch_split_is_one_line_with_its_model_line_and_bytes(caplog):
    model, sample = _flip_sample()
    with caplog.at_level(logging.WARNING, logger="cube"):
        plan = cube.plan(model, sample, "PASData", 2)
    (record,) = plan.lost
    # what the plan gathers for the flip: the linear's whole output in forward, its gradient in backward
    h = sample[0].shape[0] * model.inp.out_features * 4
    assert (record.kind, record.op, record.what, record.over) == ("gather", "flip", "data parallel", (("dp", 2),))
    assert (record.forward, record.backward, record.nbytes) == (h, h, 2 * h)
    assert _flip_line() in record.where and "torch.flip(self.inp(x), dims=[0])" in record.where
    (line,) = _warnings(caplog)
    assert line.startswith("cube: PASData: data parallel over dp=2 lost at op 'flip'")
    assert _flip_line() in line and f"{2 * h} B per step" in line
    # the plan does gather there: an all-gather of the linear's output read by the flip
    calls = plan.program[0].plan.calls
    gathers = [c for c in calls if c.step is not None and c.step.kind == "all_gather"]
    flip = next(c for c in calls if c.op is not None and c.op.name == "flip")
    assert len(gathers) == 1 and gathers[0].outputs[0] in flip.inputs


def test_strict_names_each_op_its_line_and_the_fix():
    model, sample = _flip_sample()
    with pytest.raises(ValueError) as err:
        cube.plan(model, sample, "PASData", 2, strict=True)
    msg = str(err.value)
    assert "policy PASData asks for 1 split(s) the plan cannot keep" in msg
    assert "op 'flip'" in msg and _flip_line() in msg
    assert "cube.register_op" in msg and "change the policy" in msg
    with pytest.raises(ValueError, match="op 'flip'"):   # the unplanned trace says so too
        cube.trace_model(model, sample).place("PASData", 2, strict=True)


def test_explain_lists_lost_splits_in_plan_txt(tmp_path):
    model, sample = _flip_sample()
    cube.explain(model, sample, "PASData", 2, tmp_path)
    lines = (tmp_path / "plan.txt").read_text().splitlines()
    at = lines.index("splits the policy asked for that the plan does not keep: 1")
    assert lines[at + 1].startswith("  - data parallel over dp=2 lost at op 'flip'") and _flip_line() in lines[at + 1]
    with pytest.raises(ValueError, match="op 'flip'"):
        cube.explain(model, sample, "PASData", 2, tmp_path / "strict", strict=True)
    assert not (tmp_path / "strict").exists()


@pytest.mark.parametrize("name", ["gpt", "hf_llama", "moe"])
def test_plans_that_keep_every_split_log_nothing_and_pass_strict(name, caplog):
    model, sample = build(name)
    traced = cube.trace_model(model, sample)
    with caplog.at_level(logging.WARNING, logger="cube"):
        for policy, world, options in (("PASData", 2, None), ("PASMegatronTP", 2, None), ("PASHybrid", 4, {"tp": 2})):
            plan = traced.plan(policy, world, options=options, strict=True)
            assert plan.lost == [], (policy, [r.describe() for r in plan.lost])
    assert _warnings(caplog) == []


def test_megatron_on_a_model_without_linear_pairs_says_it_splits_nothing(caplog, tmp_path):
    model, sample = build("cnn")
    with caplog.at_level(logging.WARNING, logger="cube"):
        plan = cube.plan(model, sample, "PASMegatronTP", 2)
    expected = "PASMegatronTP: no linear pairs found to split over tp=2; every op runs whole on every device"
    assert _warnings(caplog) == [f"cube: {expected}"]
    assert [r.kind for r in plan.lost] == ["nothing"]
    # and indeed: no op is split, nothing is communicated
    assert not any(op.splits for op in plan.graph.ops)
    assert not any(c.step is not None for r in plan.program.ranks for c in plan.program[r].plan.calls)
    with pytest.raises(ValueError) as err:
        cube.plan(model, sample, "PASMegatronTP", 2, strict=True)
    assert expected.split(": ", 1)[1] in str(err.value) and "PASData" in str(err.value)
    # with data parallel around it, the tensor parallel groups are what runs every op whole
    hybrid = cube.plan(model, sample, "PASHybrid", 4, options={"tp": 2})
    assert [r.describe() for r in hybrid.lost] == [
        "no linear pairs found to split over tp=2; every op runs whole on each of the 2 devices of a tp group"]


def test_a_linear_kept_whole_is_named_with_the_op_that_stops_its_split():
    # a column split of the fused q/k/v projection cannot pass the reshape into (3, heads, head dim):
    # 3 is not divisible by 2, so the attention of each block runs whole on every device
    model, sample = build("vit")
    plan = cube.plan(model, sample, "PASMegatronTP", 2)
    assert [(r.kind, r.what, r.op) for r in plan.lost] == [("whole", "tensor parallel", "linear")] * 2
    for block, record in enumerate(plan.lost):
        assert f"module 'blocks.{block}.qkv'" in record.where
        assert f"stops at op 'reshape' (module 'blocks.{block}'" in record.why
        assert "has size 3, which 2 does not divide" in record.why
        qkv = model.blocks[block].qkv
        assert record.held == (qkv.weight.numel() + qkv.bias.numel()) * 4 and record.nbytes == 0
    # only those: the row projections, the norms, the classifier head and the loss are whole by design
    assert [r.node.module_path for r in plan.lost] == ["blocks.0.qkv", "blocks.1.qkv"]


class FlipsTheSequence(nn.Module):
    """Three linears on the sequence reversed (``torch.flip`` along dim 1 of the scaled input: no split of
    the sequence can run it, and no head split either: tensor parallel splits no op before the first
    linear), a mean squared error."""

    def __init__(self, dim=8):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x, y):
        h = self.inp(torch.flip(x * self.scale, dims=[1]))
        return ((self.out(torch.relu(self.mid(h))) - y) ** 2).mean()


def test_pipeline_counts_the_bytes_of_every_micro_batch():
    # context parallel: the flip along the sequence cannot run on blocks of it
    torch.manual_seed(0)
    model, sample = FlipsTheSequence(), (torch.randn(8, 8, 8), torch.randn(8, 8, 8))
    traced = cube.trace_model(model, sample)
    whole = traced.place("PASMegatron", 2, options={"tp": 1, "pp": 1, "cp": 2, "nmicros": 1})
    piped = traced.place("PASMegatron", 4, options={"tp": 1, "pp": 2, "cp": 2, "nmicros": 2})
    (a,), (b,) = whole.lost, piped.lost
    assert (a.op, a.what, a.over) == (b.op, b.what, b.over) == ("flip", "context parallel", (("cp", 2),))
    # a step of two micro-batches gathers each one's half: what one step on the whole batch gathers
    flipped = sample[0].numel() * 4
    assert a.forward == b.forward == flipped and a.nbytes == b.nbytes == 2 * flipped


def test_compile_logs_once_on_rank_zero_and_strict_refuses_cached_code(tmp_path, caplog):
    model, sample = _flip_sample()

    def compile_on_two_ranks(**kw):
        def body():
            step = cube.compile(model, iter([sample]), PAS="PASData", cache_dir=tmp_path, **kw)(lambda m, d: None)
            return step.cache_hit, step.lost
        return cube.debug.run(body, 2)

    with caplog.at_level(logging.WARNING, logger="cube"):
        (hit0, lost0), (hit1, lost1) = compile_on_two_ranks()
    assert not hit0 and not hit1 and lost0 == lost1 and [r.op for r in lost0] == ["flip"]
    first = _warnings(caplog)
    assert len(first) == 1 and "lost at op 'flip'" in first[0] and _flip_line() in first[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cube"):
        (hit0, cached), _ = compile_on_two_ranks()
    assert hit0 and cached == lost0 and _warnings(caplog) == first   # reused code, the same line
    for kw in ({}, {"use_cache": False}):   # from the cache, and planned again
        with pytest.raises(RuntimeError) as err:
            compile_on_two_ranks(strict=True, **kw)
        msg = str(err.value)   # a ValueError on the ranks (cube.debug.run reports the first rank's)
        assert "failed: LostSplitError: policy PASData" in msg and "op 'flip'" in msg and _flip_line() in msg


def test_a_plan_that_gathers_still_trains_exactly(tmp_path):
    from tests.inprocess import parity
    model, sample = _flip_sample()
    for loss_err, param_err in parity(model, sample, "PASData", 2, steps=2):
        assert loss_err < 1e-5 and param_err < 1e-5


def test_records_read_back_from_the_cache_equal_the_planned_ones():
    model, sample = _flip_sample()
    records = cube.plan(model, sample, "PASData", 2).lost + cube.plan(*build("cnn"), "PASMegatronTP", 2).lost
    back = lost.loads(lost.dumps(records))
    assert back == records and all(b.node is None for b in back)
    assert [b.describe() for b in back] == [r.describe() for r in records]
    with pytest.raises(ValueError, match="unreadable"):
        lost.loads("{not json", "x.json")
