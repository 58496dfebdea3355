"""The graph checker (``cube.passes.check``) fails on broken graphs, with CubeInternalError."""
import pytest
import torch

from cube.errors import CubeInternalError
from cube.ir import IRDataOperation, IRFwOperation
from cube.passes.check import check_graph, check_stage
from cube.trace import build_graph, export
from examples.mlp.linears import MLP


def _graph():
    torch.manual_seed(0)
    model = MLP(dim=8, nlayers=2)
    sample = (torch.randn(4, 8),)
    graph, _ = build_graph(export(model, sample), model, "tuple")
    return graph


def _place(graph, ngpus=2):
    """Data parallel over ``ngpus``: the batch split, every other op replicated."""
    for node in list(graph.ops):
        if isinstance(node, IRDataOperation):
            pieces = graph.partition(node, None, idx=0, dim=0, num=ngpus)
        else:
            pieces = graph.replicate(node, times=ngpus)
        for dev, piece in enumerate(pieces):
            graph.assign(piece, dev)
    return graph


def test_a_placed_graph_passes():
    graph = _place(_graph())
    check_graph(graph)
    check_graph(graph, placed=True, stage="policy")


def test_a_lost_piece_is_found():
    graph = _place(_graph())
    lost = next(op for op in graph.ops if isinstance(op, IRFwOperation) and op.name == "linear")
    graph.ops.remove(lost)
    check_graph(graph)   # every value is still defined (the other replica makes it)
    with pytest.raises(CubeInternalError, match=r"graph check failed \(after policy\): the pieces of .* add up "
                                                r"to 1/2 of it, not once"):
        check_graph(graph, placed=True, stage="policy")


def test_an_op_beside_its_pieces_is_found():
    graph = _graph()
    op = next(op for op in graph.ops if isinstance(op, IRFwOperation))
    pieces = graph.replicate(op, times=2)
    graph.ops.insert(graph.ops.index(pieces[0]), op)
    with pytest.raises(CubeInternalError, match="add up to 2 of it, not once"):
        check_graph(graph, placed=True)


def test_a_value_read_before_it_is_made_is_found():
    graph = _graph()
    first = next(i for i, op in enumerate(graph.ops) if isinstance(op, IRFwOperation))
    graph.ops.append(graph.ops.pop(first))
    with pytest.raises(CubeInternalError, match="before it is defined"):
        check_graph(graph)


def test_an_op_twice_is_found():
    graph = _graph()
    graph.ops.append(graph.ops[-1])
    with pytest.raises(CubeInternalError, match="more than once"):
        check_graph(graph)


def test_check_stage_runs_only_when_asked(monkeypatch):
    graph = _graph()
    graph.ops.append(graph.ops[-1])
    monkeypatch.setenv("CUBE_CHECK_GRAPHS", "0")
    check_stage(graph, "plan")
    monkeypatch.setenv("CUBE_CHECK_GRAPHS", "1")
    with pytest.raises(CubeInternalError, match=r"\(after plan\)"):
        check_stage(graph, "plan")


class _Fused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).split(8, -1)
        return (q * k + v).sum()


def test_sub_parameters_that_do_not_tile_their_tensor_are_found():
    model = _Fused()
    graph, _ = build_graph(export(model, (torch.randn(4, 8),)), model, "tuple")
    check_graph(graph)
    subs = [t for t in graph.attrs if t.region is not None and t.names == ("qkv.weight",)]
    assert [t.region for t in subs] == [((0, 8), (0, 8)), ((8, 16), (0, 8)), ((16, 24), (0, 8))]
    subs[2].region = ((4, 12), (0, 8))
    with pytest.raises(CubeInternalError, match=r"sub-parameters of 'qkv.weight' overlap"):
        check_graph(graph)
    subs[2].region = ((16, 24), (0, 8))
    for t in subs:   # a tensor of 32 rows, of which the blocks hold 24
        t.full = (32, 8)
    with pytest.raises(CubeInternalError, match=r"the sub-parameters of 'qkv.weight' hold 192 of its 256 elements"):
        check_graph(graph)
