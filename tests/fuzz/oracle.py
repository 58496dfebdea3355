"""Runs one plan in the in-process world and judges it against the plain model.

Oracle: the plain model trained with SGD on the same global batches (a
pipeline plan cuts each into its micro-batches; the plain model trains on it
whole, and the step must equal that). Each step's loss and, after each step, every parameter
piece a rank holds must match, ``||a - b|| / ||b|| <= TOL`` per tensor, and
every parameter must be held by some rank.

Outcomes: ``exact``; ``wrong`` (ran, differs); ``refused`` (a ``ValueError``,
``TypeError`` or ``NotImplementedError`` while compiling, with a category
read from the message); ``crash`` (any other exception, or any exception
while running). ``hang`` is decided by the caller's watchdog (see
``tests.fuzz.pool``): threads cannot be stopped from inside.
"""
from __future__ import annotations

import copy
import re
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Optional

import torch

import cube
import cube.debug
from cube.runtime import piece
from cube.runtime.threadworld import RankFailed
from tests.fuzz.draw import FuzzPolicy
from tests.fuzz.models import build
from tests.fuzz.plan import Plan
from tests.parity import compile_step, global_batches, rel

TOL = 1e-5
STEPS = 2
LR = 1e-2
REFUSALS = (ValueError, TypeError, NotImplementedError)

# (category, pattern) in order: the first pattern found in a refusal's message names it
CATEGORIES = [
    ("layout cube cannot produce", r"cannot produce"),
    ("reader misses producer devices", r"gradient would be missing"),
    ("no whole piece covers read", r"no device holds a whole piece"),
    ("annotation forbids split", r"illegal split|may not be split|cannot be partitioned"),
    ("uneven split", r"uneven split|does not divide"),
    ("schedule/stage placement", r"schedule|stage"),
    ("recompute", r"recompute"),
]


@dataclass
class Result:
    """What one plan did. ``outcome``: exact, wrong, refused, crash or hang."""

    model: str
    seed: Optional[int]
    outcome: str
    category: str = ""
    detail: str = ""
    plan: str = ""
    seconds: float = 0.0
    literal: str = ""   # Plan.literal() of the plan run ("" when it was never drawn)

    def to_dict(self) -> dict:
        return asdict(self)


def category(message: str) -> str:
    """The refusal category of an error message (``other: <first words>`` when none fits)."""
    for name, pattern in CATEGORIES:
        if re.search(pattern, message):
            return name
    return "other: " + " ".join(message.split()[:8])


def reference(model, batches):
    """Plain SGD steps, one global batch each: per step (loss, {name: parameter copy})."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for s in range(STEPS):
        loss = model(*batches[s])
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append((loss.detach(), {k: p.detach().clone() for k, p in model.named_parameters()}))
    return out


def run(model_name: str, seed: Optional[int] = None, plan: Optional[Plan] = None) -> Result:
    """Runs plan (model, seed), or an explicit ``plan``, and judges it."""
    start = time.perf_counter()
    policy = FuzzPolicy(model_name, 0 if seed is None else seed, plan)
    res = _judge(model_name, policy)
    res.seed, res.plan = seed, policy.text or policy.plan.describe()
    res.literal = policy.plan.literal() if policy.filled else ""
    res.seconds = round(time.perf_counter() - start, 2)
    return res


def _judge(model_name: str, policy: FuzzPolicy) -> Result:
    model, sample = build(model_name)
    p = policy.plan
    batches = global_batches(sample, STEPS, p.nmicros, seed=1000 + policy.seed)
    ref = reference(model, batches)
    failures = {}
    lock = threading.Lock()

    def body():
        rank = cube.debug.rank()
        phase = "compile"
        try:
            with tempfile.TemporaryDirectory() as cache:
                loader = iter(batches)
                step = compile_step(model, loader, policy, cache)
                phase = "run"
                return _train_and_compare(step, loader, ref)
        except Exception as e:   # recorded with its phase; debug.run re-raises the first
            if not isinstance(e, RankFailed):
                with lock:
                    failures[rank] = (phase, e, traceback.format_exc())
            raise

    try:
        reports = cube.debug.run(body, p.ndev)
    except RuntimeError as e:
        if not failures:
            return Result(model_name, None, "crash", "world", str(e)[-2000:])
        phase, exc, tb = failures[min(failures)]
        msg = f"{type(exc).__name__}: {exc}"
        if phase == "compile" and isinstance(exc, REFUSALS):
            return Result(model_name, None, "refused", category(str(exc)), msg[:1500])
        return Result(model_name, None, "crash", f"{phase}: {type(exc).__name__}", (msg[:1500] + "\n" + tb[-2500:]))
    return _verdict(model_name, reports, ref)


def _train_and_compare(step, loader, ref) -> dict:
    """This rank's part of the oracle: losses and its parameter pieces after each step."""
    gen = cube.load_model()
    params = list(gen.parameters())
    opt = torch.optim.SGD(params, lr=LR) if params else None   # a stage may hold no parameters
    worst = {}
    names = set()
    for s, (ref_loss, ref_params) in enumerate(ref):
        loss = step(gen, loader)
        if opt is not None:
            opt.step()
            opt.zero_grad()
        worst[f"loss at step {s}"] = rel(loss, ref_loss)
        for local, p in gen.named_parameters():
            full, splits = gen.PARAMS[local]
            names.update(full)
            key = f"{full[0]}{list(splits) if splits else ''} after step {s}"
            worst[key] = rel(p, piece(ref_params[full[0]], splits))
    return {"errors": worst, "names": names}


def _verdict(model_name: str, reports, ref) -> Result:
    held = set().union(*(r["names"] for r in reports))
    missing = sorted(set(ref[0][1]) - held)
    if missing:
        return Result(model_name, None, "wrong", "parameter not held", f"no rank holds {missing[:5]}")
    bad = []
    for rank, r in enumerate(reports):
        for what, err in r["errors"].items():
            if not err <= TOL:   # NaN counts as wrong
                bad.append((err, f"rank {rank}: {what}: relative error {err:.3e}"))
    if not bad:
        return Result(model_name, None, "exact")
    bad.sort(key=lambda e: -e[0] if e[0] == e[0] else float("-inf"))   # NaN first
    cat = "loss" if any("loss" in b[1] for b in bad) else "parameters"
    return Result(model_name, None, "wrong", cat, f"{len(bad)} mismatches, worst:\n" +
                  "\n".join(b[1] for b in bad[:8]))
