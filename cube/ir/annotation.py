"""Einops-like partition annotations.

Grammar (one group per tensor input, ``->``, one group per tensor output)::

    "b s k+, n k+, n -> b s n"

- a plain letter names a dimension; splitting it splits every tensor that
  carries it;
- ``k+`` is a reduction dimension: splitting it leaves outputs that lack it as
  partial sums (value splits);
- ``k^`` may not be split;
- ``h~`` may be split, but a piece then reads more than its block (a convolution's
  halo) or needs statistics of the whole: it communicates inside its own call
  (``OpInfo.inside`` in ``cube.ir.ops`` names how, ``cube.passes.inside`` plans it);
  an output without ``h`` is then whole on every piece (a vocabulary-parallel
  loss or embedding lookup sums over the group inside its call);
- ``(h d)`` is one dimension that is a merge of ``h`` and ``d``; splitting it
  splits along ``h`` (the outer factor), so inner factors are never splittable;
- ``1`` is a size-1 dimension that is never split; an empty group is a scalar.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import List, Tuple

_TOKEN = re.compile(r"\(|\)|[A-Za-z_][A-Za-z0-9_]*[+^~]?|1|\S")


@dataclass(frozen=True)
class Ident:
    """One named factor of a dimension."""

    name: str
    reduce: bool = False   # '+'
    frozen: bool = False   # '^'
    inside: bool = False   # '~': a piece split along it communicates inside its call

    def __str__(self) -> str:
        return self.name + ("+" if self.reduce else "") + ("^" if self.frozen else "") + ("~" if self.inside else "")

    @property
    def marked(self) -> bool:
        return self.reduce or self.frozen or self.inside


@dataclass(frozen=True)
class Dim:
    """One tensor dimension: a tuple of factors (more than one for ``(h d)``)."""

    idents: Tuple[Ident, ...]

    @property
    def head(self) -> Ident | None:
        return self.idents[0] if self.idents else None

    def __str__(self) -> str:
        if not self.idents:
            return "1"
        if len(self.idents) == 1:
            return str(self.idents[0])
        return "(" + " ".join(str(i) for i in self.idents) + ")"


ONE = Dim(())


@dataclass(frozen=True)
class OpAnno:
    """A parsed annotation: per tensor input and output, its dimensions."""

    inputs: Tuple[Tuple[Dim, ...], ...]
    outputs: Tuple[Tuple[Dim, ...], ...]

    def __str__(self) -> str:
        def group(g):
            return " ".join(str(d) for d in g)
        return ", ".join(group(g) for g in self.inputs) + " -> " + ", ".join(
            group(g) for g in self.outputs)

    def ident(self, name: str) -> Ident:
        for g in self.inputs + self.outputs:
            for d in g:
                for i in d.idents:
                    if i.name == name:
                        return i
        raise KeyError(name)


def _parse_group(text: str, where: str) -> Tuple[Dim, ...]:
    tokens = _TOKEN.findall(text)
    dims: List[Dim] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "(":
            j = tokens.index(")", i) if ")" in tokens[i:] else -1
            if j < 0:
                raise ValueError(f"annotation {where!r}: unclosed '('")
            inner = tokens[i + 1:j]
            if not inner or any(t in ("(", "1") for t in inner):
                raise ValueError(f"annotation {where!r}: bad merged dimension {' '.join(inner)!r}")
            dims.append(Dim(tuple(_ident(t, where) for t in inner)))
            i = j + 1
        elif tok == "1":
            dims.append(ONE)
            i += 1
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*[+^~]?", tok):
            dims.append(Dim((_ident(tok, where),)))
            i += 1
        else:
            raise ValueError(f"annotation {where!r}: unexpected {tok!r}")
    return tuple(dims)


def _ident(tok: str, where: str) -> Ident:
    if tok.endswith("+"):
        return Ident(tok[:-1], reduce=True)
    if tok.endswith("^"):
        return Ident(tok[:-1], frozen=True)
    if tok.endswith("~"):
        return Ident(tok[:-1], inside=True)
    return Ident(tok)


@functools.lru_cache(maxsize=4096)
def parse(text: str, ninputs: int | None = None) -> OpAnno:
    """Parses an annotation string (cached: annotations are immutable, and a
    model repeats a few texts over thousands of ops).

    Args:
        text: the annotation.
        ninputs: the op's number of tensor inputs, when known: a blank left side
            then means that many scalar inputs rather than none.

    Raises:
        ValueError: on malformed text or inconsistent flags of one letter.
    """
    if text.count("->") != 1:
        raise ValueError(f"annotation {text!r}: needs exactly one '->'")
    lhs, rhs = text.split("->")
    if lhs.strip() or (ninputs is not None and ninputs > 0 and lhs.count(",") == ninputs - 1):
        inputs = tuple(_parse_group(g, text) for g in lhs.split(","))
    else:
        inputs = ()
    outputs = tuple(_parse_group(g, text) for g in rhs.split(","))
    seen = {}
    for g in inputs + outputs:
        for d in g:
            for ident in d.idents:
                prev = seen.setdefault(ident.name, ident)
                if prev != ident:
                    # an output may omit '+' / '^' / '~' marks given on the inputs
                    if ident.marked and prev.marked:
                        raise ValueError(f"annotation {text!r}: {ident.name!r} has conflicting marks")
                    if not prev.marked:
                        seen[ident.name] = ident
    # normalise: every occurrence carries the strongest marks of its letter
    def norm(g):
        return tuple(Dim(tuple(seen[i.name] for i in d.idents)) for d in g)
    return OpAnno(tuple(norm(g) for g in inputs), tuple(norm(g) for g in outputs))
