"""Sequence parallel and expert parallel at their real cost: the plans train exactly like the
plain model (in-process world, against eager), and their programs send what Megatron-SP and an
all-to-all MoE send, computed from the model's config."""
import functools

import pytest
import torch

import cube
from cube.codegen.report import step_bytes
from cube.policies.megatron3d import PASMegatron
from tests.inprocess import assert_exact, parity
from tests.models import build

F32 = 4   # bytes per element


def _sp(tp: int = 2, sp: bool = True):
    return functools.partial(PASMegatron, tp=tp, pp=1, nmicros=1, sp=sp)


def _kinds(plan, rank: int = 0) -> list:
    return [c.step.kind for c in plan.program.plans[rank].calls if c.step is not None]


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_sequence_parallel_is_exact(opt):
    model, sample = build("gpt_nobias")
    assert_exact(parity(model, sample, _sp(), 2, steps=2, opt=opt))


def test_sequence_parallel_sends_megatron_sp_bytes():
    """Per layer, forward two all-gathers and two reduce-scatters of ``b*s*h`` (backward the
    same): tensor parallel's two all-reduces each way. Around the layers: the token embedding is
    split over the vocabulary (its lookup all-reduces ``b*s*h`` inside its call, forward only), the
    position embedding whole (its table is bigger than its output), both cut into sequence pieces
    (backward all-gathers their gradients); the final norm's output is gathered for the
    column-parallel LM head (backward reduce-scatters its partial gradient) and the loss all-reduces
    3 floats per row (maximum, sum of exponentials, target logit); the norm weights' gradients are
    partial over the sequence pieces and summed over tp."""
    model, sample = build("gpt_nobias")
    cfg, (b, s), n = model.config, sample[0].shape, 2
    h, layers = cfg.n_embd, cfg.n_layer
    act = b * s * h * F32                      # one b*s*h activation
    piece = (n - 1) * act // n                 # a ring all-gather or reduce-scatter of it
    vocab = 2 * piece + 2 * (n - 1) * b * s * 3 * F32 // n   # the lookup's and the loss's all-reduces
    sp = cube.plan(model, sample, _sp(n), n)
    tp = cube.plan(model, sample, _sp(n, sp=False), n)
    for r in range(n):
        kinds = _kinds(sp, r)
        assert kinds.count("reduce_scatter") == 2 * layers and "all_reduce" not in kinds
        assert kinds.count("all_gather") == 2 * layers + 1   # and the head's
        got, base = step_bytes(sp.program.plans[r]), step_bytes(tp.program.plans[r])
        assert base == {"forward": 2 * layers * 2 * piece + vocab,
                        "backward": 2 * layers * 2 * piece + 2 * piece,             # + the LM head's input
                        "gradients": 0}
        assert got == {
            "forward": 4 * layers * piece + piece + vocab,                            # + the head's gather
            "backward": 4 * layers * piece + piece + piece + (n - 1) * s * h * F32 // n,   # + the embeddings' chunks
            "gradients": (2 * layers + 1) * 2 * (n - 1) * h * F32 // n}               # the norm weights


def test_sequence_parallel_with_data_parallel_is_exact():
    model, sample = build("gpt_nobias")
    assert_exact(parity(model, sample, _sp(), 4, steps=2, opt="adamw"))


def test_sequence_parallel_norms_and_adds_hold_a_piece_of_the_sequence():
    """The activations between the tensor-parallel regions are divided by tp."""
    model, sample = build("gpt_nobias")
    s = sample[0].shape[1]
    plan = cube.plan(model, sample, _sp(2), 2)
    boxes = [c.layout.outputs[0] for c in plan.program.plans[1].calls
             if c.op is not None and c.op.name in ("layer_norm", "add")]
    assert len(boxes) == 4 * model.config.n_layer + 2   # two norms and two adds a layer, ln_f, the embeddings' add
    assert all(box[1] == (s // 2, s) for box in boxes), boxes


def _ep(ep: int = 2, tp: int = 1):
    return functools.partial(PASMegatron, tp=tp, pp=1, nmicros=1, ep=ep)


@pytest.mark.parametrize("world,opt", [(4, "sgd"), (4, "adamw"), (2, "adamw")])
def test_expert_parallel_is_exact(world, opt):
    """ep 2 x dp 2 (expert weights replicated over pairs, summed) and ep 2 alone."""
    model, sample = build("moe")
    assert_exact(parity(model, sample, _ep(2), world, steps=2, opt=opt))


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_dispatch_and_combine_are_one_all_to_all_each(world):
    """Dispatch and combine each send ``(ep-1)/ep`` of the rank's dispatched tokens ``(E, b*C, d)``
    (``b`` the rank's batch) forward, and the same backward; nothing is gathered; each rank holds
    ``E/ep`` experts."""
    model, sample = build("moe")
    moe, ep = model.moe, 2
    b = sample[0].shape[0] // world
    d = moe.w1.shape[1]
    dispatched = moe.experts * b * moe.capacity * d * F32
    a2a = (ep - 1) * dispatched // ep
    plan = cube.plan(model, sample, _ep(ep), world)
    for r, p in plan.program.plans.items():
        kinds = _kinds(plan, r)
        assert kinds.count("all_to_all") == 2 and "all_gather" not in kinds and "chunk" not in kinds, kinds
        sends = step_bytes(p)
        loss_sum = 2 * (world - 1) * F32 // world   # the mean loss's partial sums
        assert (sends["forward"], sends["backward"]) == (2 * a2a + loss_sum, 2 * a2a)
        experts = [b for t, b in p.attrs if t.names[0] in ("moe.w1", "moe.w2")]
        assert [box[0][1] - box[0][0] for box in experts] == [moe.experts // ep] * 2
        # an expert's gradient is complete on its rank; only its replicas (one per ep group) sum it
        summed = {t.names[0]: len(ranks) for t, ranks in p.reduce}
        assert all(summed.get(name, 1) == world // ep for name in ("moe.w1", "moe.w2")), summed


def test_bad_expert_parallel_settings_are_clear_errors():
    moe, moe_sample = build("moe")
    with pytest.raises(ValueError, match=r"ep=3 must divide the data parallel degree dp=4"):
        cube.plan(moe, moe_sample, _ep(3), 4)
    gpt, gpt_sample = build("gpt_nobias")
    with pytest.raises(ValueError, match=r"no expert weights .*\(E, d, f\)"):
        cube.plan(gpt, gpt_sample, _ep(2), 2)
    with pytest.raises(ValueError, match=r"dp=4 does not factor into \{'edp': 3, 'ep': 2\}"):
        cube.DeviceMesh(("dp", 4)).factor("dp", edp=3, ep=2)


def test_mesh_factor_keeps_the_device_order():
    mesh = cube.DeviceMesh(("pp", 2), ("dp", 4), ("tp", 2)).factor("dp", edp=2, ep=2)
    assert mesh.dims == (("pp", 2), ("edp", 2), ("ep", 2), ("tp", 2))
    assert mesh.device(pp=1, edp=1, ep=0, tp=1) == 8 + 4 + 1
    assert [m.devices for m in mesh.select(pp=0, tp=0).slices("edp")] == [(0, 2), (4, 6)]


def test_sequence_parallel_on_hf_llama_is_exact_at_megatron_sp_cost():
    """RMS norms, rotary embeddings, grouped-query attention: the same reduce-scatters and
    all-gathers; around the layers the embedding, split over the vocabulary, all-reduces its output
    (forward only) which is cut (its gradient gathered), and the final norm's output is gathered
    for the column-parallel head (its partial gradient reduce-scattered), whose logits the loss
    reads split (3 floats per row all-reduced)."""
    model, sample = build("hf_llama")
    assert_exact(parity(model, sample, _sp(), 2, steps=2))
    cfg, (b, s), n = model.model.config, sample[0].shape, 2
    piece = (n - 1) * b * s * cfg.hidden_size * F32 // n
    layers = cfg.num_hidden_layers
    plan = cube.plan(model, sample, _sp(n), n)
    for r in range(n):
        vocab = 2 * piece + 2 * (n - 1) * b * s * 3 * F32 // n
        assert step_bytes(plan.program.plans[r]) == {
            "forward": 4 * layers * piece + piece + vocab, "backward": 4 * layers * piece + 2 * piece,
            "gradients": (2 * layers + 1) * 2 * (n - 1) * cfg.hidden_size * F32 // n}


def test_the_search_tries_sequence_parallel_and_its_plan_is_exact():
    """``python -m cube.sim --search`` proposes tensor-parallel plans with and without ``sp``; the
    ``grid_plan`` of one with it trains like eager and sends reduce-scatters, not all-reduces."""
    from cube.sim.search import configs
    from cube.toolkit import grid_plan
    cands = configs(4, 16)
    assert any(c.get("sp") for c in cands) and not any(c.get("sp") and c["tp"] == 1 for c in cands)
    cfg = {"dp": 1, "tp": 2, "pp": 1, "sp": True}
    model, sample = build("gpt_nobias")
    plan = cube.plan(model, sample, lambda g, r: grid_plan(g, r, cfg), 2)
    assert "reduce_scatter" in _kinds(plan)
    assert_exact(parity(model, sample, lambda g, r: grid_plan(g, r, cfg), 2, steps=2, opt="sgd"))
