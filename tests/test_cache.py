"""Generated code is cached by plan, reused, and two compiles do not interfere."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cube
from examples.mlp.linears import MLP
from cube.policies.single import PASSingle
from tests.parity import compile_step


def _compile(model, loader, tmp_path, policy=PASSingle):
    return compile_step(model, loader, policy, tmp_path, tensor_batch=True)


def test_second_compile_reuses_code_without_tracing(tmp_path):
    torch.manual_seed(0)
    model = MLP(8, 2)
    loader = cube.runtime.utils.create_dummy_dataloader(torch.randn(8), 4)
    first = _compile(model, loader, tmp_path)
    second = _compile(model, loader, tmp_path)
    assert not first.cache_hit and "trace" in first.timings
    assert second.cache_hit and "trace" not in second.timings
    assert first.path == second.path and first.source == second.source
    a, b = first.load_model(), second.load_model()
    assert torch.equal(first(a, loader), second(b, loader))


def test_key_changes_with_batch_shape_and_policy(tmp_path):
    model = MLP(8, 2)
    k1 = _compile(model, iter([torch.randn(4, 8)]), tmp_path).key
    k2 = _compile(model, iter([torch.randn(6, 8)]), tmp_path).key

    def PASOther(graph, resource):
        return PASSingle(graph, resource)
    k3 = _compile(model, iter([torch.randn(4, 8)]), tmp_path, PASOther).key
    assert len({k1, k2, k3}) == 3


def test_two_compiles_in_one_process_are_independent(tmp_path):
    torch.manual_seed(0)
    small, big = MLP(8, 1), MLP(16, 3)
    l1, l2 = iter([torch.randn(2, 8)] * 3), iter([torch.randn(2, 16)] * 3)
    s1 = _compile(small, l1, tmp_path)
    s2 = _compile(big, l2, tmp_path)
    m1, m2 = s1.load_model(), s2.load_model()
    assert cube.load_model().__class__ is m2.__class__   # the latest compile
    assert len(list(m1.parameters())) == 2 and len(list(m2.parameters())) == 6
    assert torch.allclose(s1(m1, l1), small(s1.batches.first))
    assert s2(m2, l2).shape == ()


def test_first_batch_is_not_lost(tmp_path):
    batches = [torch.full((2, 8), float(i)) for i in range(3)]
    model = MLP(8, 1)
    loader = iter(batches)
    step = _compile(model, loader, tmp_path)
    gen = step.load_model()
    losses = [step(gen, loader).item() for _ in range(3)]
    assert losses == [model(b).item() for b in batches]


_FRESH = """
import sys, torch
torch.set_num_threads(1)   # the two processes' losses are compared bit for bit: one reduction order
from cube.policies.single import PASSingle
from tests.parity import compile_step
from tests.test_{module} import {model}, _batch
torch.manual_seed(0)
model, batch = {model}(), _batch()
step = compile_step(model, iter([batch] * 2), PASSingle, sys.argv[1])
print(step.cache_hit, float(step(__import__("cube").load_model(), iter([batch]))))
"""


@pytest.mark.parametrize("module,model", [("flex_attention", "LM"), ("autograd_functions", "Net")],
                         ids=["flex_attention", "autograd_function"])
def test_a_cached_program_loads_in_a_fresh_process(tmp_path, module, model):
    """Ops the trace defines (flex_attention's, a model's own autograd.Function run as one op) are defined
    again when a fresh process loads the program from the cache without tracing."""
    script = tmp_path / "run.py"
    script.write_text(_FRESH.format(module=module, model=model))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    runs = [subprocess.run([sys.executable, str(script), str(tmp_path / "cache")], capture_output=True, text=True,
                           env=env, timeout=300) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    (hit0, loss0), (hit1, loss1) = [r.stdout.split()[-2:] for r in runs]
    assert (hit0, hit1) == ("False", "True") and loss0 == loss1, (runs[0].stdout, runs[1].stdout)
