"""Activation recompute: graph.recompute / cube.ir.blocks -> checkpointed runs in the generated code.

Codegen and IR checks run in this process; one in-process compile checks that
recompute changes neither the loss nor the gradients and saves fewer
activations; three gloo launches check data parallel, tensor parallel and 1F1B
plans against the single-device model.
"""
import ast
import copy
import glob
import os

import pytest
import torch

from cube.passes.recompute import check_recompute
from cube.compiler import generate_code
from cube.ir import IRDataOperation, IRFwOperation
from cube.ir.blocks import block_of, blocks, recompute_blocks
from cube.trace import build_graph, export
from cube.policies.data import PASData
from cube.policies.pipeline import PAS1F1B
from cube.policies.single import PASSingle
from tests.launch import parity_across_ranks
from tests.models import build
from tests.parity import compile_step

RTOL = 1e-5


def _with_recompute(policy, which="all"):
    def PASRecompute(graph, resource):
        policy(graph, resource)
        recompute_blocks(graph, which)
        return graph
    return PASRecompute


def _methods(source: str) -> dict:
    """``{name: source}`` of the generated module's recompute methods."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    return {f.name: ast.get_source_segment(source, f) for f in cls.body
            if isinstance(f, ast.FunctionDef) and f.name.startswith("_recompute_")}


def _graph(name):
    model, sample = build(name)
    graph, _ = build_graph(export(model, sample), model, "tuple")
    return graph


# ------------------------------------------------------------------ IR and codegen, one process

def test_blocks_are_the_children_of_a_repeated_container():
    assert block_of("model.layers.3.mlp.c_fc") == "model.layers.3"
    assert block_of("ln_f") is None and block_of("") is None
    found = blocks(_graph("gpt_nobias"))
    assert [block_of(b[0].module_path) for b in found] == ["layers.0", "layers.1"]
    assert all(block_of(op.module_path) == block_of(b[0].module_path) for b in found for op in b)
    assert blocks(_graph("cnn")) == []


def test_codegen_checkpoints_each_marked_block():
    model, sample = build("gpt_nobias")
    sources = generate_code(model, sample, _with_recompute(PASData), world_size=2)
    for rank, src in sources.items():
        methods = _methods(src)
        assert sorted(methods) == ["_recompute_0", "_recompute_1"], (rank, sorted(methods))
        for name in methods:
            assert f"torch.utils.checkpoint.checkpoint(self.{name}, " in src
        assert "use_reentrant=False" in src and "import torch.utils.checkpoint" in src
        assert "[layers.0]" in src and "[layers.1]" in src
    # one block only: layer 1 is group 0, layer 0 runs inline
    src = generate_code(model, sample, _with_recompute(PASSingle, (1,)), world_size=1)[0]
    (body,) = _methods(src).values()
    assert "layers_1_attn_q_proj_weight" in body and "layers_0_" not in body
    # no recompute: nothing changes
    assert "torch.utils.checkpoint" not in generate_code(model, sample, PASSingle, world_size=1)[0]


def test_collectives_inside_a_run_are_rerun_whole():
    """Tensor parallel blocks hold all-reduces: checkpoint's early stop is off for them."""
    from cube.policies.megatron import PASMegatronTP
    model, sample = build("gpt_nobias")
    src = generate_code(model, sample, _with_recompute(PASMegatronTP), world_size=2)[0]
    body = _methods(src)["_recompute_0"]
    assert "runtime.collectives.all_reduce(" in body
    assert "set_checkpoint_early_stop(False)" in src


def test_pipeline_transfers_stay_outside_runs(monkeypatch):
    """The stage cut falls inside block 1: its sends and receives move to the edge of the run,
    so each stage checkpoints its part of the block once and never re-runs a transfer."""
    import cube.policies.pipeline as pipeline   # balanced stages cut between blocks: cut inside one by hand
    monkeypatch.setattr(pipeline, "balanced_starts", lambda graph, n, cost=None: [
        graph.select(ntype=IRFwOperation)[0],
        next(op for op in graph.select(name="layer_norm") if op.module_path == "layers.1.ln_2")])
    model, sample = build("gpt_nobias")
    sources = generate_code(model, sample, _with_recompute(PAS1F1B), world_size=2)
    names = [sorted(_methods(s)) for s in sources.values()]
    assert names == [["_recompute_0", "_recompute_1"], ["_recompute_1"]], names
    for src in sources.values():
        assert "runtime.p2p.send(" in src or "runtime.p2p.recv(" in src
        assert all("runtime.p2p" not in body for body in _methods(src).values())


def test_pieces_inherit_the_group_and_must_agree():
    graph = _graph("mlp")
    linear = graph.select(name="linear")[0]
    gid = graph.recompute([linear])
    pieces = graph.partition(linear, linear.algorithms("dim"), idx=0, dim=0, num=2)
    assert [p.recompute for p in pieces] == [gid, gid]
    replicas = graph.replicate(pieces[0], times=2)
    assert [p.recompute for p in replicas] == [gid, gid]
    replicas[1].recompute = None   # as if only some pieces were marked
    with pytest.raises(ValueError, match=r"pieces of op 'linear' .*recompute groups"):
        check_recompute(graph)


def test_ops_that_must_not_run_twice_are_refused():
    graph = _graph("cnn")
    counter = graph.select(name="add_")[0]    # BatchNorm's num_batches_tracked += 1
    with pytest.raises(ValueError, match=r"op 'add_' \(module 'bn1'.*in place.*Leave it out"):
        graph.recompute([counter])
    norm = graph.select(name="batch_norm")[0]
    with pytest.raises(ValueError, match=r"op 'batch_norm' .*running statistics"):
        graph.recompute([norm])
    with pytest.raises(ValueError, match="data operation|only forward ops"):
        graph.recompute(graph.select(ntype=IRDataOperation))
    with pytest.raises(ValueError, match="no repeated blocks"):
        recompute_blocks(graph, "all")


def test_cube_recompute_variable(monkeypatch):
    graph = _graph("gpt_nobias")
    monkeypatch.delenv("CUBE_RECOMPUTE", raising=False)
    assert recompute_blocks(graph) == []
    monkeypatch.setenv("CUBE_RECOMPUTE", "1")
    (group,) = recompute_blocks(graph)
    assert {block_of(op.module_path) for op in group} == {"layers.1"}
    marked = {op.recompute for op in graph.ops if isinstance(op, IRFwOperation)}
    assert marked == {None, 0}
    monkeypatch.setenv("CUBE_RECOMPUTE", "0,5")
    with pytest.raises(ValueError, match=r"CUBE_RECOMPUTE=0,5: block indices \[5\] are out of range.*2 blocks"):
        recompute_blocks(_graph("gpt_nobias"))
    monkeypatch.setenv("CUBE_RECOMPUTE", "layers")
    with pytest.raises(ValueError, match="CUBE_RECOMPUTE must be 'all' or comma-separated"):
        recompute_blocks(graph)


# ------------------------------------------------------------------ in-process run, world size 1

def _saved_bytes(fn):
    """Runs ``fn`` and returns (result, bytes of the tensors autograd packed for backward)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def test_recompute_keeps_loss_and_gradients_and_saves_less(tmp_path):
    model, sample = build("gpt")
    results = {}
    for name, policy in (("plain", PASSingle), ("recompute", _with_recompute(PASSingle))):
        step = compile_step(copy.deepcopy(model), iter([sample]), policy, tmp_path)
        assert ("torch.utils.checkpoint.checkpoint(" in step.source) == (name == "recompute")
        gen = step.load_model()
        loss, nbytes = _saved_bytes(lambda gen=gen: gen(*sample))
        loss.backward()
        names = gen.full_names()
        results[name] = (loss.detach(), {names[k][0]: p.grad for k, p in gen.named_parameters()}, nbytes)
    (loss, grads, plain_bytes), (rloss, rgrads, rbytes) = results["plain"], results["recompute"]
    assert torch.equal(loss, rloss)
    assert grads.keys() == rgrads.keys()
    for k in grads:
        assert torch.allclose(grads[k], rgrads[k], rtol=1e-6, atol=0), k
    # only the ops outside the blocks (embeddings, final norm, LM head, loss) save tensors
    assert rbytes < 0.5 * plain_bytes, (rbytes, plain_bytes)


# ------------------------------------------------------------------ gloo ranks

RANKS = [
    # (policy, ranks, micro-batches): CUBE_RECOMPUTE=all on the shipped policies
    ("cube.policies.data:PASData", 2, 1),
    ("cube.policies.megatron:PASMegatronTP", 2, 1),   # all-reduces inside the runs, re-run in backward
    ("cube.policies.pipeline:PAS1F1B", 2, 4),          # sends/recvs at the edges of the runs
]


@pytest.mark.multirank
@pytest.mark.parametrize("policy,nproc,nmicros", RANKS, ids=[p.split(":")[1] for p, _, _ in RANKS])
def test_recompute_across_ranks_equals_single_device(policy, nproc, nmicros, tmp_path):
    results = parity_across_ranks("gpt_nobias", policy, nproc, tmp_path, steps=3, nmicros=nmicros,
                                  env={"CUBE_RECOMPUTE": "all"})
    for r in results:
        assert r["loss_err"] <= RTOL, r
        assert r["param_err"] <= RTOL, r
    sources = glob.glob(os.path.join(tmp_path, "cache", "*", "rank*.py"))
    assert len(sources) == nproc
    for path in sources:
        with open(path) as f:
            assert "torch.utils.checkpoint.checkpoint(self._recompute_" in f.read(), path
