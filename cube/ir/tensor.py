"""IR tensors: the logical values that flow between operators.

An ``IRTensor`` is plain data: its shape, dtype, whether it needs a gradient and
what kind of value it is (a parameter, a buffer, a constant, a batch input or an
activation). Identity is by object; names are chosen only when code is printed.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch


class TensorKind(enum.Enum):
    PARAM = "param"
    BUFFER = "buffer"
    CONST = "const"
    DATA = "data"          # produced by the data operation (a batch from the dataloader)
    ACTIVATION = "activation"


@dataclass(eq=False)
class IRTensor:
    """A logical tensor of the traced model.

    Attributes:
        shape: static shape.
        dtype: element type.
        requires_grad: whether autograd tracks it in the single-device model.
        kind: what produced it (see ``TensorKind``).
        hint: a readable name hint (the fx node name); printing may uniquify it.
        names: for parameters and buffers, the user's dotted names (tied weights
            have several, the first is canonical).
        persistent: for buffers, whether the user's ``state_dict()`` holds it
            (False: registered with ``persistent=False``; the generated module
            registers it so too, and checkpoints leave it out).
        part_of: for a rank's local value made by communication (a received box, a gathered
            or summed copy), the logical tensor it holds a part of; None for a logical tensor.
        region: for a sub-parameter (``cube.trace.fused``: one block of a fused projection's
            weight), the box of the user's tensor ``names`` it stands for, ``(start, stop)`` per
            dim; None when it stands for the whole tensor.
        full: with ``region``, the shape of the user's tensor.
    """

    shape: Tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False
    kind: TensorKind = TensorKind.ACTIVATION
    hint: str = "t"
    names: Tuple[str, ...] = field(default=())
    persistent: bool = True
    part_of: Optional["IRTensor"] = field(default=None, repr=False)
    region: Optional[Tuple[Tuple[int, int], ...]] = None
    full: Optional[Tuple[int, ...]] = None

    @property
    def logical(self) -> "IRTensor":
        """The logical tensor this value is (a part of)."""
        return self.part_of if self.part_of is not None else self

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def name(self) -> Optional[str]:
        """The canonical user name of a parameter/buffer, else None."""
        return self.names[0] if self.names else None

    @property
    def user_shape(self) -> Tuple[int, ...]:
        """The shape of the user's tensor this one stands for (all of it, or a region of it)."""
        return self.full if self.region is not None else self.shape

    def user_box(self, box: Tuple[Tuple[int, int], ...]) -> Tuple[Tuple[int, int], ...]:
        """``box`` (a piece of this tensor) as a box of the user's tensor: the same box, or, for a
        sub-parameter, the box moved by its region's offsets."""
        if self.region is None:
            return tuple(box)
        return tuple((o + s, o + e) for (o, _), (s, e) in zip(self.region, box))

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def __repr__(self) -> str:
        shape = "x".join(str(s) for s in self.shape) or "scalar"
        label = self.name or self.hint
        if self.region is not None:   # a sub-parameter: the box of the user's tensor, "c_attn.weight[:, 0:32]"
            label += "[" + ", ".join(":" if (s, e) == (0, n) else f"{s}:{e}"
                                     for (s, e), n in zip(self.region, self.full)) + "]"
        return f"{label}:{shape}:{str(self.dtype).replace('torch.', '')}"
