"""``cube.onnx``: models exported by ``torch.onnx.export`` (both exporters) imported as modules equal
to onnxruntime, written back with their weights, and trained by cube exactly like eager training of
the imported module; bad files and unsupported operators refused with one clear error."""
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx", reason="the ONNX tests need `pip install onnx onnxruntime onnxscript`")
ort = pytest.importorskip("onnxruntime", reason="the ONNX tests need onnxruntime")

import cube.onnx  # noqa: E402
from examples.gpt.model import GPT, GPTConfig  # noqa: E402
from tests.inprocess import assert_exact, parity  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class CNN(torch.nn.Module):
    """conv (padding, stride 2, dilation), batch norm, ReLU, max and average pooling, a linear head."""

    def __init__(self):
        super().__init__()
        self.f = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 16, 3, stride=2, padding=2, dilation=2), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.AvgPool2d(2), torch.nn.Flatten(), torch.nn.Linear(16 * 2 * 2, 10))

    def forward(self, x):
        return self.f(x)


def _gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    with torch.no_grad():   # no parameter at exactly zero: relative errors of every one are meaningful
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ids = torch.randint(0, 64, (4, 16))
    return model, (ids, torch.roll(ids, -1, 1))


def _models():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                              torch.nn.Linear(32, 4))
    cnn = CNN()
    with torch.no_grad():   # running statistics that are not the defaults
        for m in cnn.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return {"mlp": (mlp, (torch.randn(8, 16),)), "cnn": (cnn, (torch.randn(2, 3, 16, 16),)), "gpt": _gpt()}


EXPORTERS = {
    "dynamo": dict(dynamo=True),                            # torch's default exporter, its graph optimizer on
    "dynamo-plain": dict(dynamo=True, optimize=False),      # every parameter an initializer of its own name
    "torchscript": dict(dynamo=False, do_constant_folding=False),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("onnx")
    files = {}
    for name, (model, batch) in _models().items():
        model.eval()
        for how, kw in EXPORTERS.items():
            path = folder / f"{name}-{how}.onnx"
            names = ["idx", "targets"] if name == "gpt" else ["x"]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(model, batch, str(path), input_names=names, verbose=False, **kw)
            files[(name, how)] = (path, model, batch, names)
    return files


def _ort(path, names, batch):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {n: t.numpy() for n, t in zip(names, batch)})[0]


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


@pytest.mark.parametrize("how", list(EXPORTERS))
@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_imported_forward_equals_onnxruntime_and_save_round_trips(exported, name, how, tmp_path):
    path, model, batch, names = exported[(name, how)]
    module = cube.onnx.load(path).eval()
    ref = _ort(path, names, batch)
    with torch.no_grad():
        out = module(*batch)
        assert _rel(out.numpy(), ref) <= 1e-5
        assert _rel(out.numpy(), model(*batch).numpy()) <= 1e-5
    assert sum(p.numel() for p in module.parameters()) > 0
    # unchanged weights: the saved file computes what the original does
    same = cube.onnx.save(module, tmp_path / "same.onnx")
    assert _rel(_ort(same, names, batch), ref) == 0.0
    # changed weights (as after training): the saved file computes what the module now does
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(1.1).add_(0.01)
        moved = module(*batch).numpy()
    assert _rel(moved, ref) > 1e-3
    saved = cube.onnx.save(module, tmp_path / "trained.onnx")
    assert _rel(_ort(saved, names, batch), moved) <= 1e-5
    again = cube.onnx.load(saved).eval()
    with torch.no_grad():
        assert _rel(again(*batch).numpy(), moved) <= 1e-5


def test_parameter_names_say_where_they_came_from(exported):
    path, model, _, _ = exported[("gpt", "dynamo-plain")]
    module = cube.onnx.load(path)
    assert {n for n, _ in module.named_parameters()} <= {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert "layers.0.attn.q_proj.weight" in dict(module.named_parameters())
    mlp = cube.onnx.load(exported[("mlp", "torchscript")][0])
    assert [n for n, _ in mlp.named_parameters()] == [n for n, _ in exported[("mlp", "torchscript")][1]
                                                      .named_parameters()]
    cnn = cube.onnx.load(exported[("cnn", "dynamo-plain")][0])
    assert {"f.1.running_mean", "f.1.running_var"} <= {n for n, _ in cnn.named_buffers()}


@pytest.mark.parametrize("how", ["dynamo-plain", "dynamo", "torchscript"])
@pytest.mark.parametrize("policy", ["cube.policies.data:PASData", "cube.policies.megatron:PASMegatronTP"])
def test_imported_gpt_trains_like_eager(exported, how, policy):
    """Losses and every parameter piece after SGD steps equal eager training of the imported module."""
    path, _, batch, _ = exported[("gpt", how)]
    module = cube.onnx.load(path).train()
    assert_exact(parity(module, batch, policy, 2, steps=3, opt="sgd"), 1e-5)


def test_imported_gpt_trains_with_adamw_losses_equal(exported):
    """AdamW: the losses (parameters near a zero gradient take AdamW's amplified round-off, see
    tests/parity.rel, so they are compared under SGD above)."""
    path, _, batch, _ = exported[("gpt", "dynamo-plain")]
    errors = parity(cube.onnx.load(path).train(), batch, "cube.policies.megatron:PASMegatronTP", 2, steps=3,
                    opt="adamw")
    assert max(loss for loss, _ in errors) <= 1e-5


def test_imported_cnn_trains_like_eager_with_batch_norm(exported):
    path, _, batch, _ = exported[("cnn", "dynamo-plain")]

    class Loss(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x).square().mean()
    assert_exact(parity(Loss(cube.onnx.load(path)).train(), batch, "cube.policies.data:PASData", 2, steps=2, opt="sgd"),
                 1e-5)


def test_simulator_predicts_the_imported_model_like_the_native_one(exported):
    from cube.sim.api import simulate_policy
    from cube.sim.comm import CommModel, default_backend
    from cube.sim.costs import Estimator
    path, model, batch, _ = exported[("gpt", "dynamo-plain")]
    times = {}
    for label, m in (("native", model.train()), ("imported", cube.onnx.load(path).train())):
        res = simulate_policy(m, batch, "PASData", 2, costs=Estimator(), comm=CommModel(default_backend()))
        times[label] = res.step_time
    assert times["imported"] > 0 and 0.5 <= times["imported"] / times["native"] <= 2.0, times


def _node_model(nodes, inputs, outputs, opset=17, inits=()):
    graph = onnx.helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])


def _tensor(name, shape, elem=onnx.TensorProto.FLOAT):
    return onnx.helper.make_tensor_value_info(name, elem, shape)


def test_unsupported_operators_are_one_error_naming_op_node_and_opset(tmp_path):
    boxes, scores = _tensor("boxes", [1, 4, 4]), _tensor("scores", [1, 1, 4])
    nodes = [onnx.helper.make_node("NonMaxSuppression", ["boxes", "scores"], ["sel"], name="nms_0"),
             onnx.helper.make_node("Hardmax", ["scores"], ["hm"], name="hardmax_1")]
    model = _node_model(nodes, [boxes, scores], [_tensor("sel", [None, 3], onnx.TensorProto.INT64),
                                                 _tensor("hm", [1, 1, 4])])
    path = tmp_path / "nms.onnx"
    onnx.save(model, str(path))
    with pytest.raises(ValueError) as err:
        cube.onnx.load(path)
    text = str(err.value)
    assert "2 node(s)" in text and str(path) in text
    assert re.search(r"NonMaxSuppression \(node 'nms_0', opset 17\): not supported", text)
    assert re.search(r"Hardmax \(node 'hardmax_1', opset 17\): not supported", text)


def test_unsupported_attribute_values_are_refused_not_ignored():
    x = _tensor("x", [2, 3])
    node = onnx.helper.make_node("ArgMax", ["x"], ["y"], name="argmax_last", select_last_index=1)
    model = _node_model([node], [x], [_tensor("y", [1, 3], onnx.TensorProto.INT64)])
    with pytest.raises(ValueError, match=r"ArgMax \(node 'argmax_last', opset 17\): select_last_index=1"):
        cube.onnx.load(model)


def test_malformed_and_missing_files_name_the_file(tmp_path):
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"\x08\x07this is not a protobuf of a model" * 3)
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        cube.onnx.load(bad)
    with pytest.raises(FileNotFoundError, match="nothere.onnx"):
        cube.onnx.load(tmp_path / "nothere.onnx")
    invalid = _node_model([onnx.helper.make_node("Relu", ["nope"], ["y"])], [_tensor("x", [2])],
                          [_tensor("y", [2])])
    path = tmp_path / "invalid.onnx"
    onnx.save(invalid, str(path))
    with pytest.raises(ValueError, match=re.escape(str(path)) + " is not a valid ONNX model"):
        cube.onnx.load(path)
    with pytest.raises(TypeError, match="path, bytes or an onnx.ModelProto"):
        cube.onnx.load(3)


def test_old_opsets_are_converted_and_data_dependent_shapes_refused():
    x = _tensor("x", [2, 6])
    shape = onnx.numpy_helper.from_array(np.array([3, 4], dtype=np.int64), "shape")
    old = _node_model([onnx.helper.make_node("Reshape", ["x", "shape"], ["y"])], [x], [_tensor("y", [3, 4])],
                      opset=11, inits=[shape])
    module = cube.onnx.load(old)
    t = torch.randn(2, 6)
    assert torch.equal(module(t), t.reshape(3, 4))
    # a shape computed from the data
    ids = _tensor("ids", [2], onnx.TensorProto.INT64)
    dynamic = _node_model([onnx.helper.make_node("Reshape", ["x", "ids"], ["y"], name="reshape_by_data")],
                          [x, ids], [_tensor("y", [3, 4])])
    with pytest.raises(ValueError, match="reshape_by_data.*computed from the data"):
        cube.onnx.load(dynamic)(t, torch.tensor([3, 4]))


def test_docs_list_the_supported_operators():
    page = (ROOT / "docs" / "onnx.md").read_text()
    assert cube.onnx.ops_table() in page, "docs/onnx.md's operator table is stale: paste `python -m cube.onnx ops`"


def test_missing_onnx_package_says_how_to_install(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(ImportError, match=r"pip install 'cube-compiler\[onnx\]'"):
        cube.onnx.load("model.onnx")


def test_the_example_trains_under_torchrun_and_onnxruntime_runs_the_result(tmp_path):
    """examples/onnx/train.py: one process and 2 tensor-parallel ranks print the same losses, and the
    saved file's loss in onnxruntime equals the trained module's."""
    from tests.launch import single, torchrun
    script = ROOT / "examples" / "onnx" / "train.py"
    common = ["--steps", "3", "--log-every", "1", "--dim", "64", "--seq", "32", "--batch", "4"]
    runs = {"single": single(script, ["--policy", "PASSingle", "--out", tmp_path / "a.onnx", *common]),
            "tp2": torchrun(script, 2, ["--policy", "PASMegatronTP", "--out", tmp_path / "b.onnx", *common])}
    losses = {k: [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", r.stdout)] for k, r in runs.items()}
    assert len(losses["single"]) == 3 and losses["single"] == pytest.approx(losses["tp2"], rel=1e-5), losses
    for r in runs.values():
        m = re.search(r"onnxruntime ([0-9.]+), trained module ([0-9.]+)", r.stdout)
        assert m, r.stdout[-2000:]
        assert float(m.group(1)) == pytest.approx(float(m.group(2)), rel=1e-5)
    assert (tmp_path / "b.onnx").exists()


def test_hugging_face_models_import_and_equal_onnxruntime(tmp_path):
    """GPT-2, Llama and BERT from transformers (tiny configs) through torch's dynamo exporter: HF's
    attention masks need GatherND, GPT-2's split heads SplitToSequence/SequenceAt, BERT's token
    type ids a GatherElements on constants."""
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            out = self.m(input_ids=ids) if isinstance(self.m, BertModel) else self.m(input_ids=ids, use_cache=False)
            return out.last_hidden_state if isinstance(self.m, BertModel) else out.logits
    torch.manual_seed(0)
    models = {
        "gpt2": GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)),
        "llama": LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=128)),
        "bert": BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, vocab_size=128)),
    }
    ids = torch.randint(0, 128, (2, 16))
    for name, model in models.items():
        path = tmp_path / f"{name}.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(Logits(model).eval(), (ids,), str(path), input_names=["ids"], dynamo=True,
                              optimize=False, verbose=False)
        module = cube.onnx.load(path).eval()
        with torch.no_grad():
            assert _rel(module(ids).numpy(), _ort(path, ["ids"], (ids,))) <= 1e-5, name


@pytest.mark.parametrize("policy", ["cube.policies.data:PASData", "cube.policies.megatron:PASMegatronTP"])
def test_imported_hugging_face_llama_trains_like_eager(tmp_path, policy):
    """A Llama exported with its loss (labels in the graph) trains on 2 ranks as the imported module
    does eagerly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class Loss(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids, labels):
            return self.m(input_ids=ids, labels=labels, use_cache=False).loss
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    ids = torch.randint(0, 128, (4, 16))
    path = tmp_path / "llama.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Loss(llama).eval(), (ids, ids), str(path), input_names=["ids", "labels"], dynamo=True,
                          optimize=False, verbose=False)
    assert_exact(parity(cube.onnx.load(path).train(), (ids, ids), policy, 2, steps=2, opt="sgd"), 1e-5)
