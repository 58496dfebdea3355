"""Checkpoints of models with non-persistent and complex buffers (Llama-3-style rotary ``freqs_cis``).

The model registers its rotary table ``freqs_cis`` (complex64) with ``persistent=False``, as Llama 3's
reference code does, and also holds a persistent complex buffer and a complex parameter. The generated
module registers each buffer as the model does, so a checkpoint holds exactly what ``state_dict()``
holds: no ``freqs_cis``, and the complex tensors as their real views (safetensors has no complex
dtypes; ``cube.runtime.safetensors_file``), given back complex by every reader. Each plan (one rank
under PASSingle, two in-process ranks under PASData) trains two AdamW steps, saves, and takes a
third; the merged checkpoint loads strictly into the single-device model, equal to its own two steps,
and a fresh module loaded from the checkpoint takes the third step exactly as the run did.
"""
import copy
import hashlib
import io
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

import cube
import cube.debug
from cube.runtime import piece
from cube.runtime import safetensors_file as sfile
from cube.runtime.checkpoint import merge_checkpoint
from cube.policies.data import PASData
from cube.policies.single import PASSingle
from tests.parity import compile_step, rel

LR = 1e-3
RTOL = 1e-5
VOCAB, DIM, HEADS, SEQ, BATCH = 32, 16, 2, 8, 4


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """Llama 3's rotary table: ``(end, dim // 2)`` unit complex numbers."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    """Llama 3's reference rotation of ``(B, S, H, D)`` queries and keys."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RotaryLM(nn.Module):
    """One causal attention layer with rotary embeddings; its input is turned by a complex gain (a
    parameter) and a fixed complex phase (a persistent buffer)."""

    def __init__(self):
        super().__init__()
        self.head_dim = DIM // HEADS
        self.tok = nn.Embedding(VOCAB, DIM)
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        # arange, not linspace: when a process first enters a torch.device context inside from_pretrained
        # (which patches torch.linspace meanwhile), torch caches the patched function as the factory, and
        # torch.linspace then ignores `with torch.device("meta")` in that process (tests/test_checkpoint.py)
        angles = torch.arange(DIM // 2, dtype=torch.float32) / (DIM // 2)
        self.gain = nn.Parameter(torch.polar(torch.ones(DIM // 2), angles))
        self.register_buffer("phase", torch.polar(torch.ones(DIM // 2), 0.5 - angles))
        self.register_buffer("freqs_cis", precompute_freqs_cis(self.head_dim, SEQ), persistent=False)

    def forward(self, ids, labels):
        h = self.tok(ids)
        b, s, d = h.shape
        h = torch.view_as_real(torch.view_as_complex(h.reshape(b, s, d // 2, 2)) * (self.gain * self.phase)).flatten(2)
        q = self.wq(h).view(b, s, HEADS, self.head_dim)
        k = self.wk(h).view(b, s, HEADS, self.head_dim)
        v = self.wv(h).view(b, s, HEADS, self.head_dim)
        q, k = apply_rotary_emb(q, k, self.freqs_cis[:s])
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = h + self.wo(o.transpose(1, 2).reshape(b, s, d))
        return F.cross_entropy(self.out(h).flatten(0, 1), labels.flatten())


def init_rotary(m: nn.Module) -> None:
    """``load_model(init=)`` for what a checkpoint lacks: the non-persistent rotary table."""
    if isinstance(m, RotaryLM):
        m.freqs_cis.copy_(precompute_freqs_cis(m.head_dim, SEQ))


def build() -> RotaryLM:
    torch.manual_seed(0)
    return RotaryLM()


def batches(n: int):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))
            for _ in range(n)]


def crel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``rel`` that compares complex tensors as their real views (both parts)."""
    if a.is_complex() or b.is_complex():
        return rel(torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj()))
    return rel(a, b)


def single_device(steps: int):
    """The plain model and AdamW after ``steps`` steps on ``batches``, and every loss."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids, labels in batches(steps):
        loss = model(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


PLANS = {"single": (PASSingle, 1), "data": (PASData, 2)}   # tag: (policy, ranks)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each plan: two steps, save (with ``extra``), a third step; then a fresh module and optimizer
    loaded from the checkpoint take the third step again."""
    d = tmp_path_factory.mktemp("buffers")
    user = build()
    data = batches(3)
    out = {}
    for tag, (policy, world) in PLANS.items():
        ckpt = d / tag

        def rank():
            loader = iter(data)
            step = compile_step(copy.deepcopy(user), loader, policy, d / "cache")
            gen = cube.load_model()
            opt = torch.optim.AdamW(gen.parameters(), lr=LR)
            losses = []
            for i in range(3):
                if i == 2:
                    cube.save_checkpoint(ckpt, gen, opt, extra={"step": 2})
                losses.append(step(gen, loader).item())
                opt.step()
                opt.zero_grad()
            fresh = step.load_model()   # the user model's initial values
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=LR)
            extra = cube.load_checkpoint(ckpt, fresh, fresh_opt)
            resumed = step(fresh, iter(data[2:])).item()
            fresh_opt.step()
            same = all(torch.equal(p, q) for p, q in zip(fresh.parameters(), gen.parameters()))
            return {"losses": losses, "resumed": resumed, "extra": extra, "same_after": same,
                    "state_dict": list(gen.state_dict()), "non_persistent": sorted(gen._non_persistent_buffers_set),
                    "source": step.source}
        out[tag] = cube.debug.run(rank, world)
    return d, out


@pytest.mark.multirank
@pytest.mark.parametrize("tag", list(PLANS))
def test_generated_module_keeps_the_models_non_persistent_buffers(runs, tag):
    _, out = runs
    for r in out[tag]:
        assert "freqs_cis" in r["non_persistent"] and "phase" not in r["non_persistent"]
        assert "'freqs_cis', torch.empty((8, 4), dtype=torch.complex64, device=device), persistent=False" in r["source"]
        assert "'phase', torch.empty((8,), dtype=torch.complex64, device=device), persistent=True" in r["source"]
        assert "freqs_cis" not in r["state_dict"] and "phase" in r["state_dict"]


@pytest.mark.multirank
@pytest.mark.parametrize("tag", list(PLANS))
def test_checkpoint_holds_the_state_dict_with_complex_tensors_as_real_views(runs, tag):
    d, _ = runs
    world = PLANS[tag][1]
    for r in range(world):
        slots, metadata = sfile.read_header(d / tag / f"rank{r}.safetensors")
        assert not any(k.startswith("freqs_cis") for k in slots)
        assert slots["phase"].dtype == slots["gain"].dtype == torch.complex64
        assert json.loads(metadata[sfile.COMPLEX]) == {"gain": "complex64", "phase": "complex64",
                                                       "gain/exp_avg": "complex64", "gain/exp_avg_sq": "complex64"}
        raw = load_file(d / tag / f"rank{r}.safetensors")   # other readers: the real view
        assert raw["phase"].dtype == torch.float32 and raw["phase"].shape == (DIM // 2, 2)
        assert torch.equal(torch.view_as_complex(raw["phase"]), build().phase)


@pytest.mark.multirank
@pytest.mark.parametrize("tag", list(PLANS))
def test_merge_loads_strictly_into_the_single_device_model(runs, tag):
    d, out = runs
    model, opt, losses = single_device(2)
    for r in out[tag]:
        assert all(rel(torch.tensor(a), torch.tensor(b)) <= RTOL for a, b in zip(r["losses"], losses)), (r, losses)
    for state, opt_state in (merge_checkpoint(d / tag), merge_checkpoint(d / tag, model=model)):
        assert list(state) == list(model.state_dict())   # no freqs_cis
        assert state["phase"].dtype == state["gain"].dtype == torch.complex64
        for name, want in model.state_dict().items():
            assert crel(state[name], want) <= RTOL, (tag, name)
        for i, st in opt.state_dict()["state"].items():
            assert float(opt_state["state"][i]["step"]) == float(st["step"]) == 2
            for key in ("exp_avg", "exp_avg_sq"):
                assert crel(opt_state["state"][i][key], st[key]) <= RTOL, (tag, i, key)
    state, opt_state = merge_checkpoint(d / tag)
    plain = build()
    plain.load_state_dict(state)   # strict
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    plain_opt.load_state_dict(opt_state)
    assert torch.equal(plain.freqs_cis, build().freqs_cis)
    loss = plain(*batches(3)[2])
    assert rel(loss.detach(), torch.tensor(out[tag][0]["losses"][2])) <= RTOL, (loss, out[tag][0]["losses"])


@pytest.mark.multirank
@pytest.mark.parametrize("tag", list(PLANS))
def test_load_checkpoint_continues_training_identically(runs, tag):
    _, out = runs
    for r in out[tag]:
        assert r["extra"] == {"step": 2}
        assert r["resumed"] == r["losses"][2]
        assert r["same_after"]


def test_merged_safetensors_and_checkpoint_load_as_weights(runs, tmp_path):
    """``load_model(weights=)`` of the merged Hugging Face layout and of the checkpoint itself: complex
    tensors come back complex; a meta model's rotary table (in neither) comes from ``init``."""
    d, _ = runs
    index = merge_checkpoint(d / "single", out=tmp_path / "hf")
    names = json.loads(index.read_text())["weight_map"]
    assert "freqs_cis" not in names and "phase" in names
    state, _ = merge_checkpoint(d / "single")
    step = compile_step(build(), iter(batches(1)), PASSingle, tmp_path / "cache")

    def pieces_equal(gen, full):
        tables = {**gen.PARAMS, **gen.BUFFERS}
        return [tables[k][0][0] for k, t in list(gen.named_parameters()) + list(gen.named_buffers())
                if not torch.equal(t, piece(full[tables[k][0][0]], tables[k][1]))]

    full = {**state, "freqs_cis": build().freqs_cis}
    for weights in (tmp_path / "hf", d / "single"):
        assert pieces_equal(cube.load_model(step, weights=weights), full) == []

    with torch.device("meta"):
        meta = build()
    step = compile_step(meta, iter(batches(1)), PASSingle, tmp_path / "cache")
    with pytest.raises(ValueError, match=r"nothing gives them values: freqs_cis \(in the model: RotaryLM\)"):
        cube.load_model(step, weights=d / "single")
    assert pieces_equal(cube.load_model(step, weights=d / "single", init=init_rotary), full) == []
    assert all(t.is_meta for t in meta.state_dict().values())


def test_checkpoint_of_an_older_cube_holding_a_non_persistent_buffer_loads(runs, tmp_path):
    """Before buffers kept their persistence, checkpoints held the non-persistent ones too (format 1
    here, as a tensor in the record): they are not loaded, as torch does not load them."""
    d, _ = runs
    rec = torch.load(d / "single" / "rank0.pt", weights_only=True)
    data = sfile.read_header(d / "single" / "rank0.safetensors")[0]
    rec.update(format=1)
    del rec["layout"]
    for local, t in rec["tensors"].items():
        t["tensor"] = data[local].read()
    for st in rec["optimizer"]["state"].values():
        st["pieces"] = {key: data[k].read() for key, k in st["pieces"].items()}
    rec["tensors"]["freqs_cis"] = {"kind": "buffer", "names": ["freqs_cis"], "splits": [],
                                   "tensor": torch.zeros(SEQ, DIM // HEADS // 2, dtype=torch.complex64)}
    old = tmp_path / "old"
    old.mkdir()
    buf = io.BytesIO()
    torch.save(rec, buf)
    (old / "rank0.pt").write_bytes(buf.getvalue())
    (old / "meta.json").write_text(json.dumps({"format": 1, "model": "RotaryLM", "world_size": 1, "files": {
        "rank0.pt": {"sha256": hashlib.sha256(buf.getvalue()).hexdigest(), "bytes": len(buf.getvalue())}}}))
    step = compile_step(build(), iter(batches(1)), PASSingle, tmp_path / "cache")
    gen = cube.load_model(step)
    assert cube.load_checkpoint(old, gen) == {"step": 2}
    assert torch.equal(gen.freqs_cis, build().freqs_cis)   # the model's table, not the file's zeros
    state, _ = merge_checkpoint(d / "single")
    assert all(torch.equal(getattr(gen, k), state[k]) for k in ("phase", "gain"))
    with pytest.warns(UserWarning, match="which buffers are persistent is unknown"):
        assert "freqs_cis" in merge_checkpoint(old)[0]
    assert list(merge_checkpoint(old, model=build())[0]) == list(build().state_dict())


# ---------------------------------------------------------------------- the file format
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_safetensors_file_round_trips_complex_tensors(tmp_path, dtype):
    full = torch.randn(3, 4, dtype=dtype)
    entries = [sfile.Entry("z", dtype, (3, 4), lambda: full), sfile.Entry("conj", dtype, (3, 4), lambda: full.conj()),
               sfile.Entry("x", torch.float32, (2,), lambda: torch.ones(2))]
    with open(tmp_path / "f.safetensors", "wb") as f:
        sfile.write(f, entries)
    slots, _ = sfile.read_header(tmp_path / "f.safetensors")
    assert (slots["z"].dtype, slots["z"].shape) == (dtype, (3, 4))
    assert torch.equal(slots["z"].read(), full) and torch.equal(slots["conj"].read(), full.conj().resolve_conj())
    part = torch.zeros(4, 3, dtype=dtype).t()   # a non-contiguous destination
    slots["z"].read_into(part)
    assert torch.equal(part, full)
    assert torch.equal(load_file(tmp_path / "f.safetensors")["z"], torch.view_as_real(full))


def test_safetensors_file_refuses_what_it_cannot_store_or_read(tmp_path):
    with open(tmp_path / "u.safetensors", "wb") as f, \
            pytest.raises(TypeError, match=r"tensor 'q' has dtype torch.uint16, which safetensors cannot store"):
        sfile.write(f, [sfile.Entry("q", torch.uint16, (2,), lambda: torch.zeros(2, dtype=torch.uint16))])
    for meta, match in (("[1]", "corrupt 'cube.complex' metadata"), ('{"x": "complex7"}', "corrupt"),
                        ('{"x": "complex128"}', r"listed as torch.complex128 but stored as torch.float32 \[4\]")):
        with open(tmp_path / "m.safetensors", "wb") as f:
            sfile.write(f, [sfile.Entry("x", torch.float32, (4,), lambda: torch.ones(4))], {sfile.COMPLEX: meta})
        with pytest.raises(ValueError, match=match):
            sfile.read_header(tmp_path / "m.safetensors")
