"""Splits a policy asked for that the plan does not keep: no silent loss of parallelism.

A policy that places ops with a flow of ``cube.toolkit`` (``data_parallel``,
``tensor_parallel``, ...) asks for a split of every op the flow reaches. An op
that cannot carry it (no partition rule, a dim its rule keeps whole, a size the
pieces do not divide) runs whole instead: the plan gathers its split inputs (an
all-gather in forward, its adjoint in backward), or, for a linear whose column
split stops at such an op, keeps the linear and its weights whole on every
device. A flow that splits nothing at all (tensor parallel on a model without
column/row linear pairs) leaves every op whole.

``cube.toolkit.place`` records each such op on the graph as a ``LostSplit``
(``graph.lost``) while the policy runs; ``cube.compile`` logs one line per
record, ``cube.compile(..., strict=True)`` makes them one error
(``LostSplitError``), and ``cube.explain`` lists them in ``plan.txt``.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import List, Optional, Sequence, Tuple

from cube.ir.operator import IRFwOperation
from cube.ir.tensor import TensorKind

# the kinds of record
GATHER = "gather"     # the op runs whole on its split inputs, gathered whole for it
WHOLE = "whole"       # the op (a linear) runs whole on a whole input: nothing is gathered
NOTHING = "nothing"   # the flow splits no op at all


@dataclass(frozen=True)
class LostSplit:
    """One split a policy asked for that the plan does not keep.

    Attributes:
        kind: ``"gather"``, ``"whole"`` or ``"nothing"`` (see the module docstring).
        what: the split lost: ``"data parallel"``, ``"tensor parallel"``, ``"sequence parallel"``,
            ``"context parallel"`` (``""`` for a flow that splits nothing).
        over: the mesh dimensions it was asked over, ``(("dp", 2),)``.
        op: the op's name (``""`` for a flow that splits nothing).
        where: where the op is in the model (``IRFwOperation.where()``: module, file:line, code).
        why: why the op cannot carry the split; for ``"nothing"``, what the flow found.
        forward: bytes per step of the tensors gathered whole for the op in forward (a pipeline
            step: per micro-batch times the micro-batches); 0 when nothing is gathered.
        backward: bytes per step of their gradients, as many again in backward when a gradient
            flows through the op (each device sends ``(n - 1) / n`` of both, ring algorithms).
        held: bytes of the op's parameters every device holds whole (a linear kept whole).
        node: the op itself, in the process that planned (None once read back from a cache).
    """

    kind: str
    what: str
    over: Tuple[Tuple[str, int], ...]
    op: str = ""
    where: str = ""
    why: str = ""
    forward: int = 0
    backward: int = 0
    held: int = 0
    node: Optional[IRFwOperation] = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes per step the loss gathers: forward plus backward."""
        return self.forward + self.backward

    @property
    def degree(self) -> str:
        """``"dp=2"``, or ``"edp=2 x ep=2"`` over several mesh dimensions."""
        return " x ".join(f"{name}={n}" for name, n in self.over)

    def describe(self) -> str:
        """One line: the op, its model line, what it costs and why (no policy name)."""
        if self.kind == NOTHING:
            return self.why
        if self.kind == GATHER:
            cost = (f"runs whole on its inputs gathered, {self.nbytes} B per step ({self.forward} B gathered in "
                    f"forward, {self.backward} B of gradients in backward)")
        else:
            cost = f"runs whole, its {self.held} B of parameters on every device (nothing gathered)"
        return f"{self.what} over {self.degree} lost at op '{self.op}' ({self.where}): it {cost}; {self.why}"

    def to_dict(self) -> dict:
        """Plain data (``node`` left out), for the code cache."""
        d = asdict(replace(self, node=None))
        del d["node"]
        d["over"] = [list(o) for o in self.over]
        return d

    @staticmethod
    def from_dict(d: dict) -> "LostSplit":
        """The record ``to_dict`` wrote."""
        return LostSplit(**{**d, "over": tuple((str(k), int(n)) for k, n in d["over"])})


def _nbytes(t) -> int:
    return t.numel() * t.dtype.itemsize


def note(graph, loss, name: str, n: int) -> None:
    """Records on ``graph`` that ``loss`` (a ``cube.ir.follow.Loss``) is lost over mesh dimension
    ``name`` of ``n`` devices; the same op lost over another dimension joins its record."""
    for i, r in enumerate(graph.lost):
        if r.node is loss.op and r.what == loss.what:
            if name not in dict(r.over):
                graph.lost[i] = replace(r, over=r.over + ((name, n),))
            return
    op = loss.op
    grads = any(o.requires_grad for o in op.outputs)
    forward = sum(_nbytes(t) for t in loss.gathered)
    backward = sum(_nbytes(t) for t in loss.gathered if grads and t.requires_grad)
    held = sum(_nbytes(w) for w in loss.weights or [t for t in op.inputs if t.kind is TensorKind.PARAM])
    graph.lost.append(LostSplit(GATHER if loss.gathered else WHOLE, loss.what, ((name, n),), op.name, op.where(),
                                loss.why, forward, backward, held, op))


def note_nothing(graph, found: str, name: str, n: int, alone: bool) -> None:
    """Records on ``graph`` that a flow over mesh dimension ``name`` of ``n`` devices splits nothing
    (``found``: what it found, ``"no linear pairs found to split"``); ``alone``: the mesh has no
    other dimension of more than one device."""
    where = "every device" if alone else f"each of the {n} devices of a {name} group"
    why = f"{found} over {name}={n}; every op runs whole on {where}"
    if not any(r.kind == NOTHING and r.why == why for r in graph.lost):
        graph.lost.append(LostSplit(NOTHING, "", ((name, n),), why=why))


def per_step(records: Sequence[LostSplit], runs: int) -> List[LostSplit]:
    """``records`` of a graph whose step runs it ``runs`` times (a pipeline's micro-batches)."""
    return [replace(r, forward=r.forward * runs, backward=r.backward * runs) for r in records]


def lines(records: Sequence[LostSplit], policy: str) -> List[str]:
    """One log line per record, named after the policy."""
    return [f"{policy}: {r.describe()}" for r in records]


class LostSplitError(ValueError):
    """``strict=True`` and the plan does not keep every split its policy asked for."""


def error(records: Sequence[LostSplit], policy: str) -> LostSplitError:
    """The ``strict=True`` error listing every record with the fix."""
    items = "\n".join(f"  - {r.describe()}" for r in records)
    fixes = []
    if any(r.kind != NOTHING for r in records):
        fixes.append("give each op named a partition rule that splits the dim: wrap its model line in a function "
                     "and register it with cube.register_op(\"<annotation>\", name=...), or change the policy "
                     "(or that model line) so the split is not asked for there")
    empty = sorted({name for r in records if r.kind == NOTHING for name, _ in r.over})
    if empty:
        fixes.append("plan this model with a policy that splits what it has (PASData splits any model's batch), "
                     "or with " + " and ".join(f"{name}=1" for name in empty))
    return LostSplitError(f"policy {policy} asks for {len(records)} split(s) the plan cannot keep (strict=True):\n"
                          f"{items}\nFix: " + "; ".join(fixes) + ". Without strict=True the plan runs these ops "
                          "whole and logs one line for each.")


def dumps(records: Sequence[LostSplit]) -> str:
    """``records`` as JSON (kept with a plan's cached code)."""
    return json.dumps([r.to_dict() for r in records], indent=1)


def loads(text: str, source: str = "the cached record of lost splits") -> List[LostSplit]:
    """The records ``dumps`` wrote.

    Raises:
        ValueError: ``text`` is not what ``dumps`` writes (the message names ``source``).
    """
    try:
        return [LostSplit.from_dict(d) for d in json.loads(text)]
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"cube: {source} is unreadable ({e}); delete it (or compile with use_cache=False) to "
                         f"plan again") from None
