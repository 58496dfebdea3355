"""What cube knows about each op, one ``OpInfo`` per op name, in one table.

Every part of cube that treats an op differently by its name reads it here:
the annotation rule that says how it splits (``rule``, by the name of a rule
function in ``cube.trace.rules``), how a piece is called (a bias added once
across partial sums, a view's shape, a mean loss's global count), what it
costs (``flops``, ``op_bytes``), whether its output aliases its input (memory),
whether autograd keeps its output (an all-reduce may then sum in place), and
what makes re-running it unsafe (running statistics). Adding an op is adding a
row; ``cube.register_op`` adds a row for a user's op. An op with no row gets
``OpInfo(name)``: no rule (it runs replicated; a policy splitting it gets an
error saying how to register one) and no special behaviour.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional, Sequence, Tuple

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class OpInfo:
    """One op's behaviour.

    Attributes:
        name: the op name (``aten.linear.default`` -> ``linear``).
        rule: the name of its annotation rule in ``cube.trace.rules.RULES`` (None: none).
        cost: how its FLOPs are counted: ``"matmul"`` (``2 x outputs x reduced size``),
            ``"conv"``, ``"attention"``, ``"experts"`` (a fused MoE layer: its grouped matmuls,
            ``2 x rows x in x out`` per expert weight), or ``"memory"`` (bound by the bytes it moves).
        batched: a matmul of two activations (``bmm``, ``einsum``), not of an input and a weight.
        alias: its output is a view of input 0 (no new memory, no bytes moved).
        same_elements: its output holds input 0's elements, possibly reshaped (a loss's
            targets are traced back to the batch through it).
        shape_view: a ``view`` whose input may come with other strides on a rank (printed as
            ``reshape``).
        bias: the input added to the result (a bias), which a partial-sum piece adds once.
        running_stats: the argument under which it updates running statistics in place
            (re-running it in backward would update them twice).
        counts_targets: a mean over valid targets (``ignore_index``, class weights): pieces
            divide by the global count.
        mean_loss: a mean over every element (``mse_loss``): pieces divide by the global size.
        saves_output: autograd keeps its output for backward (else a partial sum it made may
            be summed in place).
        saves_inputs: autograd keeps its float inputs for backward (False: its gradient needs
            only their shapes: ``add``, ``sub``, casts and copies); what the simulator's estimates
            hold when no profile says.
        autocast: what ``torch.autocast`` (CUDA's lists) makes of its float outputs: ``"low"`` the
            autocast dtype (matrix products, convolutions, attention), ``"fp32"`` float32
            (normalizations, softmax, losses, reductions, exp/log), ``"cast"`` the dtype it names
            (``.to(dtype)``, ``.float()``); None: the widest of its float inputs.
        inside: how a piece split along a ``~`` factor of its annotation communicates inside its
            own call: ``"halo"`` (it reads a window of its input, exchanged with its neighbours:
            convolutions, pooling), ``"halo_transposed"`` (a window, then its block cropped out of
            the larger output: transposed convolutions), ``"halo_linear"`` (a window interpolated
            at the global coordinates: bilinear upsampling), ``"stats"`` (it normalizes by
            statistics summed over its group: batch norm), ``"group_stats"`` (statistics per
            sample and group summed over its group: group and instance norm), ``"ring"`` (key/value
            blocks passed around a ring of ranks: attention split along the sequence), ``"gather_kv"``
            (keys and values all-gathered along the sequence, their gradients reduce-scattered back:
            ``flex_attention`` split along the sequence, each piece its block of queries),
            ``"experts"`` (a fused MoE layer split by experts: its tokens reach the ranks holding their
            experts by all-to-all, ``cube.ir.experts``), ``"vocab_lookup"`` (an embedding split along its table's rows looks up the ids in its
            range, and the pieces' outputs are summed), ``"vocab_loss"`` (a cross entropy split
            along its classes sums the logits' statistics over its group), ``"scan"`` (a cumsum split
            along its dim adds the totals of the blocks before it, exchanged over its group); a row of
            ``cube.passes.inside.KINDS``.
        half: how it runs in the weights' low precision (``precision="bf16"``/``"fp16"``, no
            autocast; ``cube.passes.precision``): ``"fp32"`` its float inputs widened to float32
            (losses: their value and the log-probabilities behind it in float32), ``"fp32_cpu"``
            the same on the CPU with its output rounded back (``log_softmax``: the CPU kernel
            rounds an intermediate to bf16; CUDA's computes in float32); ``"same"`` its float
            inputs in one dtype, the low precision where they differ (norms: a float32 input and
            bf16 weights); ``"stats"`` its weight and bias (arguments 1 and 2) in float32 beside
            its float32 running statistics (batch norm: the kernels' mixed mode); None: in its
            inputs' dtype, as the kernels do (norms, softmax and attention keep float32
            statistics inside).
        grad_free: its outputs never need a gradient, whatever it reads, as torch marks them:
            ``detach`` and ``zeros_like``/``rand_like`` and their kin, which read only their input's
            shape, dtype and device. What it reads then returns no gradient (a sender waiting for
            one would wait forever).
    """

    name: str
    rule: Optional[str] = None
    cost: str = "memory"
    batched: bool = False
    alias: bool = False
    same_elements: bool = False
    shape_view: bool = False
    bias: Optional[int] = None
    running_stats: Optional[str] = None
    counts_targets: bool = False
    mean_loss: bool = False
    saves_output: bool = True
    inside: Optional[str] = None
    saves_inputs: bool = True
    autocast: Optional[str] = None
    half: Optional[str] = None
    grad_free: bool = False


_ROWS: Dict[str, OpInfo] = {}


def _add(names: str, **fields) -> None:
    for name in names.split():
        _ROWS[name] = replace(_ROWS[name], **fields) if name in _ROWS else OpInfo(name, **fields)


# annotation rules
_add("""abs add add_ sub sub_ rsub mul mul_ div div_ neg exp log log1p sqrt rsqrt pow sin cos tanh sigmoid
relu relu_ gelu gelu_ silu silu_ hardtanh leaky_relu elu mish softplus erf clamp clamp_min clamp_max minimum
maximum where masked_fill masked_fill_ le lt ge gt eq ne logical_not logical_and logical_or bitwise_not
bitwise_and bitwise_or __and__ __or__ dropout dropout_ alpha_dropout contiguous clone alias detach detach_
lift_fresh_copy to _to_copy zeros_like ones_like full_like empty_like rand_like randn_like fill fill_ zero
zero_ copy_ reciprocal square floor ceil round sign native_dropout broadcast_tensors floor_divide remainder fmod
trunc isnan isinf bitwise_xor __xor__ xlogy expm1 hardswish hardsigmoid log_sigmoid""", rule="elementwise")
_add("glu", rule="glu")
_add("prelu", rule="prelu")
_add("im2col", rule="im2col")
# random numbers of their input's shape (the functional forms of ``x.exponential_()``... that tracing makes, and
# what stays in place on a copy): elementwise, so a batch, sequence or head split carries through them; each
# piece draws its own numbers (cube.runtime.rng)
_add("""exponential exponential_ uniform uniform_ normal_ normal_functional bernoulli bernoulli_ random random_
randint_like geometric geometric_ log_normal log_normal_ cauchy cauchy_""", rule="elementwise")
_add("normal", rule="drawn")   # normal(mean, std): elementwise over its tensors; normal(0., 1., size): creation
_add("linear", rule="linear")
_add("addmm", rule="addmm")
_add("baddbmm", rule="baddbmm")
_add("matmul mm bmm", rule="matmul")
_add("einsum", rule="einsum")
_add("scaled_dot_product_attention", rule="sdpa", inside="ring")
# a grouped matmul by sorted rows' group offsets: whole, its rows carried by the token-local dispatch region it
# sits in (cube.ir.dispatch), its experts split by expert parallel (cube.ir.experts' fused layer)
_add("_grouped_mm", rule="opaque")
_add("moe_experts", inside="experts")   # cube.ir.experts: a fused sort-dispatch MoE layer
_add("flex_attention", rule="flex_attention", inside="gather_kv")   # cube.trace.flex's ops
_add("block_mask", rule="block_mask")
_add("embedding", rule="embedding", inside="vocab_lookup")
_add("layer_norm", rule="layer_norm")
_add("rms_norm", rule="rms_norm")
_add("batch_norm", rule="batch_norm", inside="stats")
_add("group_norm instance_norm", rule="group_norm", inside="group_stats")
_add("conv1d conv2d conv3d", rule="conv", inside="halo")
_add("conv_transpose1d conv_transpose2d conv_transpose3d", rule="conv_transpose", inside="halo_transposed")
_add("upsample_bilinear2d", rule="pool", inside="halo_linear")
_add("""max_pool1d max_pool2d max_pool3d avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d
adaptive_avg_pool3d upsample_nearest1d upsample_nearest2d upsample_nearest3d""", rule="pool", inside="halo")
_add("max_pool2d_with_indices adaptive_max_pool2d", rule="pool")
_add("sum mean", rule="sum_rule")
_add("amax amin max min argmax logsumexp", rule="max_rule")
_add("norm linalg_vector_norm", rule="norm_rule")
_add("cross_entropy_loss nll_loss", rule="loss")
_add("cross_entropy_loss", inside="vocab_loss")
_add("mse_loss l1_loss smooth_l1_loss", rule="pointwise_loss")
_add("softmax _softmax log_softmax _log_softmax", rule="along_dim")
_add("cumsum", rule="scan", inside="scan")
_add("triu tril", rule="along_last_two")
_add("view reshape _unsafe_view flatten unflatten unsqueeze squeeze view_as", rule="reshape")
_add("transpose swapaxes permute t numpy_T", rule="permute")
_add("expand expand_as", rule="expand")
_add("select", rule="select")
_add("slice", rule="slice_rule")
_add("split split_with_sizes chunk", rule="split")
_add("unbind", rule="unbind")
_add("slice_scatter select_scatter", rule="slice_scatter")
_add("cat concat", rule="cat")
_add("stack", rule="stack")
_add("pad constant_pad_nd", rule="pad", inside="halo")
_add("arange zeros ones full empty rand randn randint scalar_tensor tensor eye", rule="creation")
_add("diff", rule="diff")
_add("""new_ones new_zeros new_full new_empty index_put scatter masked_select nonzero
one_hot repeat flip roll""", rule="opaque")
_add("scatter scatter_add scatter_reduce", rule="scatter")
_add("repeat_interleave", rule="repeat_interleave")
_add("view_as_complex view_as_real", rule="view_as_complex")
_add("index", rule="index")
_add("index_select", rule="index_select")
_add("gather", rule="gather")
_add("topk sort argsort", rule="topk")
_add("histc bincount", rule="count")

# costs and memory
_add("linear addmm matmul mm", cost="matmul")
_add("bmm baddbmm einsum", cost="matmul", batched=True)
_add("conv1d conv2d conv3d convolution", cost="conv")
_add("scaled_dot_product_attention", cost="attention")
_add("moe_experts", cost="experts")
_add("""view _unsafe_view reshape transpose permute expand t unsqueeze squeeze select slice alias detach
unflatten flatten split chunk unbind narrow as_strided view_as expand_as view_as_complex view_as_real""", alias=True)
_add("linear mm addmm bmm baddbmm matmul einsum embedding convolution conv1d conv2d conv3d", saves_output=False)
_add("conv_transpose1d conv_transpose2d conv_transpose3d", saves_output=False)
_add("""add add_ sub sub_ neg clone contiguous alias detach detach_ lift_fresh_copy to _to_copy cat concat stack
pad constant_pad_nd zeros_like ones_like full_like empty_like fill fill_ zero zero_ sum""", saves_inputs=False)

# mixed precision (torch.autocast's op lists, CUDA)
_add("""linear addmm matmul mm bmm baddbmm einsum conv1d conv2d conv3d convolution conv_transpose1d conv_transpose2d
conv_transpose3d scaled_dot_product_attention prelu""", autocast="low")
_add("""layer_norm group_norm norm softmax _softmax log_softmax _log_softmax cumsum exp log log1p rsqrt reciprocal pow
sum prod softplus cross_entropy_loss nll_loss mse_loss l1_loss smooth_l1_loss""", autocast="fp32")
_add("to _to_copy", autocast="cast")
# the half-precision recipe's float32 islands (cube.passes.precision)
_add("""cross_entropy_loss nll_loss nll_loss_nd nll_loss2d mse_loss l1_loss smooth_l1_loss huber_loss kl_div
binary_cross_entropy binary_cross_entropy_with_logits""", half="fp32")
_add("log_softmax _log_softmax", half="fp32_cpu")
_add("layer_norm rms_norm group_norm", half="same")
_add("batch_norm instance_norm", half="stats")

# outputs autograd never tracks (torch's derivatives mark them not differentiable)
_add("detach detach_ zeros_like ones_like full_like empty_like rand_like randn_like randint_like histc", grad_free=True)

# how a piece is called
_add("view reshape _unsafe_view flatten contiguous clone detach squeeze unsqueeze", same_elements=True)
_add("view _unsafe_view", shape_view=True)
_add("linear conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d", bias=2)
_add("addmm", bias=0)
_add("cross_entropy_loss nll_loss", counts_targets=True)
_add("mse_loss l1_loss smooth_l1_loss", mean_loss=True)

# what must not run twice (their schemas do not say they write)
_add("batch_norm native_batch_norm", running_stats="training")
_add("instance_norm", running_stats="use_input_stats")

BUILTIN = frozenset(_ROWS)

# the cost of ops cube has no annotation rule for (added after BUILTIN: they stay outside it):
# Hugging Face's grouped expert matmuls, one expert's matrix per row of their first input (batched:
# not a linear layer's product of an input and a weight, which tensor parallel splits)
_add("_grouped_mm grouped_mm_fallback", cost="matmul", batched=True)


# ATen's aliases (``torch.multiply`` traces to ``aten.multiply``): the trace records the op they name, so every
# row, rule and pass that knows ``mul`` knows ``multiply`` (``cube.trace.builder``)
ALIASES = dict(multiply="mul", multiply_="mul_", divide="div", divide_="div_", subtract="sub", subtract_="sub_",
               true_divide="div", true_divide_="div_", greater="gt", greater_="gt_", greater_equal="ge",
               greater_equal_="ge_", less="lt", less_="lt_", less_equal="le", less_equal_="le_", not_equal="ne",
               not_equal_="ne_", absolute="abs", absolute_="abs_", arccos="acos", arcsin="asin", arctan="atan",
               arctan2="atan2", arccosh="acosh", arcsinh="asinh", arctanh="atanh", fix="trunc", fix_="trunc_",
               negative="neg", negative_="neg_", clip="clamp", clip_="clamp_", special_expit="sigmoid",
               special_erf="erf", concatenate="cat")


def op_info(name: str) -> OpInfo:
    """The row of op ``name`` (``OpInfo(name)`` when cube has none)."""
    row = _ROWS.get(name)
    return row if row is not None else OpInfo(name)


def register(name: str, **fields) -> OpInfo:
    """Adds or changes the row of op ``name`` (``cube.register_op`` gives a user's op its rule)."""
    _add(name, **fields)
    return _ROWS[name]


def rows() -> Dict[str, OpInfo]:
    """Every row, by op name."""
    return dict(_ROWS)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def flops(name: str, ins: Sequence[Shape], outs: Sequence[Shape]) -> int:
    """Floating point operations of the op's forward at these input and output shapes (0 for an op
    bound by memory).

    Matmul-like ops: ``2 x outputs x reduced size`` (the last dim of the first matrix input);
    attention: the two matmuls (``QK^T`` and ``PV``) over all query/key pairs; convolutions:
    ``2 x outputs x weight size per output channel``; a fused MoE layer (``moe_experts``): every
    (token, expert) row of its output through each expert weight ``(E, a, b)`` it reads (its
    3-dim inputs), ``2 x rows x a x b`` each (the grouped matmuls; routing and gathers are bound
    by memory).
    """
    if not outs:
        return 0
    info = op_info(name)
    out = _numel(outs[0])
    if info.cost == "matmul":
        mats = [s for s in ins if len(s) >= 2]
        return 2 * out * max(mats[0][-1] if mats else 1, 1)
    if info.cost == "attention" and len(ins) >= 3:
        q, k, v = ins[:3]
        pairs = _numel(q) // max(q[-1], 1) * k[-2]
        return 2 * pairs * (q[-1] + v[-1])
    if info.cost == "experts":
        return sum(2 * outs[0][0] * s[1] * s[2] for s in ins if len(s) == 3)
    if info.cost == "conv" and len(ins) >= 2:
        w = ins[1]
        return 2 * out * (_numel(w) // max(w[0], 1))
    return 0
