"""A plan, for people: a text dump per rank and pictures (SVG, no dependencies).

- ``plan.txt``: the splits the policy asked for that the plan does not keep (``cube.ir.lost``),
  then per rank, its pieces of the parameters, each forward statement
  (op piece with the boxes it reads and makes, or a communication step with its
  ranks), the gradient sums left to the reducer and the pipeline actions.
- ``placement.svg``: which rank holds which piece of each parameter: one row per
  tensor, one column per rank, the rank's box drawn inside the full tensor.
- ``schedule.svg``: the pipeline schedule as a rank x time chart (when the plan
  has one).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Sequence

from cube.ir.tensor import TensorKind
from cube.passes.rank_plans import Call, RankPlan
from cube.passes.program import Program
from cube.schedule.schedules import Schedule, validate

COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7"]


def _box(box, shape) -> str:
    """``[0:4, :]``: the box, with ``:`` for a whole dim."""
    parts = [":" if (s, e) == (0, n) else f"{s}:{e}" for (s, e), n in zip(box, shape)]
    return "[" + ", ".join(parts) + "]"


def _name(t) -> str:
    return t.names[0] if getattr(t, "names", None) else (t.hint or t.name or "value")


def sent_bytes(call: Call) -> int:
    """Bytes this rank sends in forward for a step (ring algorithms for collectives, as NCCL and
    gloo use at these sizes; a piece communicating inside its call: its point-to-point messages and
    all-reduces); 0 for another op piece or a local step."""
    s = call.step
    if s is None:   # a piece communicating inside its call
        return _inside_bytes(call, "f")
    value = call.inputs[0] if call.inputs else call.outputs[0]
    if s.kind == "send":
        return 0 if s.grad == "only" else math.prod(e - b for b, e in s.box) * value.dtype.itemsize
    if not call.outputs or s.kind not in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        return 0
    out = call.outputs[0]
    n, nbytes = len(s.ranks), math.prod(out.shape) * out.dtype.itemsize
    return {"all_reduce": 2 * (n - 1) * nbytes // n, "all_gather": (n - 1) * nbytes // n,
            "reduce_scatter": (n - 1) * nbytes, "all_to_all": (n - 1) * nbytes // n}[s.kind]


def _inside_bytes(call: Call, way: str) -> int:
    """Bytes a piece communicating inside its call (``cube.passes.inside``) sends in forward (``"f"``)
    or backward (``"b"``): its messages (a halo's backward sends back what it received), any
    reordering, its all-reduces (ring algorithm), its all-to-alls (a split MoE layer's two each
    way, ``(n - 1) / n`` of its rows leaving) and its all-gather (reduce-scatter in backward), as
    ``cube.sim.program`` counts them (balanced)."""
    inside = call.inside
    if inside is None:
        return 0
    if way == "f":
        p2p, k, ar = inside.p2p, 1, inside.all_reduce
    else:
        p2p = inside.bw_p2p if inside.bw_p2p is not None else inside.recvs
        k, ar = 2, inside.all_reduce if inside.bw_all_reduce is None else inside.bw_all_reduce
    ring = _ring("all_reduce", len(inside.groups[0]), ar) if ar and inside.groups else 0
    a2a = 2 * _ring("all_to_all", len(inside.groups[0]), inside.all_to_all) if inside.all_to_all else 0
    gather = _ring("all_gather" if way == "f" else "reduce_scatter", len(inside.groups[0]), inside.all_gather) \
        if inside.all_gather else 0
    return sum(b for _, b in p2p) + sum(r[k] for r in inside.reorder) + ring + a2a + gather


def _ring(kind: str, n: int, nbytes: int) -> int:
    """Bytes one member sends in a ring collective over ``n`` ranks whose whole (unsplit) value
    is ``nbytes``."""
    return {"all_reduce": 2 * (n - 1) * nbytes // n, "all_gather": (n - 1) * nbytes // n,
            "reduce_scatter": (n - 1) * nbytes // n, "all_to_all": (n - 1) * nbytes // n}[kind]


def _nbytes(t, box=None) -> int:
    shape = t.shape if box is None else tuple(e - b for b, e in box)
    return math.prod(shape) * t.dtype.itemsize


def backward_bytes(call: Call) -> int:
    """Bytes this rank sends in backward for a step (the adjoint of its forward, as
    ``cube.sim.program`` times it); 0 for an op piece, a local step or a value without a gradient."""
    s = call.step
    if s is None and call.inside is not None:
        return _inside_bytes(call, "b") if any(t.requires_grad for t in call.op.outputs) else 0
    if s is None or not call.outputs or s.grad == "none" or not call.outputs[0].requires_grad:
        return 0
    out, n = call.outputs[0], len(s.ranks)
    if s.kind == "identity_all_reduce":
        return _ring("all_reduce", n, _nbytes(out))
    if s.kind == "all_gather":   # "V": the gradients are partial sums, reduce-scattered; "R": kept
        return _ring("reduce_scatter", n, _nbytes(out)) if s.grad == "V" else 0
    if s.kind in ("reduce_scatter", "chunk"):   # the gradient pieces are all-gathered
        return _ring("all_gather", n, n * _nbytes(out))
    if s.kind == "all_to_all":
        return _ring("all_to_all", n, _nbytes(out))
    if s.kind in ("recv", "grad_to"):   # the gradient goes back to the sender
        return _nbytes(out)
    if s.kind == "gather":
        me = s.ranks[0]
        return sum(_nbytes(out, place) * ((bool(back) and src != me) + len(links))
                   for src, _, _, place, back, links in s.takes)
    return 0


def step_bytes(plan: RankPlan) -> Dict[str, int]:
    """Bytes a rank sends in one step (one micro-batch of a pipeline plan): ``forward`` and
    ``backward`` (its steps), and ``gradients`` (the reducer's all-reduces of its parameter pieces
    after backward). Collectives a recompute run repeats in backward are not counted twice."""
    held = {id(t): b for t, b in plan.attrs}
    grads = sum(_ring("all_reduce", len(ranks), _nbytes(t, held.get(id(t)))) for t, ranks in plan.reduce)
    return {"forward": sum(sent_bytes(c) for c in plan.calls),
            "backward": sum(backward_bytes(c) for c in plan.calls), "gradients": grads}


def _call_line(call: Call) -> str:
    if call.step is not None:
        s = call.step
        what = _name(call.inputs[0]) if call.inputs else _name(call.outputs[0])
        extra = f" dim={s.dim}" if s.kind in ("all_gather", "reduce_scatter", "chunk", "narrow") else ""
        extra += f"->{s.dim2}" if s.kind == "all_to_all" else ""
        extra = f" dim={s.dim}{extra}" if s.kind == "all_to_all" else extra
        extra += f" box={s.box}" if s.kind in ("send", "recv", "region") and s.box else ""
        extra += " (gradient only)" if s.kind == "send" and s.grad == "only" else ""
        if s.kind == "gather":
            srcs = sorted({src for src, *_ in s.takes if src != s.ranks[0]})
            extra += f" box={s.box} from ranks {srcs}" + (" and itself" if any(
                src == s.ranks[0] for src, *_ in s.takes) else "")
        sent, back = sent_bytes(call), backward_bytes(call)
        extra += f"  sends {sent} B" if sent else ""
        extra += f"  sends {back} B in backward" if back else ""
        return f"{s.kind:<20} {what}  ranks={tuple(s.ranks)}{extra}"
    op, lay = call.op, call.layout
    ins = ", ".join(f"{_name(t)}{_box(b, t.shape)}" for t, b in zip(op.inputs, lay.inputs))
    outs = ", ".join(f"{_name(t)}{_box(b, t.shape)}" + (" (partial sum)" if term else "")
                     for t, b, term in zip(op.outputs, lay.outputs, lay.out_terms))
    where = f"  [{op.module_path}]" if op.module_path else ""
    inside = call.inside
    if inside is not None and inside.all_to_all:
        where += f"  {inside.fn} all-to-alls {inside.all_to_all} B of rows twice over {inside.groups[0]}"
    elif inside is not None and inside.all_gather:
        where += f"  {inside.fn} all-gathers {inside.all_gather} B over {inside.groups[0]}"
    elif inside is not None and (inside.p2p or inside.all_reduce):
        fn = inside.fn or "its op"
        where += f"  {fn} sends {sum(b for _, b in inside.p2p)} B" + "".join(
            f" to {peer}" for peer, _ in inside.p2p[:1] if len(inside.p2p) == 1)
        if inside.reorder:
            where += f" (+ {sum(b for _, b, _ in inside.reorder)} B reordering)"
        if inside.all_reduce:
            where += f", all-reduces {inside.all_reduce} B"
    return f"{op.name:<20} {ins} -> {outs}{where}"


def plan_text(program: Program) -> str:
    """Every rank's plan as text (see the module docstring)."""
    graph, plans, actions = program.graph, program.plans, program.actions
    out = [f"plan of {graph.name}: {len(plans)} ranks" + (f", ZeRO-{graph.zero}" if getattr(graph, "zero", 0) else "")
           + (f", {graph.precision}" if getattr(graph, "precision", None) else "")]
    lost = getattr(graph, "lost", [])
    out.append(f"splits the policy asked for that the plan does not keep: {len(lost) or 'none'}")
    out += [f"  - {r.describe()}" for r in lost]
    for r in sorted(plans):
        p = plans[r]
        out.append("")
        out.append(f"== rank {r}")
        out.append("batch: " + ", ".join(f"{_name(t)}{_box(b, t.shape)}" for t, b in zip(p.data.outputs, p.data_boxes)))
        params = [(t, b) for t, b in p.attrs if t.kind is TensorKind.PARAM]
        held = sum(math.prod(e - s for s, e in b) for _, b in params)
        out.append(f"parameters ({held} elements):")
        out += [f"  {t.names[0]}{_box(t.user_box(b), t.user_shape)}" for t, b in params]
        out.append("forward:")
        out += [f"  {i:>4}  {_call_line(c)}" for i, c in enumerate(p.calls)]
        sends = step_bytes(p)
        out.append(f"sends in forward: {sends['forward'] / 2**20:.3f} MiB")
        out.append(f"sends per step: forward {sends['forward']} B, backward {sends['backward']} B, "
                   f"gradient sums {sends['gradients']} B")
        if p.reduce:
            out.append("gradients summed after backward (reducer):")
            out += [f"  {t.names[0]} over {tuple(ranks)}" for t, ranks in p.reduce]
        if p.loss_sum:
            out.append(f"loss: partial, summed over {tuple(p.loss_sum)}")
        if actions and r in actions:
            out.append("schedule: " + " ".join(actions[r]))
    return "\n".join(out) + "\n"


def _svg(width: int, height: int, body: Sequence[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="monospace" font-size="11">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(body) + "\n</svg>\n")


def placement_svg(plans: Dict[int, RankPlan]) -> str:
    """One row per parameter, one column per rank: the rank's piece filled inside the full tensor."""
    tensors: Dict[str, tuple] = {}
    held: Dict[tuple, list] = {}
    for r, p in plans.items():
        for t, b in p.attrs:
            if t.kind is TensorKind.PARAM:
                tensors.setdefault(t.names[0], tuple(t.user_shape))
                held.setdefault((t.names[0], r), []).append(t.user_box(b))
    cell, label, pad = 60, 260, 8
    ranks = sorted(plans)
    body = [f'<text x="{pad}" y="16">parameter (full shape)</text>']
    body += [f'<text x="{label + i * (cell + pad)}" y="16">rank {r}</text>' for i, r in enumerate(ranks)]
    for row, (name, shape) in enumerate(tensors.items()):
        y = 28 + row * (cell // 2 + pad)
        body.append(f'<text x="{pad}" y="{y + 14}">{name} {list(shape)}</text>')
        rows = shape[0] if shape else 1
        cols = shape[1] if len(shape) > 1 else 1
        for i, r in enumerate(ranks):
            x = label + i * (cell + pad)
            body.append(f'<rect x="{x}" y="{y}" width="{cell}" height="{cell // 2}" fill="#eee" stroke="#999"/>')
            for b in held.get((name, r), []):
                (r0, r1) = b[0] if b else (0, 1)
                (c0, c1) = b[1] if len(b) > 1 else (0, 1)
                bx, bw = x + cell * c0 / cols, cell * (c1 - c0) / cols
                by, bh = y + (cell // 2) * r0 / rows, (cell // 2) * (r1 - r0) / rows
                body.append(f'<rect x="{bx:.1f}" y="{by:.1f}" width="{bw:.1f}" height="{bh:.1f}" '
                            f'fill="{COLORS[r % len(COLORS)]}"/>')
    height = 40 + len(tensors) * (cell // 2 + pad)
    return _svg(label + len(ranks) * (cell + pad) + pad, height, body)


def schedule_svg(schedule: Schedule) -> str:
    """The schedule as a rank x time chart: forward, backward (and weight-gradient) micro-steps, idle
    gaps blank."""
    times = validate(schedule)
    w, h, left, top = 34, 24, 60, 24
    virtual = schedule.nstages > schedule.nranks
    body = [f'<text x="4" y="14">{schedule.name}: {schedule.nstages} stages, {schedule.nmicros} micro-batches</text>']
    for r, acts in enumerate(schedule.ranks):
        y = top + r * (h + 4)
        body.append(f'<text x="4" y="{y + 16}">pipe {r}</text>')
        for a in acts:
            x = left + times[a] * w
            color = COLORS[a.micro % len(COLORS)]
            opacity = {"F": "1", "B": "0.55", "W": "0.3"}[a.kind]
            body.append(f'<rect x="{x}" y="{y}" width="{w - 2}" height="{h}" fill="{color}" '
                        f'fill-opacity="{opacity}"/><text x="{x + 4}" y="{y + 16}">{a.label(virtual)}</text>')
    steps = max(times.values()) + 1 if times else 0
    return _svg(left + steps * w + 10, top + schedule.nranks * (h + 4) + 10, body)


def write_report(program: Program, folder: Path) -> List[Path]:
    """Writes ``plan.txt``, ``placement.svg`` and (with a schedule) ``schedule.svg`` into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = {"plan.txt": plan_text(program), "placement.svg": placement_svg(program.plans)}
    if program.graph.schedule is not None:
        files["schedule.svg"] = schedule_svg(program.graph.schedule)
    paths = []
    for name, text in files.items():
        (folder / name).write_text(text)
        paths.append(folder / name)
    return paths
