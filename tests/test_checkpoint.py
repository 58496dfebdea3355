"""Checkpoints: save per rank, merge for the single-device model, load under another plan.

The multi-rank tests share four launches on the GPT (tied embedding and LM head):
A trains under dp x tp on 4 ranks and saves; B loads A into a 2-rank 1F1B pipeline
(4 micro-batches a step) and saves again; C loads B under Megatron TP on 2 ranks;
Z loads A under data parallel with ZeRO-2 and saves.
Each run's losses must equal the single-device model's, loaded from the merged
checkpoint and trained on the same batches. The Hugging Face Llama (non-persistent
rotary buffers) trains under Megatron TP, ZeRO-3 and a 1F1B pipeline, 2 ranks in
one process each (``cube.debug.run``), and is merged from the path alone, into
state dicts and into sharded safetensors for ``from_pretrained``. The unit tests
save a one-process plan and break the checkpoint in every way a loader must refuse.
"""
import copy
import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import cube
import cube.debug
from cube.runtime.checkpoint import merge_checkpoint
from examples.mlp.linears import MLP
from cube.policies.single import PASSingle
from tests.launch import ROOT, torchrun
from tests.models import HFCausalLM, build
from tests.parity import compile_step, rel
from tests.workers.checkpoint_worker import LR, batch_stream, train

LOSS_RTOL = 1e-6   # one or two steps after loading: observed 1e-7 (dp x tp) and 0 (pipeline)
RTOL = 1e-5        # parameters and AdamW state (see tests/workers/parity_worker.py on AdamW near zero)
WORKER = ROOT / "tests" / "workers" / "checkpoint_worker.py"


def single_from(path, model_name="gpt_nobias"):
    """The single-device model and a plain AdamW, loaded from the merged checkpoint."""
    model, _ = build(model_name)
    state, opt_state = merge_checkpoint(path, model=model)
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    opt.load_state_dict(opt_state)
    return model, opt


def single_step(model, opt, batches):
    """One step on ``batches`` joined into one global batch, as a pipeline step cuts it."""
    loss = model(*[torch.cat(ts) for ts in zip(*batches)])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


# ---------------------------------------------------------------------- multi-rank
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("checkpoint")

    def run(tag, policy, nproc, args, env=None):
        out = d / tag
        out.mkdir()
        torchrun(WORKER, nproc, ["gpt_nobias", policy, out, *args], env=env)
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]

    a = run("a", "cube.policies.hybrid:PASHybrid", 4, ["--save", d / "ckpt_a", "--save-after", 2, "--steps", 4],
            env={"CUBE_TP": "2"})
    b = run("b", "tests/extra_policies.py:PAS1F1B", 2, ["--load", d / "ckpt_a", "--offset", 2, "--nmicros", 4,
                                                       "--save", d / "ckpt_b", "--save-after", 1, "--steps", 2])
    c = run("c", "cube.policies.megatron:PASMegatronTP", 2, ["--load", d / "ckpt_b", "--offset", 6, "--steps", 1])
    z = run("z", "cube.policies.data:PASData", 2, ["--load", d / "ckpt_a", "--offset", 2, "--zero", 2,
                                              "--save", d / "ckpt_z", "--save-after", 2, "--steps", 2])
    return d, a, b, c, z


@pytest.mark.multirank
def test_round_trip_continues_like_the_distributed_run(runs):
    d, a, _, _, _ = runs
    assert sorted(p.name for p in (d / "ckpt_a").iterdir()) == ["meta.json"] + [
        f"rank{r}.{k}" for r in range(4) for k in ("pt", "safetensors")]
    assert all(r["losses"] == a[0]["losses"] for r in a)
    _, sample = build("gpt_nobias")
    batches = batch_stream(sample, 4)
    model, opt = single_from(d / "ckpt_a")
    for i in (2, 3):   # the distributed run's steps after the save
        loss = single_step(model, opt, [batches[i]])
        assert rel(torch.tensor(loss), torch.tensor(a[0]["losses"][i])) <= LOSS_RTOL, (i, loss, a[0]["losses"])


@pytest.mark.multirank
def test_reshard_into_a_pipeline_and_back_into_tensor_parallel(runs):
    d, _, b, c, _ = runs
    assert all(r["held_numel"] < r["full_numel"] for r in b)   # each stage holds its part only
    assert [r["extra"] for r in b] == [{"batches": 2}] * 2 and c[0]["extra"] == {"batches": 6}
    _, sample = build("gpt_nobias")
    batches = batch_stream(sample, 10)
    model, opt = single_from(d / "ckpt_a")
    loss = single_step(model, opt, batches[2:6])
    assert rel(torch.tensor(loss), torch.tensor(b[0]["losses"][0])) <= LOSS_RTOL, (loss, b[0]["losses"])

    # the pipeline's checkpoint holds what the single-device model has after that step
    state, opt_state = merge_checkpoint(d / "ckpt_b", model=model)
    for name, p in model.state_dict().items():
        assert rel(state[name], p) <= RTOL, name
    ref_state = opt.state_dict()
    for i, st in ref_state["state"].items():
        assert float(opt_state["state"][i]["step"]) == float(st["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert rel(opt_state["state"][i][key], st[key]) <= RTOL, (i, key)
    assert opt_state["param_groups"] == ref_state["param_groups"]

    # B's next step, and C: B's checkpoint under Megatron TP, one batch
    c_model, c_opt = single_from(d / "ckpt_b")
    loss = single_step(model, opt, batches[6:10])
    assert rel(torch.tensor(loss), torch.tensor(b[0]["losses"][1])) <= LOSS_RTOL, (loss, b[0]["losses"])
    loss = single_step(c_model, c_opt, batches[6:7])
    assert rel(torch.tensor(loss), torch.tensor(c[0]["losses"][0])) <= LOSS_RTOL, (loss, c[0]["losses"])


@pytest.mark.multirank
def test_zero_optimizer_loads_and_saves_the_plain_optimizer_state(runs):
    d, _, _, _, z = runs
    _, sample = build("gpt_nobias")
    batches = batch_stream(sample, 4)
    model, opt = single_from(d / "ckpt_a")   # saved with a plain AdamW
    for i, loss in zip((2, 3), z[0]["losses"]):
        ref = single_step(model, opt, [batches[i]])
        assert rel(torch.tensor(loss), torch.tensor(ref)) <= LOSS_RTOL, (i, loss, ref)
    state, opt_state = merge_checkpoint(d / "ckpt_z", model=model)
    for name, p in model.state_dict().items():
        assert rel(state[name], p) <= RTOL, name
    for i, st in opt.state_dict()["state"].items():
        assert float(opt_state["state"][i]["step"]) == float(st["step"]) == 4
        for key in ("exp_avg", "exp_avg_sq"):
            assert rel(opt_state["state"][i][key], st[key]) <= RTOL, (i, key)


@pytest.mark.multirank
def test_merge_without_the_model_orders_parameters_as_the_model_does(runs):
    d, _, _, _, _ = runs
    model, _ = build("gpt_nobias")
    for ckpt in ("ckpt_a", "ckpt_b"):   # dp x tp; a pipeline, each rank holding one stage
        state, opt_state = merge_checkpoint(d / ckpt)
        with_model = merge_checkpoint(d / ckpt, model=model)
        model.load_state_dict(state)
        assert opt_state["param_groups"] == with_model[1]["param_groups"]
        for i, st in with_model[1]["state"].items():
            assert all(torch.equal(v, opt_state["state"][i][k]) for k, v in st.items()), (ckpt, i)


# ---------------------------------------------------------------------- Hugging Face Llama, path alone
HF_PLANS = {   # tag: (policy, ZeRO stage, micro-batches a step)
    "tp": ("cube.policies.megatron:PASMegatronTP", 0, 1),
    "zero3": ("cube.policies.data:PASData", 3, 1),
    "pipeline": ("cube.policies.pipeline:PAS1F1B", 0, 4),
}


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    """Each plan on 2 ranks in one process: a step, save, a step, save."""
    d = tmp_path_factory.mktemp("hf")
    runs = {}
    for tag, (policy, zero, nmicros) in HF_PLANS.items():
        saves = {1: d / tag / "step1", 2: d / tag / "step2"}
        runs[tag] = cube.debug.run(lambda: train("hf_llama", policy, d / "cache", saves=saves, steps=2,
                                                 nmicros=nmicros, zero=zero), 2)
    return d, runs


def hf_continue(tag, model, opt):
    """The second step of ``HF_PLANS[tag]``'s run, on the single-device model."""
    nmicros = HF_PLANS[tag][2]
    _, sample = build("hf_llama")
    return single_step(model, opt, batch_stream(sample, 2 * nmicros)[nmicros:])


@pytest.mark.multirank
@pytest.mark.parametrize("tag", list(HF_PLANS))
def test_merge_from_the_path_alone_loads_into_the_original_model(hf_runs, tag):
    d, runs = hf_runs
    assert all(r["losses"] == runs[tag][0]["losses"] for r in runs[tag])
    model, _ = build("hf_llama")
    state, opt_state = merge_checkpoint(d / tag / "step1")   # no model=: the saved layout
    assert list(state) == list(model.state_dict())   # the rotary inv_freq buffers are non-persistent
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    opt.load_state_dict(opt_state)
    loss = hf_continue(tag, model, opt)
    assert rel(torch.tensor(loss), torch.tensor(runs[tag][0]["losses"][1])) <= LOSS_RTOL, (loss, runs[tag][0])

    state, opt_state = merge_checkpoint(d / tag / "step2")   # the distributed run after that step
    for name, p in model.state_dict().items():
        assert rel(state[name], p) <= RTOL, (tag, name)
    ref = opt.state_dict()
    assert opt_state["param_groups"] == ref["param_groups"]
    for i, st in ref["state"].items():
        assert float(opt_state["state"][i]["step"]) == float(st["step"]) == 2
        for key in ("exp_avg", "exp_avg_sq"):
            assert rel(opt_state["state"][i][key], st[key]) <= RTOL, (tag, i, key)


@pytest.mark.multirank
def test_merge_into_sharded_safetensors_loads_with_from_pretrained(hf_runs, tmp_path):
    from transformers import LlamaForCausalLM
    d, runs = hf_runs
    out = tmp_path / "hf"
    index = merge_checkpoint(d / "tp" / "step1", out=out, strip_prefix="model.", max_shard_size="40KB")
    state, opt_state = merge_checkpoint(d / "tp" / "step1")
    model, _ = build("hf_llama")
    model.model.config.save_pretrained(out)
    meta = json.loads(index.read_text())
    files = sorted(set(meta["weight_map"].values()))
    assert index == out / "model.safetensors.index.json" and len(files) > 1
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert sorted(meta["weight_map"]) == sorted(n[len("model."):] for n in state)   # no inv_freq
    assert meta["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())

    hf = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert hf.dtype == torch.float32
    for name, p in hf.state_dict().items():
        assert torch.equal(p, state["model." + name]), name
    wrapped = HFCausalLM(hf)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    opt.load_state_dict(opt_state)
    loss = hf_continue("tp", wrapped, opt)
    assert rel(torch.tensor(loss), torch.tensor(runs["tp"][0]["losses"][1])) <= LOSS_RTOL, (loss, runs["tp"][0])
    after, _ = merge_checkpoint(d / "tp" / "step2")
    for name, p in wrapped.state_dict().items():
        assert rel(after[name], p) <= RTOL, name


# ---------------------------------------------------------------------- one process
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A trained one-process MLP plan saved with its optimizer; the compiled step for more."""
    d = tmp_path_factory.mktemp("single")
    model, sample = build("mlp")
    user = copy.deepcopy(model)
    batches = batch_stream(sample, 3)
    loader = iter(batches)
    step = compile_step(model, loader, PASSingle, d / "cache")
    gen = cube.load_model()
    opt = torch.optim.AdamW(gen.parameters(), lr=LR)
    for _ in range(2):
        step(gen, loader)
        opt.step()
        opt.zero_grad()
    cube.save_checkpoint(d / "ckpt", gen, opt, extra={"step": 2})
    return d, step, gen, opt, user


def _copy(saved, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(saved[0] / "ckpt", dst)
    return dst


def test_merge_and_load_in_one_process(saved):
    d, step, gen, opt, user = saved
    state, opt_state = merge_checkpoint(d / "ckpt", model=user)
    assert list(state) == list(user.state_dict())
    for local, (names, _) in gen.PARAMS.items():
        assert torch.equal(state[names[0]], getattr(gen, local))
    user.load_state_dict(state)
    plain = torch.optim.AdamW(user.parameters(), lr=LR)
    plain.load_state_dict(opt_state)
    for p, q in zip(user.parameters(), gen.parameters()):
        assert all(torch.equal(plain.state[p][k], opt.state[q][k]) for k in opt.state[q])

    fresh = step.load_model()   # the user model's initial values
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    assert cube.load_checkpoint(d / "ckpt", fresh, fresh_opt) == {"step": 2}
    assert fresh_opt.param_groups[0]["lr"] == LR
    for (k, p), q in zip(fresh.named_parameters(), gen.parameters()):
        assert torch.equal(p, q), k
        assert all(torch.equal(fresh_opt.state[p][s], opt.state[q][s]) for s in opt.state[q])


def test_missing_directory_and_incomplete_checkpoints(saved, tmp_path):
    _, _, gen, _, _ = saved
    with pytest.raises(ValueError, match="does not exist"):
        cube.load_checkpoint(tmp_path / "nowhere", gen)
    ckpt = _copy(saved, tmp_path)
    (ckpt / "meta.json").unlink()
    with pytest.raises(ValueError, match="incomplete: meta.json is missing"):
        merge_checkpoint(ckpt)
    shutil.rmtree(ckpt)
    ckpt = _copy(saved, tmp_path)
    (ckpt / "rank0.pt").unlink()
    with pytest.raises(ValueError, match="incomplete: rank0.pt is missing"):
        cube.load_checkpoint(ckpt, gen)


def test_corrupt_file_is_named(saved, tmp_path):
    _, _, gen, _, _ = saved
    ckpt = _copy(saved, tmp_path)
    data = bytearray((ckpt / "rank0.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (ckpt / "rank0.pt").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"rank0\.pt' is corrupt"):
        cube.load_checkpoint(ckpt, gen)
    shutil.rmtree(ckpt)
    ckpt = _copy(saved, tmp_path)
    with open(ckpt / "rank0.safetensors", "r+b") as f:   # a tensor's byte: read only when merged, but checked
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(ValueError, match=r"rank0\.safetensors' is corrupt"):
        merge_checkpoint(ckpt, out=tmp_path / "hf")
    (ckpt / "meta.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"meta\.json' is corrupt"):
        merge_checkpoint(ckpt)


def test_checkpoint_of_another_model_names_the_first_mismatch(saved, tmp_path):
    d, _, _, _, user = saved
    for model, match in ((MLP(dim=16, nlayers=4), r"'layers\.0\.weight' has shape \[32, 32\] .* but \[16, 16\]"),
                         (MLP(dim=32, nlayers=2), r"holds 'layers\.2\.weight', which this model \(MLP\)"),
                         (MLP(dim=32, nlayers=5), r"has no param 'layers\.4\.weight'")):
        sample = torch.randn(8, model.layers[0].in_features)
        compile_step(model, iter([sample]), PASSingle, d / "cache", tensor_batch=True)
        with pytest.raises(ValueError, match=match):
            cube.load_checkpoint(d / "ckpt", cube.load_model())
    with pytest.raises(ValueError, match=r"'layers\.0\.weight' has shape \[32, 32\] in checkpoint"):
        merge_checkpoint(d / "ckpt", model=MLP(dim=16, nlayers=4))
    with pytest.raises(TypeError, match="takes this rank's module from cube.load_model"):
        cube.load_checkpoint(d / "ckpt", user)


def test_optimizer_state_missing(saved, tmp_path):
    _, step, gen, _, _ = saved
    cube.save_checkpoint(tmp_path / "bare", gen)
    assert merge_checkpoint(tmp_path / "bare")[1] is None
    fresh = step.load_model()
    with pytest.raises(ValueError, match="holds no optimizer state"):
        cube.load_checkpoint(tmp_path / "bare", fresh, torch.optim.AdamW(fresh.parameters()))
    two = [{"params": [p]} for p in fresh.parameters()]
    with pytest.raises(ValueError, match="build the optimizer's groups as when saving"):
        cube.load_checkpoint(saved[0] / "ckpt", fresh, torch.optim.AdamW(two))


def _write_format1(ckpt, records):
    """Rank files and meta.json of format 1 (every tensor inside ``rank{r}.pt``, no layout)."""
    ckpt.mkdir()
    files = {}
    for r, rec in enumerate(records):
        torch.save(rec, ckpt / f"rank{r}.pt")
        data = (ckpt / f"rank{r}.pt").read_bytes()
        files[f"rank{r}.pt"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (ckpt / "meta.json").write_text(json.dumps({"format": 1, "model": "MLP", "world_size": len(records),
                                                "files": files}))


def _format1_record(folder):
    """Rank 0's record of a one-process checkpoint, rewritten as format 1."""
    rec = torch.load(folder / "rank0.pt", weights_only=True)
    data = load_file(folder / "rank0.safetensors")
    rec.update(format=1)
    del rec["layout"]
    for local, t in rec["tensors"].items():
        t["tensor"] = data[local]
    for st in rec["optimizer"]["state"].values():
        st["pieces"] = {key: data[k] for key, k in st["pieces"].items()}
    return rec


def test_checkpoints_of_format_1_still_merge_and_load(saved, tmp_path):
    d, step, gen, opt, user = saved
    _write_format1(tmp_path / "old", [_format1_record(d / "ckpt")])
    state, opt_state = merge_checkpoint(tmp_path / "old")
    new_state, new_opt_state = merge_checkpoint(d / "ckpt")
    assert state.keys() == new_state.keys() and all(torch.equal(state[k], new_state[k]) for k in state)
    for i, st in new_opt_state["state"].items():
        assert all(torch.equal(v, opt_state["state"][i][k]) for k, v in st.items())
    fresh = step.load_model()
    assert cube.load_checkpoint(tmp_path / "old", fresh) == {"step": 2}
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), gen.parameters()))


def test_tensor_held_by_no_rank_fails_merge(saved, tmp_path):
    """Two rank files, rows 0:8 and 16:32 of one weight: rows 8:16 are nobody's."""
    rec = _format1_record(saved[0] / "ckpt")
    parts = []
    for r, (start, stop) in enumerate(((0, 8), (16, 32))):
        part = copy.deepcopy(rec)
        part.update(rank=r, world_size=2, optimizer=None)
        t = part["tensors"]["layers_0_weight"]
        t["splits"], t["tensor"] = [(0, start, stop)], t["tensor"][start:stop].clone()
        parts.append(part)
    _write_format1(tmp_path / "gap", parts)
    with pytest.raises(ValueError, match=r"256 of 1024 elements of 'layers\.0\.weight' are held by no rank"):
        merge_checkpoint(tmp_path / "gap")


def test_merge_into_safetensors_in_one_process(saved, tmp_path):
    d, _, _, _, user = saved
    state, _ = merge_checkpoint(d / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00001-of-00009.safetensors").write_bytes(b"stale")   # an earlier merge's shard
    index = merge_checkpoint(d / "ckpt", out=out, strip_prefix="layers.", max_shard_size=5000)
    meta = json.loads(index.read_text())
    written = {}
    for f in sorted(set(meta["weight_map"].values())):
        part = load_file(out / f)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 5000 or len(part) == 1
        written.update(part)
    assert written.keys() == meta["weight_map"].keys() == {n[len("layers."):] for n in state}
    assert all(torch.equal(written[n[len("layers."):]], t) for n, t in state.items())
    assert not (out / "model-00001-of-00009.safetensors").exists()

    with pytest.raises(ValueError, match=r"'layers\.0\.weight' does not start with strip_prefix='m\.'"):
        merge_checkpoint(d / "ckpt", out=out, strip_prefix="m.")
    with pytest.raises(ValueError, match="max_shard_size='2 parsecs' is not a size"):
        merge_checkpoint(d / "ckpt", out=out, max_shard_size="2 parsecs")
    (out / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="from_pretrained would read it instead"):
        merge_checkpoint(d / "ckpt", out=out)
