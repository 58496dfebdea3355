"""State-space mixers under tensor parallel, split as Megatron-LM splits Mamba layers: the input
projection by output features into its x and gate halves (``in_proj(h).transpose(1, 2).chunk(2, 1)``:
``cube.trace.fused`` cuts it through the transpose), the causal depthwise ``conv1d`` by channels (one
group per local channel), ``x_proj`` by input features (partial sums), ``dt_proj`` (``W @ x``) by
output features, the selective scan over each rank's channels and ``out_proj`` by input features.

A scan reads a whole tensor one token at a time (``C[:, i]``) in a matmul split by channels: the
gradients of those reads are summed over the ranks once, at ``C`` (``cube.passes.rank_plans
._sum_earlier``), not once per token, so the plan's collectives do not grow with the sequence.

Checked on a small model written here (each piece alone) and on Hugging Face's Mamba and Jamba as
shipped (``tests.zoo``), trained exactly against the plain model."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cube
from cube.policies.megatron import PASMegatronTP
from tests import zoo
from tests.inprocess import assert_exact, parity

B, E, D, N = 2, 8, 16, 4   # batch, model width, channels of the mixer, state size


class Scan(nn.Module):
    """A Mamba-like mixer written as Hugging Face writes its slow path: a fused input projection cut
    after a transpose, a causal depthwise conv, ``W @ x`` for the step sizes, a loop over tokens. With
    ``scale``, the projection is scaled per feature by a buffer before the cut, as Falcon-H1 scales its
    ``in_proj`` by ``mup_vector`` (each block reads its range of the buffer: ``cube.trace.fused._scale``)."""

    def __init__(self, scale: bool = False):
        super().__init__()
        if scale:
            self.register_buffer("mup", torch.linspace(0.5, 1.5, 2 * D))
        self.scale = scale
        self.in_proj = nn.Linear(E, 2 * D, bias=False)
        self.conv = nn.Conv1d(D, D, 3, groups=D, padding=2)
        self.x_proj = nn.Linear(D, 1 + 2 * N, bias=False)
        self.dt = nn.Parameter(torch.randn(D, 1) / 2)
        self.A = nn.Parameter(-torch.rand(D, N))
        self.out_proj = nn.Linear(D, E, bias=False)

    def forward(self, x, y):
        T = x.shape[1]
        z = self.in_proj(x) * self.mup if self.scale else self.in_proj(x)
        h, gate = z.transpose(1, 2).chunk(2, dim=1)                          # (B, D, T) each
        h = F.silu(self.conv(h)[..., :T])
        step, Bm, Cm = torch.split(self.x_proj(h.transpose(1, 2)), [1, N, N], dim=-1)
        dt = F.softplus(self.dt @ step.transpose(1, 2))                       # (B, D, T)
        dA = torch.exp(self.A[None, :, None, :] * dt[..., None])             # (B, D, T, N)
        dBu = dt[..., None] * Bm[:, None] * h[..., None]
        state, outs = torch.zeros(x.shape[0], D, N), []
        for i in range(T):
            state = dA[:, :, i] * state + dBu[:, :, i]
            outs.append(torch.matmul(state, Cm[:, i].unsqueeze(-1))[..., 0])  # C read one token at a time
        scan = torch.stack(outs, dim=-1) * F.silu(gate)
        return F.mse_loss(self.out_proj(scan.transpose(1, 2)), y)


def _batch(T: int):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(B, T, E, generator=gen), torch.randn(B, T, E, generator=gen)


def _rank0(model, sample):
    return cube.plan(model, sample, PASMegatronTP, 2, strict=True).program.plans[0]


def _collectives(plan) -> int:
    return sum(1 for c in plan.calls if c.step is not None)


@pytest.mark.parametrize("scale", [False, True])
def test_every_projection_and_the_conv_are_split_in_two(scale):
    torch.manual_seed(0)
    plan = _rank0(Scan(scale), _batch(6))
    held = [(t.names[0], t.user_box(b)) for t, b in plan.attrs]
    full = {t.names[0]: t.user_shape for t, _ in plan.attrs}

    def share(name):
        boxes = [b for n, b in held if n == name]
        return sum(torch.Size([e - s for s, e in b]).numel() for b in boxes) / torch.Size(full[name]).numel()

    for name in ("in_proj.weight", "x_proj.weight", "dt", "out_proj.weight", "conv.weight", "conv.bias"):
        assert share(name) == 0.5, (name, [b for n, b in held if n == name])
    pieces = {c.op.name: c for c in plan.calls if c.op is not None}
    conv = pieces["conv1d"]
    assert conv.layout.outputs[0][1] == (0, D // 2), conv.layout.outputs   # its channels, one group each


def test_the_scans_gradient_sums_do_not_grow_with_the_sequence():
    torch.manual_seed(0)
    short, long = _rank0(Scan(), _batch(4)), _rank0(Scan(), _batch(12))
    assert _collectives(short) == _collectives(long), (_collectives(short), _collectives(long))


@pytest.mark.parametrize("opt,scale", [("sgd", False), ("adamw", False), ("sgd", True)])
def test_scan_trains_exactly_under_tensor_parallel(opt, scale):
    torch.manual_seed(0)
    assert_exact(parity(Scan(scale), _batch(6), PASMegatronTP, 2, steps=2, opt=opt, strict=True))


def hf_mixer(name: str):
    """(model, batch, the mixer's channel count) of a Hugging Face state-space zoo model (skips when its
    package is not installed)."""
    if not zoo.installed(name):
        pytest.skip(f"{zoo.PACKAGES[name]} is not installed here")
    model, sample = zoo.build(name, zoo.B)
    cfg = model.model.config
    return model, sample, getattr(cfg, "intermediate_size", None) or cfg.expand * cfg.hidden_size


def halved(plan, size: int):
    """The calls of a mixer (``.mixer``, ``.mamba``) making an output of at least ``size`` elements, and
    those of them the rank makes whole."""
    big = [c for c in plan.calls if c.op is not None and c.op.module_path and
           (".mixer" in c.op.module_path or ".mamba" in c.op.module_path) and
           any(t.numel() >= size for t in c.op.outputs)]
    whole = [f"{c.op.name} ({c.op.where()})" for c in big
             if all(torch.Size([e - s for s, e in b]).numel() == t.numel()
                    for t, b in zip(c.op.outputs, c.layout.outputs))]
    return big, whole


@pytest.mark.parametrize("name", ["mamba", "jamba", "mamba2", "falcon_h1"])
def test_hugging_face_mixer_runs_on_each_ranks_channels(name):
    """Every op of the mixer that makes a ``(B, channels, T)``-sized activation makes half of it on
    rank 0 (before, the mixer ran whole on every rank after an all-gather of ``in_proj``)."""
    model, sample, inner = hf_mixer(name)
    big, whole = halved(_rank0(model, sample), zoo.B * zoo.S * inner)
    assert len(big) > 10 and not whole, (len(big), whole)


@pytest.mark.parametrize("name", ["mamba", "jamba", "mamba2"])
def test_hugging_face_mixer_collectives_do_not_grow_with_the_sequence(name):
    if not zoo.installed(name):
        pytest.skip(f"{zoo.PACKAGES[name]} is not installed here")
    model, _ = zoo.build(name, zoo.B)
    gen = torch.Generator().manual_seed(0)
    counts = []
    for T in (8, 16):
        x = torch.randint(0, zoo.V, (zoo.B, T), generator=gen)
        counts.append(_collectives(_rank0(model, (x, x.clone()))))
    assert counts[0] == counts[1], counts


class Depthwise(nn.Module):
    """Depthwise convolutions, 1-D (Mamba's) and 2-D (ConvNeXt's), between pointwise ones."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(D, D, 3, groups=D, padding=1)
        self.c2 = nn.Conv2d(D, D, 3, groups=D, padding=1, bias=False)
        self.grouped = nn.Conv1d(D, D, 1, groups=2)

    def forward(self, x, y):
        h = F.gelu(self.c1(x))                                   # (B, D, L)
        h = self.c2(h.unflatten(-1, (2, -1))).flatten(-2)        # (B, D, 2, L/2)
        return F.mse_loss(self.grouped(h), y)


def _conv_split(name: str):
    """A policy splitting the first conv ``name`` in two along its channels (input 0, dim 1), the rest
    whole: its pieces call the conv with their own channels as groups."""
    from cube.ir import IRFwOperation
    from cube.ir.follow import place

    def policy(graph, resource):
        first = next(op for op in graph.select(ntype=IRFwOperation) if op.name == name)
        for op in graph.nodes():
            place(graph, op, (0, 1) if op is first else None, [0, 1])
        return graph
    return policy


def test_a_depthwise_conv_splits_its_channels_and_a_grouped_one_keeps_them():
    torch.manual_seed(0)
    c1, c2, grouped = [op for op in cube.trace_model(Depthwise(), _conv_batch()).graph.ops if op.name.startswith("conv")]
    assert c1.algorithms("dim").satisfy(0, 1, 2) and c2.algorithms("dim").satisfy(0, 1, 2), (c1.anno, c2.anno)
    assert not grouped.algorithms("dim").satisfy(0, 1, 2), grouped.anno   # two groups of 8: channels whole


def _conv_batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(B, D, 8, generator=gen), torch.randn(B, D, 8, generator=gen)


@pytest.mark.parametrize("name", ["conv1d", "conv2d"])
def test_a_depthwise_conv_split_by_channels_trains_exactly(name):
    torch.manual_seed(0)
    assert_exact(parity(Depthwise(), _conv_batch(), _conv_split(name), 2, steps=2, opt="sgd"))


def test_grouped_convs_split_along_the_batch_keep_their_groups():
    """Data parallel cuts every conv along the batch: the grouped one keeps its 2 groups, the depthwise
    ones their one group per channel."""
    torch.manual_seed(0)
    assert_exact(parity(Depthwise(), _conv_batch(), "cube.policies.data:PASData", 2, steps=2, opt="sgd",
                        strict=True))


class Scores(nn.Module):
    """Attention of one head without a head dim: ``q @ k^T`` contracts the projections' features."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(E, E) for _ in range(4))

    def forward(self, x, y):
        att = (self.q(x) @ self.k(x).transpose(1, 2)).softmax(-1)
        return F.mse_loss(self.o(att @ self.v(x)), y)


def test_no_column_split_ends_in_partial_sums_of_a_product_of_activations():
    """Split by features, ``q`` would make ``q @ k^T`` a partial sum of ``(B, T, T)`` scores per rank (all
    of them reduced): not a Megatron pair, so ``q`` and ``k`` stay whole; ``v`` and ``o`` make one."""
    torch.manual_seed(0)
    plan = _rank0(Scores(), _batch(6))
    held = {t.names[0]: t.user_box(b) for t, b in plan.attrs}
    assert held["q.weight"] == ((0, E), (0, E)) and held["k.weight"] == ((0, E), (0, E)), held
    assert held["v.weight"] == ((0, E // 2), (0, E)) and held["o.weight"] == ((0, E), (0, E // 2)), held
    assert_exact(parity(Scores(), _batch(6), PASMegatronTP, 2, steps=2, opt="sgd", strict=True))


class DeltaLike(nn.Module):
    """Qwen3-Next's gated delta rule as Hugging Face writes it, reduced to its shapes: q, k and v
    concatenated for one causal depthwise conv and split again; the heads' output and a gate both
    merged into ``(B*T*H, D)`` rows for a gated RMS norm, then restored."""

    H = 4

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.z = (nn.Linear(E, D) for _ in range(4))
        self.conv = nn.Conv1d(3 * D, 3 * D, 3, groups=3 * D, padding=2, bias=False)
        self.weight = nn.Parameter(torch.ones(D // self.H))
        self.o = nn.Linear(D, E)

    def forward(self, x, y):
        b, t, _ = x.shape
        mixed = torch.cat((self.q(x), self.k(x), self.v(x)), dim=-1).transpose(1, 2)
        mixed = F.silu(self.conv(mixed)[..., :t]).transpose(1, 2)
        q, k, v = (m.reshape(b, t, self.H, -1) for m in torch.split(mixed, [D, D, D], dim=-1))
        out = (q * k).sum(-1, keepdim=True).sigmoid() * v                     # (B, T, H, D/H)
        z = self.z(x).view(b, t, self.H, -1)
        shape = z.shape
        out, z = out.reshape(-1, out.shape[-1]), z.reshape(-1, z.shape[-1])    # rows of (B*T*H)
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight * F.silu(z.float())
        return F.mse_loss(self.o(out.reshape(shape).reshape(b, t, -1)), y)


def test_a_concatenation_carried_by_a_depthwise_conv_to_its_cut_runs_per_block():
    torch.manual_seed(0)
    graph = cube.trace_model(DeltaLike(), _batch(6)).graph
    names = [op.name for op in graph.ops]
    assert "cat" not in names and names.count("conv1d") == 3, names
    rows = [op for op in graph.ops if any(t.ndim == 2 and t.shape[0] == B * 6 * DeltaLike.H for t in op.outputs)]
    assert not rows, [op.name for op in rows]   # the gated norm runs on (B, T, H, D/H)
    plan = _rank0(DeltaLike(), _batch(6))
    held = [(t.names[0], t.user_box(b)) for t, b in plan.attrs]
    assert ("conv.weight", ((0, D // 2), (0, 1), (0, 3))) in held, held      # q's channels of the conv
    assert ("q.weight", ((0, D // 2), (0, E))) in held and ("z.weight", ((0, D // 2), (0, E))) in held, held


@pytest.mark.parametrize("policy", [PASMegatronTP, "cube.policies.data:PASData"])
def test_a_concatenation_carried_by_a_depthwise_conv_trains_exactly(policy):
    torch.manual_seed(0)
    assert_exact(parity(DeltaLike(), _batch(6), policy, 2, steps=2, opt="sgd", strict=True))


class LastToken(nn.Module):
    """A classifier on the last token: after an MLP pair, a column-split MLP reads ``h[:, -1]`` of the
    whole ``(B, T, E)`` the first pair's all-reduce makes."""

    def __init__(self):
        super().__init__()
        self.up0, self.down0 = nn.Linear(E, 2 * E), nn.Linear(2 * E, E)
        self.up, self.down = nn.Linear(E, 2 * E), nn.Linear(2 * E, E)

    def forward(self, x, y):
        h = self.down0(F.gelu(self.up0(x)))[:, -1]
        return F.mse_loss(self.down(F.gelu(self.up(h))), y[:, -1])


def test_a_gradient_sum_moves_back_only_where_it_does_not_grow():
    """The sum of the last token's gradient stays on the ``(B, E)`` slice: moved back to the ``(B, T, E)``
    tensor it is cut from, it would sum ``T`` times more."""
    torch.manual_seed(0)
    plan = _rank0(LastToken(), _batch(6))
    sums = [c for c in plan.calls if c.step is not None and c.step.kind == "identity_all_reduce"]
    assert len(sums) == 1 and tuple(c.inputs[0].shape for c in sums) == ((B, E),), [c.inputs[0] for c in sums]
    assert_exact(parity(LastToken(), _batch(6), PASMegatronTP, 2, steps=2, opt="sgd", strict=True))
