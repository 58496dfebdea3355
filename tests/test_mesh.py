"""The policy toolkit: ``DeviceMesh``, placing ops over it, splits by annotation letter,
policy options as keywords (``apply_policy``, ``python -m cube.sim --option``), and a plan
written on the mesh that trains exactly like the plain model."""
import ast
from pathlib import Path

import pytest

from cube import DeviceMesh
from cube.ir import IRDataOperation
from cube.mesh import consecutive
from cube.policy import Resource, apply_policy, load_policy, parse_options, policy_source
from cube.toolkit import apply_recompute, data_parallel, grid, place, place_all, place_data, tensor_parallel
from cube.trace import build_graph, export
from cube.policies.data import PASData
from cube.policies.hybrid import PASHybrid
from tests.inprocess import assert_exact, parity
from tests.models import build

ROOT = Path(__file__).resolve().parents[1]


def _graph(name: str):
    model, sample = build(name)
    graph, _ = build_graph(export(model, sample), model, "tuple")
    return graph


def _placement(graph):
    return [(op.name, op.splits, op.replicas, op.device) for op in graph.ops]


# ------------------------------------------------------------------ the mesh

def test_devices_are_numbered_row_major_with_the_last_dim_innermost():
    mesh = DeviceMesh(("pp", 2), ("dp", 2), ("tp", 2))
    assert mesh.devices == tuple(range(8)) and mesh.size == 8 and mesh.names == ("pp", "dp", "tp")
    assert mesh.device(pp=1, dp=0, tp=1) == 5
    assert mesh["tp"].size == 2 and mesh["tp"].name == "tp" and "dp" in mesh and "cp" not in mesh
    stage = mesh.select(pp=1)
    assert stage.names == ("dp", "tp") and stage.devices == (4, 5, 6, 7)
    assert mesh.select(dp=1).devices == (2, 3, 6, 7)                  # pp x tp at batch part 1
    assert mesh.select(pp=1, tp=0) == DeviceMesh(("dp", 2), devices=[4, 6])
    assert [s.devices for s in mesh.slices("pp")] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert DeviceMesh(("tp", 2), devices=4).devices == (4, 5)
    assert DeviceMesh(("a", 3), devices=[5, 2, 9]).select(a=2).devices == (9,)
    assert [m.devices for m in consecutive([1, 2, 1])] == [(0,), (1, 2), (3,)]


def test_mesh_mistakes_are_clear_errors():
    with pytest.raises(ValueError, match="names must differ"):
        DeviceMesh(("tp", 2), ("tp", 2))
    with pytest.raises(ValueError, match=r"\(name, positive size\)"):
        DeviceMesh(("tp", 0))
    with pytest.raises(ValueError, match="holds 4 devices, got 3"):
        DeviceMesh(("dp", 2), ("tp", 2), devices=[0, 1, 2])
    mesh = DeviceMesh(("dp", 2), ("tp", 2))
    with pytest.raises(KeyError, match=r"no dimension 'pp'; it has \['dp', 'tp'\]"):
        mesh["pp"]
    with pytest.raises(ValueError, match=r"tp=2 is out of range 0..1"):
        mesh.select(tp=2)
    with pytest.raises(ValueError, match=r"6 devices do not split into tensor parallel groups of tp=4"):
        grid(6, tp=4)
    with pytest.raises(ValueError, match=r"8 devices do not split into tensor parallel tp=2 x pipeline pp=3"):
        grid(8, tp=2, pp=3)
    assert grid(8, tp=2, pp=2) == DeviceMesh(("pp", 2), ("dp", 2), ("tp", 2))


# ------------------------------------------------------------------ placing over the mesh

def test_place_splits_per_mesh_dim_and_puts_each_piece_at_its_coordinates():
    graph = _graph("mlp")
    mesh = DeviceMesh(("dp", 2), ("tp", 2), devices=2)
    linear = graph.select(name="linear")[0]
    pieces = place(graph, linear, mesh, dp=(0, 0), tp="n")
    assert [p.device for p in pieces] == [(2,), (3,), (4,), (5,)]
    assert [p.splits for p in pieces] == [(("a", i, 2), ("n", j, 2)) for i in range(2) for j in range(2)]
    div = graph.select(name="div")[0]
    assert [p.replicas for p in place(graph, div, mesh, dp=None)] == [((i, 2), (j, 2)) for i in range(2)
                                                                      for j in range(2)]
    with pytest.raises(ValueError, match=r"the mesh has dimensions \['dp', 'tp'\], not \['pp'\]"):
        place(graph, graph.select(name="linear")[1], mesh, pp=(0, 0))


def test_every_stage_reads_the_batch():
    graph = _graph("gpt_nobias")
    mesh = DeviceMesh(("pp", 2), ("dp", 2), ("tp", 2))
    place_data(graph, mesh.slices("pp"))
    data = graph.select(ntype=IRDataOperation)
    assert [d.device for d in data] == [(k,) for k in range(8)]
    assert [d.splits for d in data] == [(("0", i, 2),) for _ in range(2) for i in range(2) for _ in range(2)]


def test_mesh_plan_places_every_op_as_the_hybrid_policy():
    """dp=2 x tp=2 over the mesh in three lines gives PASHybrid's placement."""
    mine, theirs = _graph("gpt_nobias"), _graph("gpt_nobias")
    mesh = DeviceMesh(("dp", 2), ("tp", 2))
    place_all(mine, mesh, dp=data_parallel(mine, mesh["dp"]), tp=tensor_parallel(mine, mesh["tp"]))
    PASHybrid(theirs, Resource(4), tp=2)
    assert _placement(mine) == _placement(theirs)


def test_recompute_option():
    graph = _graph("gpt_nobias")
    assert apply_recompute(graph, False) == [] and apply_recompute(graph, "none") == []
    assert len(apply_recompute(graph, (1,))) == 1
    assert len(_graph("gpt_nobias").recompute_groups) == 0
    assert len(apply_recompute(_graph("gpt_nobias"), True)) == 2
    assert len(apply_recompute(_graph("gpt_nobias"), "0,1")) == 2
    with pytest.raises(ValueError, match=r"recompute='some': use True or 'all'"):
        apply_recompute(graph, "some")
    with pytest.raises(ValueError, match=r"recompute=\(5,\): block indices \[5\] are out of range"):
        apply_recompute(graph, (5,))


# ------------------------------------------------------------------ partition by letter

def test_partition_by_letter_equals_the_index_form():
    by_letter, by_index = _graph("gpt_nobias"), _graph("gpt_nobias")
    mesh = DeviceMesh(("tp", 2))
    a = by_letter.partition(by_letter.select(name="linear")[0], "n", over=mesh["tp"])
    lin = by_index.select(name="linear")[0]
    b = by_index.partition(lin, lin.algorithms("dim"), idx=1, dim=0, num=2)
    assert [p.splits for p in a] == [p.splits for p in b] == [(("n", 0, 2),), (("n", 1, 2),)]
    assert len(by_letter.partition(by_letter.select(name="gelu")[0], "g", num=4)) == 4


def test_partition_by_a_letter_that_is_absent_or_forbidden_names_the_op_and_the_letters():
    graph = _graph("gpt_nobias")
    norm = graph.select(name="layer_norm")[0]
    with pytest.raises(ValueError) as err:
        graph.partition(norm, "z", num=2)
    text = str(err.value)
    assert "op 'layer_norm'" in text and "layers.0.ln_1" in text and "model.py:69" in text
    assert "its annotation has no dimension 'z'" in text
    assert "Annotation: 'a d g^, g^ -> a d g^'" in text and "Letters that may be split: a, d." in text
    with pytest.raises(ValueError, match=r"along 'g': 'g\^' may not be split\. .*Letters that may be split: a, d\."):
        graph.partition(norm, "g", num=2)
    view = next(op for op in graph.select(name="view") if str(op.anno) == "a d (g i) -> a d g i")
    with pytest.raises(ValueError, match=r"'i' is not a splittable dimension of an input"):
        graph.partition(view, "i", num=2)
    with pytest.raises(TypeError, match="by its letter or by idx=/dim=, not both"):
        graph.partition(norm, "a", idx=0, dim=0, num=2)
    with pytest.raises(TypeError, match="needs the number of pieces"):
        graph.partition(norm, "a")


# ------------------------------------------------------------------ options as keywords

def test_options_reach_the_policy_as_keywords(monkeypatch):
    by_option, by_keyword, by_env = _graph("gpt_nobias"), _graph("gpt_nobias"), _graph("gpt_nobias")
    apply_policy(PASHybrid, by_option, Resource(4), {"tp": 4, "recompute": "all"})
    PASHybrid(by_keyword, Resource(4), tp=4, recompute=True)
    monkeypatch.setenv("CUBE_TP", "4")
    monkeypatch.setenv("CUBE_RECOMPUTE", "all")
    apply_policy(PASHybrid, by_env, Resource(4))
    assert _placement(by_option) == _placement(by_keyword) == _placement(by_env)
    assert len(by_option.recompute_groups) == 2


def test_an_option_the_policy_does_not_take_is_a_type_error():
    with pytest.raises(TypeError, match=r"policy PASData does not take option\(s\) 'tp'; it takes recompute"):
        apply_policy(PASData, _graph("mlp"), Resource(2), {"tp": 2})


def test_options_are_part_of_the_cache_key_and_shipped_names_load():
    assert policy_source(PASData, {"recompute": "all"}) != policy_source(PASData)
    assert policy_source(PASData, {"recompute": "all"}) != policy_source(PASData, {"recompute": (0,)})
    assert load_policy("PASData") is PASData
    with pytest.raises(ValueError, match="write a shipped policy's name"):
        load_policy("PASNope")
    assert parse_options(["tp=2", "lr=1e-3", "recompute=all", "ok=true", "stage_to_num_ranks=1,2"]) == {
        "tp": 2, "lr": 1e-3, "recompute": "all", "ok": True, "stage_to_num_ranks": (1, 2)}
    with pytest.raises(ValueError, match="write key=value"):
        parse_options(["tp"])


def test_cube_never_imports_policies():
    for path in (ROOT / "cube").rglob("*.py"):
        if path.parent.name == "policies":   # cube/policies: the shipped policies themselves
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n in ("policies", "cube.policies") or n.startswith(("policies.", "cube.policies."))
                           for n in names), path


SPEC = '''
import torch
from examples.gpt.model import GPT, GPTConfig


def build():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32, bias=False))
    ids = torch.randint(0, 64, (8, 8))
    return model, (ids, torch.roll(ids, -1, 1))
'''


def test_command_line_options(tmp_path, capsys):
    from cube.sim.__main__ import main
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC)
    common = [str(spec), "--ngpus", "4", "--estimate", "--no-calibrate"]
    assert main([*common, "--policy", "PASMegatron", "--option", "tp=2", "--option", "pp=2",
                 "--option", "nmicros=2", "--option", "recompute=all"]) == 0
    assert "predicted step time" in capsys.readouterr().out
    with pytest.raises(TypeError, match=r"policy PASData does not take option\(s\) 'pp'; it takes recompute"):
        main([*common, "--policy", "PASData", "--option", "pp=2"])


# ------------------------------------------------------------------ parity

def PASMeshLinears(graph, resource):
    """dp x tp over the mesh: the batch over dp, every linear by output features ('n') over tp."""
    mesh = DeviceMesh(("dp", 2), ("tp", resource.ngpus // 2))
    batch = data_parallel(graph, mesh["dp"])
    for op in graph.nodes():
        place(graph, op, mesh, dp=batch, tp="n" if op.name == "linear" else None)
    return graph


@pytest.mark.parametrize("name,policy", [("gpt_nobias", "cube.policies.hybrid:PASHybrid"),
                                         ("mlp", PASMeshLinears)], ids=["hybrid", "letters"])
def test_a_mesh_plan_equals_eager(name, policy):
    model, sample = build(name)
    assert_exact(parity(model, sample, policy, 4, steps=2))
