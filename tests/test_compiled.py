"""``cube.compile(..., backend=)``: each rank's generated compute under ``torch.compile``, the
communication between the compiled pieces eager, and training equal to the plain model.

The plans run in the in-process world (one thread per rank) with ``aot_eager``: dynamo and
AOTAutograd split and trace exactly as with inductor, without its C++ compile; one
single-rank test runs inductor itself. Threads are fine for dynamo here: it holds its
compile lock only while compiling, and a rank hands over to another only inside
communication, which runs outside the compiled graphs.
"""
import copy
import re
from pathlib import Path

import pytest
import torch

import cube
import cube.debug
from cube.runtime import compiled
from tests.inprocess import assert_exact, parity
from tests.models import build
from tests.parity import rel

ROOT = Path(__file__).resolve().parents[1]
AS_EAGER = None   # mixed precision: the plan's own round-off against the float32 model, no more


def _sgd(model):
    return cube.build_optimizer(model, torch.optim.SGD, lr=1e-2)


CASES = [
    # (id, model, policy, ranks, keyword arguments of tests.inprocess.parity, tolerance)
    ("mlp-data", "mlp", "cube.policies.data:PASData", 2, {}, 1e-5),
    ("gpt-data", "gpt_nobias", "cube.policies.data:PASData", 2, {}, 1e-5),
    ("gpt-megatron", "gpt_nobias", "cube.policies.megatron:PASMegatronTP", 2, {}, 1e-5),
    # a recompute run holding collectives: checkpointed eagerly, its method compiled between them
    ("gpt-megatron-recompute", "gpt_nobias", "cube.policies.megatron:PASMegatronTP", 2,
     {"options": {"recompute": "all"}}, 1e-5),
    ("gpt-data-recompute", "gpt_nobias", "cube.policies.data:PASData", 2, {"options": {"recompute": "all"}}, 1e-5),
    # two stages per rank: stage_<k> methods, sends, receives and stashes between them
    ("gpt-interleaved", "gpt4_nobias", "tests/extra_policies.py:PAS1F1BInterleaved", 2, {"nmicros": 4}, 1e-5),
    ("mlp-zero3", "mlp", "cube.policies.data:PASData", 2, {"zero": 3, "build": _sgd}, 1e-5),
    ("gpt-megatron-bf16", "gpt_nobias", "cube.policies.megatron:PASMegatronTP", 2, {"precision": "bf16", "build": _sgd},
     AS_EAGER),
    ("mlp-data-fp16", "mlp", "cube.policies.data:PASData", 2, {"precision": "fp16", "build": _sgd}, AS_EAGER),
]


@pytest.mark.parametrize("name,policy,world,kw,tol", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_compiled_plan_trains_like_the_plain_model(name, policy, world, kw, tol):
    model, sample = build(name)
    errors = parity(model, sample, policy, world, backend="aot_eager", **kw)
    if tol is not AS_EAGER:
        assert_exact(errors, tol)
        return
    # low precision rounds differently from the float32 model (tests/test_precision.py compares
    # under autocast); compiled, the plan must stay as close to it as the eager plan is
    eager = parity(model, sample, policy, world, **kw)
    for got, want in zip(errors, eager):
        assert all(g <= w + 1e-5 for g, w in zip(got, want)), (errors, eager)


def test_inductor_on_one_rank_trains_like_the_plain_model():
    model, sample = build("mlp")
    assert_exact(parity(model, sample, "cube.policies.single:PASSingle", 1, backend="inductor"))


# ------------------------------------------------------------------ what is compiled

_GRAPHS = []


def _recording_backend():
    """A registered backend (AOTAutograd, run eagerly) keeping every forward and backward graph."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.registry import register_backend

    name = "cube_test_recording"
    if name not in compiled.backends():
        def keep(kind):
            def compiler(gm, inputs):
                _GRAPHS.append((kind, gm))
                return make_boxed_func(gm.forward)
            return compiler
        register_backend(name=name, compiler_fn=aot_autograd(fw_compiler=keep("forward"),
                                                             bw_compiler=keep("backward")))
    return name


def _train(model, sample, policy, world, tmp_path, backend, steps=2):
    """Every rank's (step, generated module, losses) after ``steps`` SGD steps."""
    batches = [sample] * (steps + 1)

    def body():
        it = iter(batches)

        @cube.compile(copy.deepcopy(model), it, PAS=policy, cache_dir=tmp_path, backend=backend)
        def train_iter(model, dataloader):
            data = next(dataloader)
            loss = model(*data)
            loss.backward()
            return loss
        gen = cube.load_model()
        opt = torch.optim.SGD(gen.parameters(), lr=1e-2)
        losses = []
        for _ in range(steps):
            losses.append(train_iter(gen, it).detach())
            opt.step()
            opt.zero_grad()
        return train_iter, gen, losses
    return cube.debug.run(body, world)


def test_graphs_hold_only_computation_and_the_plan_is_unchanged(tmp_path):
    model, sample = build("gpt_nobias")
    _GRAPHS.clear()
    backend = _recording_backend()
    ranks = _train(model, sample, "cube.policies.megatron:PASMegatronTP", 2, tmp_path, backend)
    forwards = [gm for kind, gm in _GRAPHS if kind == "forward"]
    backwards = [gm for kind, gm in _GRAPHS if kind == "backward"]
    # every collective breaks the graph: several pieces per rank, each with its backward
    assert len(forwards) >= 4 and len(backwards) >= 4, (len(forwards), len(backwards))
    targets = {str(n.target) for _, gm in _GRAPHS for n in gm.graph.nodes if n.op == "call_function"}
    assert {t for t in targets if not t.startswith(("aten.", "prims."))} <= {"<built-in function getitem>"}, targets
    eager = _train(model, sample, "cube.policies.megatron:PASMegatronTP", 2, tmp_path, None)
    for (step, gen, losses), (estep, egen, elosses) in zip(ranks, eager):
        assert step.backend == backend and gen.BACKEND == backend and egen.BACKEND is None
        assert step.key == estep.key and step.source == estep.source   # wrapped at load: same code, same cache entry
        assert type(gen) is not type(egen)   # each compile loads its own class
        assert rel(torch.stack(losses), torch.stack(elosses)) <= 1e-6
        for p, q in zip(gen.parameters(), egen.parameters()):
            assert rel(p, q) <= 1e-6


def test_staged_module_compiles_its_stage_and_recompute_methods():
    src = '''
class Gen(torch.nn.Module):
    def forward(self, stage, x):
        return getattr(self, f"stage_{stage}")(x)
    def stage_0(self, x):
        return x + 1
    def stage_2(self, x):
        return x * 2
    def _recompute_0_s2(self, x):
        return x
    def _recompute_1(self, x):
        return x
    def _recompute_1_2(self, x):
        return x
    def helper(self, x):
        return x
'''
    scope = {"torch": torch}
    exec(src, scope)
    assert compiled.compute_methods(scope["Gen"]) == ["stage_0", "stage_2", "_recompute_0_s2", "_recompute_1",
                                                      "_recompute_1_2"]
    exec("class Flat(torch.nn.Module):\n    def forward(self, x):\n        return x\n", scope)
    assert compiled.compute_methods(scope["Flat"]) == ["forward"]


def test_every_communicating_call_of_generated_code_stays_out_of_graphs():
    """Each ``runtime.*`` function the code generator prints is either kept out of compiled graphs
    or known to be plain computation; a new one must be put in one of the two."""
    compute = {"runtime.narrow", "runtime.drop_grad", "runtime.piece", "runtime.next_batch",
               "runtime.collectives.region", "runtime.collectives.assemble", "runtime.ops.valid_count",
               "runtime.ops.mean_part", "runtime.ops.pointwise_loss_part",
               # their communication is in the marked _start_denominator and _wait
               "runtime.ops.cross_entropy_part", "runtime.ops.nll_part",
               # called by train_step, which is never compiled (pipeline.run calls the stage methods)
               "runtime.pipeline.run", "runtime.pipeline.micro_batches", "runtime.p2p.backward",
               "runtime.p2p.finish", "runtime.rng.step",
               # looks up the op running a model's autograd.Function (defined once per process)
               "runtime.functions.op"}
    printed = set()
    for path in (ROOT / "cube" / "codegen").glob("*.py"):
        printed |= set(re.findall(r"\b(runtime(?:\.[a-z_0-9]+)+)\(", path.read_text()))
    printed.add("runtime.rng.call")   # printed as a name, its arguments after it
    assert "runtime.collectives.all_reduce" in printed and "runtime.p2p.recv" in printed
    kept_out = {name.replace("cube.runtime.", "runtime.", 1) for name in compiled.marked()}
    unknown = printed - kept_out - compute
    assert not unknown, f"generated code calls {sorted(unknown)}: mark them @outside_graph or list them here"
    assert "runtime.module.CubeModule.zero_wait" in kept_out and "runtime.amp.scale_loss_grad" in kept_out


def test_loss_piece_summing_its_denominator_across_ranks_compiles_around_the_sum():
    """``cross_entropy_part`` without a known count starts an all-reduce of the denominator, computes
    the loss, then waits: both communication steps break the graph, the loss itself compiles."""
    from cube.runtime import collectives, ops
    compiled.fence()

    def piece(logits, target):
        return ops.cross_entropy_part(logits * 2, target, ranks=(0, 1)) * 3
    fast = torch.compile(piece, backend="aot_eager", dynamic=False)

    def body():
        rank = cube.debug.rank()
        gen = torch.Generator().manual_seed(rank)
        logits = torch.randn(6, 5, generator=gen, requires_grad=True)
        target = torch.randint(0, 5, (6,), generator=gen)
        target[rank] = -100   # ignored targets differ by rank: the denominator needs the sum
        collectives.create_groups([(0, 1)])
        want, got = piece(logits, target), fast(logits, target)
        grads = [torch.autograd.grad(v, logits)[0] for v in (want, got)]
        return torch.equal(want, got) and torch.equal(*grads)
    assert cube.debug.run(body, 2) == [True, True]


# ------------------------------------------------------------------ mistakes

def test_bad_backend_is_a_clear_error(tmp_path):
    model, sample = build("mlp")
    with pytest.raises(ValueError, match=r"backend 'indcutor' is not a torch.compile backend; valid names: .*"
                                         r"aot_eager.*inductor"):
        cube.compile(model, iter([sample]), PAS="cube.policies.single:PASSingle", cache_dir=tmp_path, backend="indcutor")
    with pytest.raises(TypeError, match="backend must be None .* or the name of a torch.compile backend"):
        cube.compile(model, iter([sample]), PAS="cube.policies.single:PASSingle", cache_dir=tmp_path, backend=torch.compile)


def test_default_is_eager(tmp_path):
    model, sample = build("mlp")
    it = iter([sample, sample])

    @cube.compile(model, it, PAS="cube.policies.single:PASSingle", cache_dir=tmp_path)
    def train_iter(model, dataloader):
        data = next(dataloader)
        loss = model(*data)
        loss.backward()
        return loss
    gen = cube.load_model()
    assert train_iter.backend is None and gen.BACKEND is None
    assert "forward" in vars(type(gen)) and not hasattr(vars(type(gen))["forward"], "_torchdynamo_orig_callable")
