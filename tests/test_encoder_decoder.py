"""In-place writes into views (encoder-decoder models shifting labels right) under split plans.

T5 and BART build the decoder's input with ``labels.new_zeros(labels.shape)`` and then
write into slices of it; the trace keeps those writes in place. cube makes them functional
(``cube.trace.inplace``), so a data-parallel split splits the write with the tensor written
into, and every plan equals the plain model.
"""
import json
import sys

import pytest
import torch

import cube.debug
from cube.ir import IRFwOperation
from cube.trace import build_graph, export
from tests.launch import ROOT
from tests.models import build

WORKER = str(ROOT / "tests" / "workers" / "parity_worker.py")

CASES = [
    # (model, policy, ranks, micro-batches, environment)
    ("views", "cube.policies.data:PASData", 2, 1, {}),
    ("hf_t5", "cube.policies.data:PASData", 2, 1, {}),
    ("hf_bart", "cube.policies.data:PASData", 2, 1, {}),
    ("hf_t5", "cube.policies.hybrid:PASHybrid", 4, 1, {"CUBE_TP": "2"}),
    ("hf_bart", "cube.policies.hybrid:PASHybrid", 4, 1, {"CUBE_TP": "2"}),
    ("hf_t5", "cube.policies.pipeline:PAS1F1B", 2, 4, {}),
    # SGD: as below (an AVX-512 host reads 1.4e-5 for one bias element under AdamW)
    ("hf_bart", "cube.policies.pipeline:PAS1F1B", 2, 4, {"CUBE_PARITY_OPT": "sgd"}),
    ("hf_t5", "tests/extra_policies.py:PAS1F1BData", 4, 4, {}),
    # SGD: with AdamW one bias element whose gradient is near zero turns the pipeline's other
    # summation order into a visible update (1.4e-5); the gradients themselves agree to 2e-7
    ("hf_bart", "tests/extra_policies.py:PAS1F1BData", 4, 4, {"CUBE_PARITY_OPT": "sgd"}),
]


def _ids(case):
    model, policy, n, _, _ = case
    return f"{model}-{policy.split(':')[1]}-{n}"


@pytest.mark.multirank
@pytest.mark.parametrize("model,policy,nproc,nmicros,env", CASES, ids=[_ids(c) for c in CASES])
def test_plan_equals_the_plain_model(model, policy, nproc, nmicros, env, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("CUBE_PARITY_OPT", "adamw")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", list(sys.argv))   # the in-process launcher sets the script's argv
    cube.debug.main(["-n", str(nproc), WORKER, model, policy, "2", str(tmp_path), str(nmicros)])
    for r in range(nproc):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["world"] == nproc and res["steps"] == 2
        assert res["loss_err"] <= 1e-5 and res["param_err"] <= 1e-5, (r, res["loss_err"], res["param_err"])


def _graph(model, sample):
    return build_graph(export(model, sample), model, "tuple")[0]


def test_writes_into_views_become_functional_ops():
    model, sample = build("views")
    ops = _graph(model, sample).select(ntype=IRFwOperation)
    names = [op.name for op in ops]
    assert not [n for n in names if n.endswith("_")], names          # no write stays in place
    assert names.count("slice_scatter") == 2 and names.count("select_scatter") >= 3
    # the decoder input is split with the batch: the write splits with the tensor written into
    scatter = next(op for op in ops if op.name == "slice_scatter")
    assert (0, 0) in scatter.algorithms("dim").legal() and (1, 0) in scatter.algorithms("dim").legal()
    assert scatter.source and "dec[:, 1:] = labels[:, :-1].clone()" in scatter.source[2]


def test_a_read_after_a_write_sees_the_written_value():
    class M(torch.nn.Module):
        def forward(self, x):
            y = x * 1.0
            v = y[:, :2]                      # a view made before the write
            y[:, 0] = 5.0                     # writes through another view of the same tensor
            return v.sum() + y.sum(dim=0).sum()   # v and y both hold the write

    graph = _graph(M(), (torch.randn(3, 4),))
    written = graph.select(name="select_scatter")[0].outputs[0]
    sums = graph.select(name="sum")
    # v is made again from the written tensor, and y is the written tensor
    remade = [op for op in graph.select(name="slice") if op.inputs[0] is written]
    assert remade and sums[0].inputs[0] is remade[0].outputs[0]
    assert sums[1].inputs[0] is written


def test_state_is_still_written_in_place():
    model, sample = build("cnn")   # batch norm counts its steps in a buffer: num_batches_tracked += 1
    adds = [op for op in _graph(model, sample).select(name="add_")]
    assert adds and all(op.inputs[0].name.endswith("num_batches_tracked") for op in adds)


def test_a_write_through_a_view_cube_cannot_invert_names_the_line():
    class M(torch.nn.Module):
        def forward(self, x):
            y = x * 1.0
            y.diagonal().zero_()
            return y.sum()

    with pytest.raises(TypeError, match=r"zero_ at .*y\.diagonal\(\)\.zero_\(\).*diagonal.*Fix"):
        _graph(M(), (torch.randn(3, 3),))
