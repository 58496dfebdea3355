"""Models that do not fit one device: compile on the meta device, ``load_model(init=, weights=)``.

Every case compares with the single-device procedure: ``model.to_empty(device="cpu");
model.apply(init)`` from the same seed (exactly, piece by piece, right after
loading), then AdamW steps: the first step's gradients and every loss within 1e-5, the parameters
within 1e-5 per step.
"""
import functools

import pytest
import safetensors.torch
import torch
import torch.nn as nn

import cube
import cube.debug
from cube.runtime import piece
from cube.policies.data import PASData
from tests.launch import ROOT, torchrun
from tests.models import build, hf_llama
from tests.workers import bigmodel_worker as worker


@functools.lru_cache(maxsize=None)
def _reference(nmicros: int, seed: int = worker.SEED) -> dict:
    return worker.reference(nmicros, seed)


def _check(results, nranks, policy=None):
    assert len(results) == nranks
    for r in results:
        if policy == "hybrid":   # dp2 x tp2: device 2i + j holds batch part i
            assert r["part"] == [True, r["rank"] // 2, 2, 1], r
        elif policy == "megatron":   # tp2 x pp2: every rank reads a batch tensor, 2 micro-batches
            assert r["part"] == [True, 0, 1, 2], r
        assert r["unequal_after_load"] == [], r
        assert r["materialized"] == [], r   # the user's model stays on the meta device
        # the contract's bound per step: AdamW divides each gradient entry by its own magnitude, so
        # rounding in an entry near zero (another order of a sum over tensor-parallel pieces) moves
        # that parameter by up to lr; the gradients themselves are checked tightly, before AdamW
        assert r["grad_err"] <= 1e-5, r
        assert r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-5 * worker.STEPS, r
    assert all(r["losses"] == results[0]["losses"] for r in results)


def _save_hf(state: dict, folder) -> None:
    model = hf_llama()
    model.load_state_dict(state)
    model.model.save_pretrained(folder, max_shard_size="20KB")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("bigmodel_cache"))


# ---------------------------------------------------------------------- parity on 4 ranks
@pytest.mark.parametrize("policy", ["megatron", "hybrid"])
def test_init_equals_single_device_init_and_training(policy, cache):
    ref = _reference(worker.policy(policy)[1])
    _check(cube.debug.run(lambda: worker.rank_run(policy, "init", ref, cache), 4), 4, policy)


def test_weights_from_hf_sharded_directory(tmp_path, cache):
    ref = _reference(worker.policy("megatron")[1], seed=11)   # not the seed load_model's init runs from
    _save_hf(ref["state"], tmp_path / "hf")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) >= 2
    assert list((tmp_path / "hf").glob("*.index.json"))
    source = str(tmp_path / "hf")
    _check(cube.debug.run(lambda: worker.rank_run("megatron", source, ref, cache), 4), 4)


def test_weights_from_torch_save_file(tmp_path, cache):
    ref = _reference(worker.policy("hybrid")[1], seed=11)
    torch.save(ref["state"], tmp_path / "state.pt")
    source = str(tmp_path / "state.pt")
    _check(cube.debug.run(lambda: worker.rank_run("hybrid", source, ref, cache), 4), 4)


@pytest.mark.multirank
# the default tier: the same init on 4 ranks in one process (above), and examples/bigmodel/train.py's
# meta-built Llama under torchrun (tests/test_bigmodel_example.py)
@pytest.mark.slow
def test_init_under_torchrun(tmp_path):
    import json
    torchrun(ROOT / "tests" / "workers" / "bigmodel_worker.py", 4, ["hybrid", "init", tmp_path])
    _check([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)], 4, "hybrid")



@pytest.mark.parametrize("zero", [1, 3])
def test_meta_model_saves_merges_and_resumes_sharded(zero, tmp_path, cache):
    """A meta-built model under dp2 x tp2 with ZeRO: 2 AdamW steps, save_checkpoint (each rank
    writes its pieces), merge_checkpoint(path) equals the single-device model after 2 steps; a
    fresh meta model resumed from the checkpoint takes step 3 like the single-device run."""
    pas, nmicros = worker.policy("hybrid")
    ref2, ref3 = worker.reference(nmicros, steps=2), _reference(nmicros)   # STEPS is 3
    ckpt = tmp_path / "ckpt"
    data = worker.batches(3, nmicros)

    def rank():
        def compiled():
            model = worker.meta_model()

            @cube.compile(model, iter(data), PAS=pas, cache_dir=cache, zero=zero)
            def train_iter(model, dataloader):
                batch = next(dataloader)
                loss = model(*batch)
                loss.backward()
                return loss
            return model, train_iter

        model, step = compiled()
        torch.manual_seed(worker.SEED)
        cmodel = cube.load_model(init=model.model._init_weights)
        opt = cube.build_optimizer(cmodel, torch.optim.AdamW, lr=worker.LR)
        loader = iter(data)
        losses = []
        for _ in range(2):
            losses.append(step(cmodel, loader).item())
            opt.step()
            opt.zero_grad()
        cube.save_checkpoint(ckpt, cmodel, opt)
        model, step = compiled()   # a new process would do the same: nothing of the first run is kept
        cmodel = cube.load_model(init=model.model._init_weights)
        opt = cube.build_optimizer(cmodel, torch.optim.AdamW, lr=worker.LR)
        cube.load_checkpoint(ckpt, cmodel, opt)
        losses.append(step(cmodel, loader).item())
        opt.step()
        with cube.runtime.zero.whole_parameters(cmodel):   # ZeRO-3 holds only chunks at rest
            err = max(worker.rel(p, piece(ref3["final"][cmodel.PARAMS[k][0][0]], cmodel.PARAMS[k][1]))
                      for k, p in cmodel.named_parameters())
        return losses, err, [t.is_meta for t in model.parameters()]

    out = cube.debug.run(rank, 4)
    for losses, err, meta in out:
        assert losses == pytest.approx(ref3["losses"], rel=1e-5)
        assert err <= 1e-5 * 3   # 1e-5 per AdamW step (see _check)
        assert all(meta)   # the user's model never held a value
    state, opt_state = cube.merge_checkpoint(ckpt)
    assert opt_state is not None and len(opt_state["state"]) == len(ref2["final"])
    for name, want in ref2["final"].items():
        assert worker.rel(state[name], want) <= 1e-5, name


# ---------------------------------------------------------------------- one rank: sources and errors
def _meta_llama():
    with torch.device("meta"):
        return hf_llama()


def _compile(model, cache, batch=None):
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    batch = batch or (ids, ids.clone())

    @cube.compile(model, iter([batch]), PAS=PASData, cache_dir=cache)
    def train_iter(model, dataloader):
        data = next(dataloader)
        loss = model(*data)
        loss.backward()
        return loss
    return train_iter


def _pieces_equal(gen, full: dict) -> list:
    tables = {**gen.PARAMS, **gen.BUFFERS}
    return [tables[k][0][0] for k, t in list(gen.named_parameters()) + list(gen.named_buffers())
            if not torch.equal(t, piece(full[tables[k][0][0]], tables[k][1]))]


def test_compile_of_a_meta_model_traces_a_cpu_batch_without_storage(cache):
    model, (ids, labels) = build("gpt_nobias")
    with torch.device("meta"):
        meta, _ = build("gpt_nobias")
    step = _compile(meta, cache, (ids, labels))
    assert all(p.is_meta for p in meta.parameters())
    assert step.module.GenModel.PARAMS.keys() == _compile(model, cache, (ids, labels)).module.GenModel.PARAMS.keys()


def test_plain_torch_module_default_reset_parameters_and_init(cache):
    """A meta model of torch modules: reset_parameters() by default; init= as apply(init)."""
    with torch.device("meta"):
        meta, (x,) = build("mlp")
    _, (x,) = build("mlp")
    step = _compile(meta, cache, (x,))
    beyond = []   # tensors materialized while init ran on a module that does not own them

    def uniform(m):
        own = {id(p) for p in m.parameters(recurse=False)}
        beyond.extend(n for n, p in meta.named_parameters() if not p.is_meta and id(p) not in own)
        for p in m.parameters(recurse=False):
            nn.init.uniform_(p, -0.1, 0.3)

    for init in (None, uniform):
        with torch.device("meta"):
            ref, _ = build("mlp")
        ref.to_empty(device="cpu")
        torch.manual_seed(5)
        ref.apply(init or (lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None))
        torch.manual_seed(5)
        gen = cube.load_model(step, init=init)
        assert _pieces_equal(gen, dict(ref.named_parameters())) == []
    assert beyond == []   # the peak is one module


def test_weights_safetensors_file_and_cube_checkpoint(tmp_path, cache):
    step = _compile(_meta_llama(), cache)
    ref = _reference(1, seed=11)
    safetensors.torch.save_file(ref["state"], str(tmp_path / "w.safetensors"))
    gen = cube.load_model(step, weights=tmp_path / "w.safetensors", init=step.user_model.model._init_weights)
    assert _pieces_equal(gen, ref["initial"]) == []
    cube.save_checkpoint(tmp_path / "ckpt", gen)
    # a checkpoint holds the state dict: the non-persistent rotary inv_freq comes from init, as with a file
    with pytest.raises(ValueError, match=r"nothing gives them values: model\.model\.rotary_emb\.inv_freq"):
        cube.load_model(step, weights=tmp_path / "ckpt")
    again = cube.load_model(step, weights=tmp_path / "ckpt", init=step.user_model.model._init_weights)
    assert _pieces_equal(again, ref["initial"]) == []


def test_init_touching_another_modules_tensor_is_an_error(cache):
    model = _meta_llama()
    step = _compile(model, cache)

    def init(m):
        model.model._init_weights(m)
        if type(m).__name__ == "LlamaRMSNorm":
            nn.init.zeros_(model.model.lm_head.weight)

    with pytest.raises(ValueError, match=r"init\(model.model.layers.0.input_layernorm \(LlamaRMSNorm\)\) touched "
                                         r"model.lm_head.weight, a tensor of another module \(aten.zero_"):
        cube.load_model(step, init=init)
    assert all(p.is_meta for p in model.parameters())   # the model is left as it was

    def assigns(m):
        model.model._init_weights(m)
        if type(m).__name__ == "LlamaRotaryEmbedding":
            model.model.lm_head.weight = nn.Parameter(torch.zeros(128, 32))

    with pytest.raises(ValueError, match=r"init\(model.model.rotary_emb \(LlamaRotaryEmbedding\)\) touched "
                                         r"Linear.weight.*assigned"):
        cube.load_model(step, init=assigns)


def test_weights_file_problems_are_one_error_listing_them(tmp_path, cache):
    step = _compile(_meta_llama(), cache)
    state = dict(_reference(1)["state"])
    state.pop("model.lm_head.weight")
    state["model.model.norm.weight"] = torch.ones(7)
    state["model.extra"] = torch.ones(2)
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(ValueError) as err:
        cube.load_model(step, weights=tmp_path / "bad.pt", init=step.user_model.model._init_weights)
    msg = str(err.value)
    assert "missing from the file (1): model.lm_head.weight" in msg
    assert "not in the model (1): model.extra" in msg
    assert "shapes differ (1): model.model.norm.weight (file [7], model [32])" in msg
    state["model.model.norm.weight"] = torch.ones(32)
    torch.save(state, tmp_path / "partial.pt")
    gen = cube.load_model(step, weights=tmp_path / "partial.pt", init=step.user_model.model._init_weights,
                          strict=False)   # lm_head.weight comes from init
    assert torch.equal(gen.state_dict()[next(k for k, v in gen.PARAMS.items() if v[0][0].endswith("norm.weight")
                                             and v[0][0].startswith("model.model.norm"))], torch.ones(32))


def test_meta_model_without_init_or_weights_names_the_tensors(cache):
    step = _compile(_meta_llama(), cache)
    with pytest.raises(ValueError, match=r"on the meta device and nothing gives them values: "
                                         r"model.model.layers.0.input_layernorm.weight \(in .*LlamaRMSNorm\).*"
                                         r"model.model.rotary_emb.inv_freq.*Fix: pass init=fn"):
        cube.load_model(step)


def test_errors_are_the_same_on_every_rank(tmp_path, cache):
    torch.save({"model.extra": torch.ones(2)}, tmp_path / "bad.pt")

    def rank():
        step = _compile(_meta_llama(), cache)
        try:
            cube.load_model(step, weights=tmp_path / "bad.pt")
        except ValueError as e:
            return str(e)
        return None

    messages = cube.debug.run(rank, 2)
    assert messages[0] and messages[0] == messages[1] and "missing from the file (" in messages[0]


# ---------------------------------------------------------------------- ranks read only their data
class _Counting:
    """An iterator of batches that counts the calls of next()."""

    def __init__(self, items):
        self.items, self.calls = iter(items), 0

    def __iter__(self):
        return self

    def __next__(self):
        self.calls += 1
        return next(self.items)


class _OnlyFirst(_Counting):
    """A loader that gives compile its batch, then raises: a rank with no data of its own."""

    def __next__(self):
        if self.calls:
            raise RuntimeError("this rank's loader has no data after the first batch")
        return super().__next__()


def _four_stage_run(cache, loader_of):
    """A 4-stage pipeline (tp1 x pp4, 2 micro-batches) of 3 steps, one global batch of 8 sequences
    each; each rank's loader is ``loader_of(rank, data)``. Returns (per rank: next() calls, losses,
    data part) and eager's losses."""
    from cube.policies.megatron3d import PASMegatron
    gen = torch.Generator().manual_seed(1)
    data = []
    for _ in range(3):
        ids = torch.randint(0, 128, (8, 16), generator=gen)
        data.append((ids, torch.roll(ids, -1, dims=1)))
    model, _ = build("gpt4_nobias")
    ref = [model(*b).item() for b in data]

    def rank():
        model, _ = build("gpt4_nobias")
        loader = loader_of(cube.debug.rank(), data)

        @cube.compile(model, loader, PAS=functools.partial(PASMegatron, tp=1, pp=4, nmicros=2), cache_dir=cache)
        def train_iter(model, dataloader):
            batch = next(dataloader)
            loss = model(*batch)
            loss.backward()
            return loss
        cmodel = cube.load_model()
        losses = [train_iter(cmodel, loader).item() for _ in range(3)]
        return loader.calls, losses, cube.runtime.data.part()

    return cube.debug.run(rank, 4), ref


def test_middle_pipeline_stages_never_take_a_batch(cache):
    out, ref = _four_stage_run(cache, lambda rank, data: _Counting(data))
    assert [calls for calls, _, _ in out] == [3, 1, 1, 3]   # stages 1 and 2 only had compile's read
    assert [p.reads for _, _, p in out] == [True, False, False, True]
    assert out[0][2].items == ([], None) and out[3][2].items == (None, [])   # ids first, targets last
    for _, losses, _ in out:
        assert losses == pytest.approx(ref, rel=1e-6)


def test_middle_stage_loader_that_raises_after_the_first_batch_trains(cache):
    """The middle stages' loaders raise on any read after compile's: training never asks them."""
    out, ref = _four_stage_run(cache, lambda rank, data: _OnlyFirst(data) if rank in (1, 2) else _Counting(data))
    assert [calls for calls, _, _ in out] == [3, 1, 1, 3]
    for _, losses, _ in out:
        assert losses == pytest.approx(ref, rel=1e-6)
