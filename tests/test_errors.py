"""Users' mistakes get ValueError/TypeError that name the cause and the fix."""
import pytest
import torch
import torch.nn as nn

import cube
from cube.compiler import generate_code
from cube.ir import IRDataOperation
from examples.mlp.linears import MLP
from cube.policies.single import PASSingle
from tests.parity import compile_step


def _compile(model, batch, policy, tmp_path, world=1):
    return generate_code(model, batch, policy, world_size=world)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # control flow on a tensor value: not traceable
            y = y * 2
        return y.mean()


def test_untraceable_model_names_model_and_line(tmp_path):
    with pytest.raises(ValueError) as err:   # a user's mistake: a ValueError, and precisely a TraceError
        _compile(DataDependent(), torch.randn(2, 4), PASSingle, tmp_path)
    msg = str(err.value)
    assert type(err.value) is cube.TraceError, f"{type(err.value).__name__}: {msg}"
    assert msg.startswith("cube could not trace DataDependent.forward"), msg
    assert "DataDependent.forward" in msg and "test_errors.py" in msg
    assert "if y.sum() > 0" in msg          # the failing model line
    assert "Fix:" in msg and "A Python branch there reads a tensor's value" in msg and "torch.where" in msg, msg
    assert "shape of a tensor" not in msg, msg   # a branch, not a data-dependent shape


class LayerDrop(nn.Module):
    """Hugging Face's LayerDrop (M2M100, NLLB-MoE ship it on): a layer skipped at random each step."""

    def __init__(self):
        super().__init__()
        self.layers, self.layerdrop = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]), 0.05

    def forward(self, x):
        for layer in self.layers:
            if self.training and self.layerdrop > 0.0:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:
                    continue
            x = layer(x)
        return x.mean()


def test_layerdrop_is_named_with_its_fix(tmp_path):
    with pytest.raises(cube.TraceError) as err:
        _compile(LayerDrop(), torch.randn(2, 4), PASSingle, tmp_path)
    msg = str(err.value)
    assert "if dropout_probability < self.layerdrop" in msg and "It is LayerDrop" in msg, msg
    assert "decoder_layerdrop = 0.0" in msg, msg


def test_policy_returning_non_graph(tmp_path):
    def PASNothing(graph, resource):
        for node in graph.nodes():
            graph.assign(node, 0)
    with pytest.raises(TypeError, match=r"policy .*PASNothing returned NoneType.*return graph"):
        _compile(MLP(8, 2), torch.randn(2, 8), PASNothing, tmp_path)


def test_unassigned_ops_are_listed(tmp_path):
    def PASHalf(graph, resource):
        graph.assign(graph.select(ntype=IRDataOperation)[0], 0)
        for node in graph.select(name="linear"):
            graph.assign(node, 0)
        return graph
    with pytest.raises(ValueError) as err:
        _compile(MLP(8, 2), torch.randn(2, 8), PASHalf, tmp_path)
    msg = str(err.value)
    assert "left 3 op(s) without a device" in msg
    assert "mul (" in msg and "sum (" in msg and "div (" in msg and "linears.py" in msg
    assert "graph.assign" in msg


def test_device_outside_world(tmp_path):
    def PASFar(graph, resource):
        for node in graph.nodes():
            graph.assign(node, 3)
        return graph
    with pytest.raises(ValueError, match=r"plans for 4 devices, but the world has 1: launch 4 ranks .*"
                                         r"cube.debug -n 4.*cube.toolkit.grid"):
        _compile(MLP(8, 2), torch.randn(2, 8), PASFar, tmp_path)


def _partition_policy(name, idx, dim, num=2):
    def PASSplit(graph, resource):
        node = graph.select(name=name)[0]
        graph.partition(node, node.algorithms("dim"), idx=idx, dim=dim, num=num)
        return graph
    return PASSplit


def test_illegal_split_lists_legal_pairs(tmp_path):
    from examples.gpt.model import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    ids = torch.randint(0, 32, (2, 8))
    with pytest.raises(ValueError) as err:  # layer_norm's normalized dim may not be split
        _compile(model, (ids, ids), _partition_policy("layer_norm", 0, 2), tmp_path)
    msg = str(err.value)
    assert "illegal split of op 'layer_norm'" in msg
    assert "module 'layers.0.ln_1'" in msg and "model.py" in msg
    assert "Annotation: 'a d g^, g^, g^ -> a d g^'" in msg
    assert "Legal (idx, dim) pairs: [(0, 0), (0, 1)]" in msg


def test_uneven_split(tmp_path):
    with pytest.raises(ValueError, match=r"uneven split of op 'linear'.*size 6, which 4 does not divide"):
        _compile(MLP(8, 1), torch.randn(6, 8), _partition_policy("linear", 0, 0, num=4), tmp_path)


def test_split_of_op_without_rule_explains_register_op(tmp_path):
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, x):
            return torch.cumprod(x * self.w, dim=0).sum()
    with pytest.raises(ValueError) as err:
        _compile(Odd(), torch.randn(3, 4), _partition_policy("cumprod", 0, 1), tmp_path)
    msg = str(err.value)
    assert "op 'cumprod'" in msg and "cannot be partitioned" in msg and "test_errors.py" in msg
    assert "cube.register_op" in msg


def test_non_scalar_loss():
    class NoLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)
    with pytest.raises(TypeError, match=r"NoLoss.forward must return a scalar floating-point loss.*shape \[2, 4\]"):
        generate_code(NoLoss(), torch.randn(2, 4), PASSingle)


def test_bad_policy_strings():
    with pytest.raises(ValueError, match="no policy file"):
        generate_code(MLP(8, 1), torch.randn(2, 8), "nowhere/policy.py:PASX")
    with pytest.raises(ValueError, match=r"has no policy 'PASMissing'; it has \['PASSingle'\]"):
        generate_code(MLP(8, 1), torch.randn(2, 8), "cube.policies.single:PASMissing")
    with pytest.raises(TypeError, match="PAS must be a callable"):
        generate_code(MLP(8, 1), torch.randn(2, 8), 42)


def test_policy_string_forms_load(tmp_path):
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    a = generate_code(MLP(8, 1), torch.randn(2, 8), "cube.policies.single:PASSingle")
    b = generate_code(MLP(8, 1), torch.randn(2, 8), f"{root}/cube/policies/single.py:PASSingle")
    assert a == b


def _step(model, loader, tmp_path):
    return compile_step(model, loader, PASSingle, tmp_path, tensor_batch=True)


def test_batch_shape_change_between_steps(tmp_path):
    loader = iter([torch.randn(4, 8), torch.randn(3, 8)])
    step = _step(MLP(8, 1), loader, tmp_path)
    model = cube.load_model()
    step(model, loader)
    with pytest.raises(ValueError, match=r"compiled for shape \[4, 8\].*static shapes"):
        step(model, loader)


def test_exhausted_dataloader(tmp_path):
    loader = iter([torch.randn(4, 8)])
    step = _step(MLP(8, 1), loader, tmp_path)
    model = cube.load_model()
    step(model, loader)
    with pytest.raises(ValueError, match="dataloader is exhausted"):
        step(model, loader)


def test_step_called_with_original_model(tmp_path):
    model = MLP(8, 1)
    loader = iter([torch.randn(4, 8)] * 3)
    step = _step(model, loader, tmp_path)
    with pytest.raises(TypeError, match=r"cube.load_model\(\)"):
        step(model, loader)


def test_dataloader_must_be_an_iterator(tmp_path):
    with pytest.raises(TypeError, match=r"Pass iter\(loader\)"):
        _step(MLP(8, 1), [torch.randn(4, 8)], tmp_path)


def test_bad_annotation_text():
    with pytest.raises(ValueError, match="exactly one '->'"):
        cube.register_op("a b, a b", name="bad_anno")


def test_partition_of_foreign_node():
    def PASTwice(graph, resource):
        node = graph.select(name="linear")[0]
        algo = node.algorithms("dim")
        graph.partition(node, algo, idx=0, dim=0, num=2)
        graph.partition(node, algo, idx=0, dim=0, num=2)  # node was replaced by its pieces
        return graph
    with pytest.raises(ValueError, match="is not in the graph .*use the pieces it returned"):
        generate_code(MLP(8, 1), torch.randn(4, 8), PASTwice)


def test_non_tensor_loss():
    class DictLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return {"loss": self.lin(x).sum()}
    with pytest.raises((TypeError, ValueError), match=r"DictLoss.forward must return a scalar"):
        generate_code(DictLoss(), torch.randn(2, 4), PASSingle)


def test_empty_dataloader(tmp_path):
    with pytest.raises(ValueError, match="the dataloader is empty; it needs at least one batch"):
        _step(MLP(8, 1), iter([]), tmp_path)


def test_batch_of_non_tensors(tmp_path):
    with pytest.raises(TypeError, match="a batch must be a tensor or a tuple/list of tensors, got str"):
        _step(MLP(8, 1), iter(["not a tensor"]), tmp_path)


def test_multi_rank_plan_without_torchrun(tmp_path):
    """Generated code of a 2-rank plan, loaded in a single process (world size 1)."""
    import importlib.util
    src = generate_code(MLP(8, 1), torch.randn(4, 8), "cube.policies.data:PASData", world_size=2)[0]
    path = tmp_path / "rank0.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("cube_gen_two_ranks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(ValueError, match=r"plan for several ranks.*torchrun --nproc_per_node=N"):
        module.GenModel("cpu")


def test_bad_environment_settings(monkeypatch):
    from cube import config
    monkeypatch.setenv("CUBE_BUCKET_MB", "lots")
    with pytest.raises(ValueError, match="CUBE_BUCKET_MB must be a number of MiB"):
        config.bucket_bytes(1)
    monkeypatch.setenv("CUBE_BACKEND", "mpi")
    with pytest.raises(ValueError, match="CUBE_BACKEND must be 'nccl' or 'gloo'"):
        config.backend()
    monkeypatch.setenv("CUBE_RECOMPUTE", "every other")
    with pytest.raises(ValueError, match="CUBE_RECOMPUTE"):
        config.recompute()
