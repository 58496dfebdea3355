"""IR operators: one call of an ATen op (or a registered user op) in the model."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from cube.ir.annotation import OpAnno
from cube.ir.tensor import IRTensor


@dataclass(eq=False)
class IROperator:
    """Base of everything a graph holds.

    Attributes:
        name: the op name a policy selects on (``linear``, ``view``, ...).
        inputs: tensor inputs in call order.
        outputs: tensor outputs in order.
        device: devices this piece runs on (set by ``graph.assign``); None if unassigned.
    """

    name: str
    inputs: List[IRTensor] = field(default_factory=list)
    outputs: List[IRTensor] = field(default_factory=list)
    device: Optional[Tuple[int, ...]] = None
    # set on pieces made by graph.partition / graph.replicate:
    origin: Optional["IROperator"] = None        # the op this piece was cut from
    splits: Tuple[Tuple[str, int, int], ...] = ()   # (factor, index, num) of each partition, outer first
    replicas: Tuple[Tuple[int, int], ...] = ()      # (index, times) of each replicate, outer first

    @property
    def root(self) -> "IROperator":
        """The op of the traced model this piece was cut from (``origin``), or the op itself."""
        return self.origin or self

    @property
    def split(self) -> Optional[Tuple[str, int, int]]:
        """The innermost partition that made this piece, or None."""
        return self.splits[-1] if self.splits else None

    @property
    def replica(self) -> Optional[Tuple[int, int]]:
        """The innermost replicate that made this piece, or None."""
        return self.replicas[-1] if self.replicas else None

    def input(self, i: int) -> IRTensor:
        return self.inputs[i]

    def output(self, i: int) -> IRTensor:
        return self.outputs[i]


@dataclass(eq=False)
class IRDataOperation(IROperator):
    """The dataloader: produces the batch tensors of one step.

    Attributes:
        structure: "tuple" when a batch is a tuple/list of tensors, "tensor" when
            it is one tensor.
    """

    name: str = "dataloader"
    structure: str = "tuple"

    def __repr__(self) -> str:
        return f"DataOp(outputs={self.outputs}, device={self.device})"


@dataclass(eq=False)
class IRFwOperation(IROperator):
    """A forward operator.

    Attributes:
        target: what runs (an ``OpOverload`` such as ``aten.linear.default``).
        args, kwargs: the call's arguments; tensors are ``IRTensor`` objects,
            anything else is a Python constant (ints, lists, dtypes, devices).
        anno: the partition annotation, or None when cube has no rule for it.
        anno_error: why there is no annotation (shown when a policy tries a split).
        module_path: dotted path of the nn.Module that called it ("" at top level).
        source: ``(file, line, code)`` of the model line that made it, if known.
        grad_enabled: False for ops the model ran under ``torch.no_grad()``.
    """

    target: Any = None
    args: Tuple[Any, ...] = ()
    kwargs: dict = field(default_factory=dict)
    anno: Optional[OpAnno] = None
    anno_error: str = ""
    module_path: str = ""
    source: Optional[Tuple[str, int, str]] = None
    grad_enabled: bool = True
    recompute: Optional[int] = None

    def where(self) -> str:
        """A one-line description of where in the model this op came from."""
        parts = [f"module {self.module_path!r}" if self.module_path else "the top-level module"]
        if self.source:
            f, line, code = self.source
            parts.append(f"{f}:{line}: {code}")
        return ", ".join(parts)

    def algorithms(self, tag: str = "dim"):
        """Returns the partition algorithm of this op (``"dim"``: split along annotated dims)."""
        from cube.ir.partition import DimSplit
        if tag != "dim":
            raise ValueError(f"op {self.name!r}: unknown partition algorithm {tag!r}; use 'dim'")
        return DimSplit(self)

    def __repr__(self) -> str:
        dev = "" if self.device is None else f" @{list(self.device)}"
        ins = ", ".join(repr(t) for t in self.inputs)
        return f"{self.name}({ins}){dev}"
