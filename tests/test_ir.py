"""IR, annotations and rules: no processes needed."""
import pytest
import torch

from cube.ir import IRDataOperation, IRFwOperation, parse_annotation
from cube.trace import build_graph, export
from tests.models import MODELS, build


def test_parse_roundtrip_and_marks():
    anno = parse_annotation("b s k+, n k+, n -> b s n")
    assert str(anno) == "b s k+, n k+, n -> b s n"
    assert anno.ident("k").reduce and not anno.ident("b").reduce
    merged = parse_annotation("b (h d^) -> b h d^")
    assert [i.name for i in merged.inputs[0][1].idents] == ["h", "d"]
    assert str(parse_annotation("a 1, a -> ")) == "a 1, a -> "


@pytest.mark.parametrize("text", ["a b", "a (b -> a", "a+ b, a^ -> b", "a -> b -> c"])
def test_parse_rejects_malformed(text):
    with pytest.raises(ValueError):
        parse_annotation(text)


def _graph(name):
    model, sample = build(name)
    graph, _ = build_graph(export(model, sample), model, "tuple")
    return graph


@pytest.mark.parametrize("name", MODELS)
def test_every_op_of_the_model_zoo_has_an_annotation(name):
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    graph = _graph(name)
    missing = [f"{op.name}: {op.anno_error}" for op in graph.select(ntype=IRFwOperation) if op.anno is None]
    assert not missing, missing
    assert len(graph.select(ntype=IRDataOperation)) == 1


def test_gpt_ops_know_their_module_and_source():
    graph = _graph("gpt")
    q = [op for op in graph.select(name="linear") if op.module_path == "layers.0.attn.q_proj"]
    assert len(q) == 1
    assert q[0].source[0] == "model.py" and "self.q_proj(x)" in q[0].source[2]
    assert str(q[0].anno) == "a d k+, n k+, n -> a d n"
    # tied embeddings are one tensor with both names
    wte = [t for t in graph.attrs if "wte.weight" in t.names]
    assert len(wte) == 1 and wte[0].names == ("wte.weight", "lm_head.weight")


def test_view_keeps_a_split_head_dim_through_merges():
    graph = _graph("gpt")
    views = graph.select(name="view")
    split_heads = [v for v in views if v.outputs[0].ndim == 4][0]   # (B, T, C) -> (B, T, nh, hd)
    assert str(split_heads.anno) == "a d (g i) -> a d g i"
    assert (0, 2) in split_heads.algorithms("dim").legal()           # split heads through (g i)
    merge = [v for v in views if v.inputs[0].ndim == 4][0]            # (B, T, nh, hd) -> (B, T, C)
    legal = merge.algorithms("dim").legal()
    assert (0, 2) in legal and (0, 3) not in legal                     # inner factor never splits


class _Rotary(torch.nn.Module):
    """A rotary table computed under ``torch.no_grad()``, as Hugging Face's Llama computed it before
    transformers 5.2x (whose rotary forward no longer turns gradients off)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("inv_freq", torch.rand(4), persistent=False)

    def forward(self, x):
        with torch.no_grad():
            freqs = torch.arange(x.shape[1], dtype=torch.float)[:, None] * self.inv_freq
            emb = torch.cat((freqs, freqs), -1)
            cos, sin = emb.cos() * 2.0, emb.sin() * 2.0
        return (self.proj(x) * cos + x * sin).sum()


def test_no_grad_region_is_inlined():
    model, sample = _Rotary(), (torch.randn(2, 6, 8),)
    graph, _ = build_graph(export(model, sample), model, "tuple")
    frozen = [op for op in graph.select(ntype=IRFwOperation) if not op.grad_enabled]
    assert frozen and {op.name for op in frozen} >= {"cos", "sin", "mul"}
    assert all(not o.requires_grad for op in frozen for o in op.outputs)
    # the ops after the region take gradients again
    assert any(op.grad_enabled and op.name == "linear" for op in graph.select(ntype=IRFwOperation))


class _ShapeReads(torch.nn.Module):
    """Values made from a trained one that autograd does not track: a detached copy, a buffer of its
    shape, random numbers of its shape."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        state = torch.zeros_like(h[:, :1]) + torch.ones_like(h) + torch.rand_like(h) + h.detach()
        return (h * state).sum()


def test_outputs_autograd_does_not_track_need_no_gradient():
    """The IR says what eager autograd says: a read whose gradient never comes is no gradient path (a
    plan moving ``h`` to such a reader must not wait for its gradient in backward)."""
    model, sample = _ShapeReads(), (torch.randn(2, 6, 8),)
    graph, _ = build_graph(export(model, sample), model, "tuple")
    ops = {op.name: op for op in graph.select(ntype=IRFwOperation)}
    free = {"zeros_like", "ones_like", "rand_like", "detach"}
    assert free <= set(ops), sorted(ops)
    assert all(o.requires_grad is False for n in free for o in ops[n].outputs)
    h = model.proj(sample[0])
    eager = [torch.zeros_like(h), torch.ones_like(h), torch.rand_like(h), h.detach()]
    assert not any(t.requires_grad for t in eager) and h.requires_grad
    assert all(o.requires_grad for o in ops["linear"].outputs + ops["slice"].outputs)


def _autograd_tracks(name: str, *args) -> "bool | None":
    """Whether eager autograd tracks the float output of aten op ``name`` called on a ``(2, 3)`` meta
    tensor that needs a gradient (and ``args``); None where it takes other arguments or makes no float."""
    op = getattr(torch.ops.aten, name, None)
    x = torch.empty(2, 3, device="meta", requires_grad=True)
    try:
        with torch.enable_grad():
            out = op.default(x, *args)
    except Exception:   # noqa: BLE001 - an op this call does not fit
        return None
    return out.requires_grad if isinstance(out, torch.Tensor) and out.dtype.is_floating_point else None


def test_the_ops_table_says_which_outputs_autograd_tracks():
    """``OpInfo.grad_free`` against eager autograd, for every row callable on one tensor (and
    ``full_like`` with its value): the IR's gradients follow it (a read whose gradient never comes
    must not be waited for)."""
    from cube.ir.ops import op_info, rows
    seen = {name: _autograd_tracks(name) for name in rows()}
    seen["full_like"] = _autograd_tracks("full_like", 1.0)
    checked = {name: tracks for name, tracks in seen.items() if tracks is not None}
    assert len(checked) >= 50 and {"zeros_like", "ones_like", "full_like", "rand_like", "detach", "exp"} <= set(checked)
    wrong = {name: tracks for name, tracks in checked.items() if tracks == op_info(name).grad_free}
    assert not wrong, f"grad_free disagrees with autograd for {wrong}"


class _Float32Gate(torch.nn.Module):
    """A router computed under ``torch.autocast(dtype=torch.float32)`` (torchtitan's MoE router): on a
    CPU torch has no float32 autocast, warns, and runs the region as written."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(8, 4)

    def forward(self, x):
        with torch.autocast(device_type=x.device.type, dtype=torch.float32):
            scores = self.gate(x)
        return scores.softmax(-1).sum()


@pytest.mark.filterwarnings("ignore:CPU Autocast only supports")
def test_an_autocast_region_torch_turned_off_is_inlined():
    model, sample = _Float32Gate(), (torch.randn(2, 6, 8),)
    graph, _ = build_graph(export(model, sample), model, "tuple")
    assert [op.name for op in graph.select(ntype=IRFwOperation)] == ["linear", "softmax", "sum"]


def test_metadata_asserts_are_dropped():
    pytest.importorskip("transformers")
    graph = _graph("hf_llama")
    assert not graph.select(name="_assert_tensor_metadata")


def test_partition_makes_pieces_replacing_the_op():
    graph = _graph("mlp")
    node = graph.select(name="linear")[0]
    pieces = graph.partition(node, node.algorithms("dim"), idx=1, dim=0, num=2)
    assert [p.split for p in pieces] == [("n", 0, 2), ("n", 1, 2)]
    assert all(p.origin is node for p in pieces)
    assert node not in graph.nodes() and pieces[0] in graph.nodes()
    reps = graph.replicate(pieces[0], times=3)
    assert [r.replica for r in reps] == [(0, 3), (1, 3), (2, 3)] and reps[0].origin is node
