"""Spatial partitioning (issue 20): convolutions, pooling and batch norm split along H and W.

Each rank holds an even block of the field; convolution and pooling pieces exchange halos with
their neighbours inside their call (``cube.runtime.halo``), batch norm sums its statistics over
the grid (``cube.runtime.sync_norm``). Every plan trains exactly like the single-device model
(losses and updated parameters, rel <= 1e-5, SGD and AdamW; batch-norm running statistics), on
the in-process world; a split cube cannot compute exactly is refused with a ValueError naming the
op, its source line, the limit and the fix.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cube
import cube.debug
from examples.spatial.model import Stencil, UNet
from cube.policies.spatial import PASSpatial
from tests.inprocess import assert_exact, parity
from tests.parity import global_batches, rel


class CNN(nn.Module):
    """conv (stride 1 and 2, padding, dilation), batch norm, ReLU, max and avg pool, a linear head."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)   # batch norm follows: a bias has no gradient
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.c3 = nn.Conv2d(8, 8, 3, padding=2, dilation=2)
        self.head = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x, y):
        h = F.relu(self.bn(self.c1(x)))
        h = F.max_pool2d(h, 2)
        h = F.max_pool2d(h, 3, 2, 1)
        h = F.avg_pool2d(self.c3(self.c2(h)), 3, 1, 1)
        return F.cross_entropy(self.head(h.flatten(1)), y)


class Mixed(nn.Module):
    """Depthwise and grouped convolutions, a 5 x 5 kernel, an even kernel with stride, a 1-D
    convolution, adaptive average pooling."""

    def __init__(self):
        super().__init__()
        self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.grouped = nn.Conv2d(4, 8, 5, padding=2, groups=2)
        self.even = nn.Conv2d(8, 8, 2, stride=2)
        self.line = nn.Conv1d(8, 8, 3, padding=1)

    def forward(self, x):
        h = self.even(F.relu(self.grouped(self.dw(x))))              # (b, 8, 16, 16)
        h = F.adaptive_avg_pool2d(h, 8)                               # (b, 8, 8, 8)
        line = self.line(h.mean(3))                                   # (b, 8, 8): conv1d over H
        return (h.square().mean() + line.square().mean())


def _sample(shape, classes=None):
    x = torch.randn(*shape)
    return (x, torch.randint(0, classes, (shape[0],))) if classes else (x, torch.randn(*shape))


CASES = {
    "cnn": lambda: (CNN(), _sample((4, 3, 32, 32), classes=10)),
    "unet": lambda: (UNet(cin=3, cout=2, width=4), (torch.randn(2, 3, 16, 16), torch.randn(2, 2, 16, 16))),
    "stencil": lambda: (Stencil(channels=2, steps=3), _sample((2, 2, 16, 16))),
}


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("dims,world", [("H", 2), ("HW", 4)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_spatial_plan_trains_like_eager(name, dims, world, opt):
    torch.manual_seed(0)
    model, sample = CASES[name]()
    assert_exact(parity(model, sample, functools.partial(PASSpatial, dims=dims), world, steps=2, opt=opt), 1e-5)


def test_mixed_kernels_depthwise_and_conv1d_split():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 32, 32)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = Mixed()

        def forward(self, x):
            return self.m(x)
    assert_exact(parity(Wrap(), (x,), functools.partial(PASSpatial, dims="HW"), 4, steps=2), 1e-5)


def _trained_buffers(model, sample, policy, world, steps=2):
    """Running statistics after ``steps`` SGD steps: the compiled module's pieces on every rank and
    the plain model's."""
    batches = global_batches(sample, steps)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=1e-2)
    for b in batches:
        ref(*b).backward()
        opt.step()
        opt.zero_grad()
    want = dict(ref.named_buffers())

    def body():
        it = iter(batches)

        @cube.compile(copy.deepcopy(model), it, PAS=policy)
        def train_iter(model, dataloader):
            loss = model(*next(dataloader))
            loss.backward()
            return loss
        gen = cube.load_model()
        gopt = torch.optim.SGD(gen.parameters(), lr=1e-2)
        for _ in range(steps):
            train_iter(gen, it)
            gopt.step()
            gopt.zero_grad()
        return {gen.BUFFERS[k][0][0]: v.detach().clone() for k, v in gen.named_buffers() if k in gen.BUFFERS}
    return cube.debug.run(body, world), want


@pytest.mark.parametrize("policy,world", [(functools.partial(PASSpatial, dims="HW"), 4),
                                          ("cube.policies.data:PASData", 2)], ids=["spatial-2x2", "batch-2"])
def test_batch_norm_running_stats_equal_single_device(policy, world):
    torch.manual_seed(0)
    model, sample = CASES["cnn"]()
    got, want = _trained_buffers(model, sample, policy, world)
    for rank_buffers in got:
        assert set(rank_buffers) == set(want)
        for name, value in rank_buffers.items():
            if value.is_floating_point():
                assert rel(value, want[name]) <= 1e-5, (name, value, want[name])
            else:
                assert value.item() == want[name].item(), name


def test_batch_norm_splits_the_batch_under_data_parallel():
    """PASData splits batch norm along the batch (global statistics), no longer gathers around it."""
    model, sample = CASES["cnn"]()
    plan = cube.plan(model, sample, "PASData", 2)
    assert "runtime.sync_norm.batch_norm(" in plan.source(0) and "ranks=(0, 1)" in plan.source(0)


def test_halo_bytes_are_the_geometry_and_the_simulator_counts_them():
    """A 3 x 3 stencil split 2 x 2 sends each neighbour one row per conv along H, then one column of
    the H window (so the corner goes along); the simulator counts them as point-to-point messages."""
    from cube.sim.api import simulate_policy
    from cube.sim.comm import CommModel, default_backend
    from cube.sim.costs import Estimator
    from cube.sim.program import Builder
    torch.manual_seed(0)
    b, c, n = 2, 2, 16
    model, sample = Stencil(channels=c, steps=3), _sample((b, c, n, n))
    policy = functools.partial(PASSpatial, dims="HW")
    plan = cube.plan(model, sample, policy, 4)
    calls = [call for call in plan.program[0].plan.calls if call.inside is not None]
    assert len(calls) == 3
    row = b * c * (n // 2) * 4              # one row of the block, float32
    col = b * c * (n // 2 + 2) * 4          # one column of the H window: block, halo row, border row
    for call in calls:
        assert dict(call.inside.p2p) == {2: row, 1: col}
        assert dict(call.inside.recvs) == {2: row, 1: col}
    res = simulate_policy(model, sample, policy, 4, costs=Estimator(), comm=CommModel(default_backend()))
    assert res.step_time > 0
    program = Builder(plan.graph, plan.program[0], Estimator(), CommModel(default_backend())).build()
    halo = [i for i in program.ins if i.op == "send" and i.key[1][0] == "inside"]
    assert len(halo) == 2 * 2 * 3                     # 2 neighbours, forward and backward, 3 convs
    assert sum(i.nbytes for i in halo) == 2 * 3 * (row + col)


# ---------------------------------------------------------------------------------------------- errors
class One(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):
        return self.op(x).sum()


def _split(op_module, shape, dim, num, name):
    graph = cube.trace_model(One(op_module), (torch.randn(*shape),)).graph
    node = graph.select(name=name)[0]
    return graph.partition(node, node.algorithms("dim"), idx=0, dim=dim, num=num)


@pytest.mark.parametrize("module,shape,num,match", [
    (nn.Conv2d(2, 2, 3, padding=3, dilation=3), (1, 2, 8, 8), 4,
     r"kernel spans 7 rows along dim 2 \(a halo of up to 3\), more than a piece's 2 rows \(a split finer.*"
     r"at most 1 pieces"),
    (nn.Conv2d(2, 2, 5, padding=2), (1, 2, 16, 16), 8, r"kernel spans 5 rows.* more than a piece's 2 rows.*"
     r"Split into at most 2 pieces"),
    (nn.Conv2d(2, 2, 3, padding=1), (1, 2, 12, 12), 8, r"uneven split|do not both divide"),
    (nn.Conv2d(2, 2, 2, padding=1, stride=2), (1, 2, 10, 10), 2, r"stride 2 does not divide the piece size 5"),
    (nn.AvgPool2d(3, 1, 1, count_include_pad=False), (1, 2, 8, 8), 2, r"count_include_pad=False"),
    (nn.MaxPool2d(3, 2, ceil_mode=True), (1, 2, 8, 8), 2, r"ceil_mode=True"),
], ids=["halo-wider-than-piece", "kernel-larger-than-piece", "uneven", "stride", "count-include-pad", "ceil"])
def test_splits_cube_cannot_compute_exactly_are_refused(module, shape, num, match):
    name = "conv2d" if isinstance(module, nn.Conv2d) else \
        ("avg_pool2d" if isinstance(module, nn.AvgPool2d) else "max_pool2d")
    with pytest.raises(ValueError, match=match) as info:
        _split(module, shape, 2, num, name)
    assert f"op {name!r} (module 'op', " in str(info.value) and "test_spatial.py:" in str(info.value)


def test_policy_keeps_ops_whole_where_a_split_would_be_refused():
    """PASSpatial leaves an op it cannot split exactly whole (its inputs gathered): still exact."""
    torch.manual_seed(0)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, padding=1)
            self.big = nn.Conv2d(2, 2, 5, padding=2)

        def forward(self, x):
            return self.big(self.conv(x)).square().mean()
    x = torch.randn(1, 2, 8, 8)
    graph = PASSpatial(cube.trace_model(Wrap(), (x,)).graph, type("R", (), {"ngpus": 4})(), dims="H")
    big = [op for op in graph.select(name="conv2d") if op.root.inputs[1].shape[-1] == 5]
    assert len(big) == 4 and all(not op.splits for op in big)
    assert_exact(parity(Wrap(), (x,), functools.partial(PASSpatial, dims="H"), 4, steps=2), 1e-5)


# ------------------------------------------------------------------------- transposed convolutions,
# bilinear upsampling, group and instance norm
def _unet(up, norm):
    return lambda: (UNet(cin=3, cout=2, width=4, up=up, norm=norm),
                    (torch.randn(2, 3, 16, 16), torch.randn(2, 2, 16, 16)))


UNETS = {"unet-transpose-group": _unet("transpose", "group"), "unet-bilinear-group": _unet("bilinear", "group")}


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("dims,world", [("H", 2), ("HW", 4)])
@pytest.mark.parametrize("name", sorted(UNETS))
def test_unet_upsampling_and_group_norm_train_like_eager(name, dims, world, opt):
    """ConvTranspose2d (stride 2) or bilinear up-sampling, GroupNorm: every op split, exact."""
    torch.manual_seed(0)
    model, sample = UNETS[name]()
    policy = functools.partial(PASSpatial, dims=dims)
    source = cube.plan(model, sample, policy, world).source(0)
    split = "runtime.halo.stencil(aten.conv_transpose2d" if "transpose" in name else "runtime.halo.linear("
    assert split in source and "runtime.sync_norm.group_norm(" in source
    assert_exact(parity(model, sample, policy, world, steps=2, opt=opt), 1e-5)


def _transposed_blocks(module, x, num, dim=2):
    """Each of ``num`` output blocks along ``dim`` computed as a piece does: the op without padding
    on its window (zero rows outside the input), cropped. Returns (blocks, eager output)."""
    from cube.ir import halo
    graph = cube.trace_model(One(module), (x,)).graph
    op = graph.select(name=f"conv_transpose{x.dim() - 2}d")[0]
    halo.check(op, dim, num)
    st = halo.stencil(op, dim)
    nsp = x.dim() - 2
    pad = list(module.padding)
    pad[dim - 2] = 0
    opad = list(module.output_padding)
    opad[dim - 2] = 0
    conv = getattr(F, f"conv_transpose{nsp}d")
    block = st.size_out // num
    blocks = []
    for i, (a, b) in enumerate(halo.windows(op, dim, num)):
        lo, hi = max(a, 0), min(b, st.size_in)
        win = x.narrow(dim, lo, hi - lo)
        zeros = [0] * (2 * nsp)
        k = 2 * (x.dim() - 1 - dim)   # F.pad lists the last dim first
        zeros[k], zeros[k + 1] = lo - a, b - hi
        y = conv(F.pad(win, zeros), module.weight, module.bias, module.stride, pad, opad, module.groups,
                 module.dilation)
        blocks.append(y.narrow(dim, st.crop(i * block, (i + 1) * block), block))
    return blocks, module(x)


@pytest.mark.parametrize("kw,num", [
    (dict(kernel_size=2, stride=2), 4),
    (dict(kernel_size=3, stride=2, padding=1, output_padding=1), 4),
    (dict(kernel_size=4, stride=2, padding=1), 8),
    (dict(kernel_size=3, stride=1, padding=1), 8),
    (dict(kernel_size=1, stride=2, output_padding=1), 4),        # stride > kernel: rows only the bias reaches
    (dict(kernel_size=2, stride=3, output_padding=1), 4),
    (dict(kernel_size=3, stride=2, padding=2, dilation=2, output_padding=1), 4),
    (dict(kernel_size=5, stride=1, padding=0), 2),               # grows: 8 -> 12 rows
    (dict(kernel_size=3, stride=3, padding=0), 8),
], ids=["k2s2", "k3s2p1op1", "k4s2p1", "k3s1p1", "k1s2op1", "k2s3op1", "dilated", "valid-k5", "k3s3"])
@pytest.mark.parametrize("groups", [1, 4])
def test_conv_transpose_windows_compute_every_output_block(kw, num, groups):
    """Geometry alone (no processes): each output block, computed on its window and cropped, equals
    the eager output's block, for strides above and below the kernel, padding, output padding,
    dilation, grouped (depthwise) and not; in 1-D and 2-D."""
    torch.manual_seed(0)
    for nsp in (1, 2):
        module = getattr(nn, f"ConvTranspose{nsp}d")(4, 4, groups=groups, **kw)
        x = torch.randn(2, 4, *[8] * nsp)
        blocks, want = _transposed_blocks(module, x, num)
        assert torch.allclose(torch.cat(blocks, 2), want, atol=1e-6), (kw, nsp)


@pytest.mark.parametrize("kw,shape,num", [
    (dict(kernel_size=3, stride=2, padding=1, output_padding=1), (1, 2, 4, 4, 4), 2),
    (dict(kernel_size=2, stride=2), (1, 2, 4, 4, 4), 4),
], ids=["k3s2p1op1", "k2s2"])
def test_conv_transpose3d_split_trains_like_eager(kw, shape, num):
    torch.manual_seed(0)
    model = One(nn.ConvTranspose3d(2, 2, **kw))
    policy = functools.partial(PASSpatial, dims="D")
    assert "runtime.halo.stencil(aten.conv_transpose3d" in cube.plan(model, (torch.randn(*shape),), policy,
                                                                       num).source(0)
    assert_exact(parity(model, (torch.randn(*shape),), policy, num, steps=2), 1e-5)


class _Conv1dTransposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose1d(4, 4, 3, stride=2, padding=1, output_padding=1, groups=4)
        self.mix = nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.mix(self.up(x)).sin().mean()


def test_conv_transpose1d_depthwise_split_trains_like_eager():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 16)
    policy = functools.partial(PASSpatial, dims="H")
    assert_exact(parity(_Conv1dTransposed(), (x,), policy, 4, steps=2, opt="adamw"), 1e-5)


class _Bilinear(nn.Module):
    def __init__(self, scale, align_corners):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.scale, self.align_corners = scale, align_corners

    def forward(self, x):
        return F.interpolate(self.conv(x), scale_factor=self.scale, mode="bilinear",
                             align_corners=self.align_corners).sin().mean()


@pytest.mark.parametrize("scale,align", [(2, False), (2, True), (3, False), (4, True)])
def test_bilinear_split_over_a_grid_trains_like_eager(scale, align):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 12)
    policy = functools.partial(PASSpatial, dims="HW")
    plan = cube.plan(_Bilinear(scale, align), (x,), policy, 4)
    assert "runtime.halo.linear(" in plan.source(0)
    if scale == 2 and not align:   # the geometry's halo: one input row (column) each side, no more
        call = next(c for c in plan.program[0].plan.calls if c.inside is not None and c.inside.fn.endswith("linear"))
        assert [w[0] for _, _, _, w in call.inside.kwargs["halo"]] == [(0, 5), (0, 7)]
    assert_exact(parity(_Bilinear(scale, align), (x,), policy, 4, steps=2), 1e-5)


class _Norms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.inorm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)
        self.gnorm = nn.GroupNorm(2, 4)

    def forward(self, x):
        return self.gnorm(self.inorm(self.conv(x))).sin().mean()


def _batch_by_h(graph, resource):
    """Fields split 2 along the batch x 2 along H: group norm sums over H only, instance norm's
    running statistics over all four."""
    from cube.ir.operator import IRFwOperation
    from cube.mesh import DeviceMesh
    from cube.toolkit import place
    mesh = DeviceMesh(("b", 2), ("h", 2))
    for op in graph.nodes():
        if isinstance(op, IRFwOperation) and op.inputs and op.inputs[0].ndim == 4 and op.anno is not None:
            place(graph, op, mesh, b=(0, 0), h=(0, 2))
        else:
            place(graph, op, mesh)
    return graph


@pytest.mark.parametrize("policy,world", [(functools.partial(PASSpatial, dims="HW"), 4),
                                          ("cube.policies.data:PASData", 2), (_batch_by_h, 4)],
                         ids=["spatial-2x2", "batch-2", "batch-2-x-H-2"])
def test_instance_norm_running_stats_equal_single_device(policy, world):
    """Instance norm's running statistics average over the whole batch: split along the batch
    (PASData), the grid, or both, they equal the single-device module's; so do the parameters."""
    torch.manual_seed(0)
    model, sample = _Norms(), (torch.randn(4, 3, 8, 8),)
    if policy is _batch_by_h:
        source = cube.plan(model, sample, policy, world).source(2)
        assert "ranks=(0, 1, 2, 3), batch=(2, 4)" in source and "ranks=(2, 3), batch=(0, 2)" in source
    got, want = _trained_buffers(model, sample, policy, world)
    for rank_buffers in got:
        assert set(rank_buffers) == set(want)
        for name, value in rank_buffers.items():
            if value.is_floating_point():
                assert rel(value, want[name]) <= 1e-5, (name, value, want[name])
    assert_exact(parity(model, sample, policy, world, steps=2), 1e-5)


def _recompute_all(graph, resource, dims="H"):
    """PASSpatial with every forward op that may run twice in one recompute group."""
    from cube.ir.blocks import rerun_hazard
    from cube.ir.operator import IRFwOperation
    graph.recompute([op for op in graph.nodes() if isinstance(op, IRFwOperation) and not rerun_hazard(op)])
    return PASSpatial(graph, resource, dims=dims)


@pytest.mark.parametrize("name,dims,world", [("stencil", "HW", 4), ("unet-transpose-group", "H", 2),
                                             ("unet-bilinear-group", "HW", 4)])
def test_halo_pieces_inside_a_recompute_run_stay_exact(name, dims, world):
    """Halo exchanges and summed statistics re-run in backward on every member: the run turns
    checkpoint's early stop off even when it holds no collective step."""
    torch.manual_seed(0)
    model, sample = {**CASES, **UNETS}[name]()
    policy = functools.partial(_recompute_all, dims=dims)
    source = cube.plan(model, sample, policy, world).source(0)
    assert "torch.utils.checkpoint.checkpoint(self._recompute_0" in source
    assert "set_checkpoint_early_stop(False)" in source
    assert_exact(parity(model, sample, policy, world, steps=2), 1e-5)


@pytest.mark.parametrize("module,shape,num,name,match", [
    (nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1), (1, 2, 8, 8), 2, "conv_transpose2d",
     r"input size 8 and output size 15, which 2 pieces do not both divide \(uneven split\).*output_padding"),
    (nn.ConvTranspose2d(2, 2, 7, padding=3), (1, 2, 8, 8), 8, "conv_transpose2d",
     r"piece 0 reads 3 rows of its neighbours along dim 2, more than a piece of 1 rows.*"
     r"Split into at most 2 pieces"),
    (nn.ConvTranspose1d(2, 2, 4, stride=1), (1, 2, 8), 4, "conv_transpose1d",
     r"input size 8 and output size 11"),
    (nn.Upsample(scale_factor=0.25, mode="bilinear"), (1, 2, 16, 16), 8, "upsample_bilinear2d",
     r"input size 16 and output size 4, which 8 pieces do not both divide"),
], ids=["transposed-uneven-output", "transposed-reach", "transposed-1d-uneven", "bilinear-uneven"])
def test_transposed_and_bilinear_splits_cube_cannot_compute_are_refused(module, shape, num, name, match):
    with pytest.raises(ValueError, match=match) as info:
        _split(module, shape, 2, num, name)
    assert f"op {name!r} (module 'op', " in str(info.value) and "test_spatial.py:" in str(info.value)
