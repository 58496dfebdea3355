"""The ``dim`` partition algorithm: which (input, dim) splits an op allows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from cube.ir import halo, query_blocks
from cube.ir.annotation import Ident
from cube.ir.ops import op_info


def _register_hint(op) -> str:
    return (f"register an annotation with cube.register_op(\"<annotation>\", name=...) on a "
            f"function that wraps this computation, or leave {op.name!r} replicated")


@dataclass
class DimSplit:
    """Splitting an op's tensors along one annotated dimension."""

    op: object

    def legal(self) -> List[Tuple[int, int]]:
        """All (input index, dim) pairs this op may be split on."""
        anno = self.op.anno
        if anno is None:
            return []
        inner = {i.name for g in anno.inputs + anno.outputs for d in g for i in d.idents[1:]}
        pairs = []
        for idx, group in enumerate(anno.inputs):
            for dim, d in enumerate(group):
                h = d.head
                if h is not None and not h.frozen and h.name not in inner:
                    pairs.append((idx, dim))
        return pairs

    def ident(self, idx: int, dim: int) -> Ident:
        """The annotated factor that splitting input ``idx`` at ``dim`` splits.

        Raises:
            ValueError: the split is not legal for this op.
        """
        op = self.op
        if op.anno is None:
            raise ValueError(
                f"op {op.name!r} ({op.where()}) cannot be partitioned: {op.anno_error or 'cube has no partition rule for it'}. "
                f"To split it, {_register_hint(op)}.")
        if (idx, dim) not in self.legal():
            ntens = len(op.inputs)
            why = (f"it has {ntens} tensor input(s)" if not 0 <= idx < ntens else
                   f"input {idx} has {op.inputs[idx].ndim} dim(s)" if not -op.inputs[idx].ndim <= dim < op.inputs[idx].ndim
                   else f"dim {dim} of input {idx} is '{op.anno.inputs[idx][dim]}' which may not be split")
            raise ValueError(
                f"illegal split of op {op.name!r} ({op.where()}) at idx={idx}, dim={dim}: {why}. "
                f"Annotation: '{op.anno}'. Legal (idx, dim) pairs: {self.legal() or 'none'}.")
        return op.anno.inputs[idx][dim].head

    def satisfy(self, idx: int, dim: int, num: int) -> bool:
        try:
            self.check(idx, dim, num)
        except ValueError:
            return False
        return True

    def check(self, idx: int, dim: int, num: int) -> Ident:
        """Validates a split; returns the factor it splits.

        Raises:
            ValueError: illegal (idx, dim), or ``num`` does not divide the dim.
        """
        op = self.op
        if not isinstance(num, int) or num < 1:
            raise ValueError(f"op {op.name!r} ({op.where()}): num must be a positive int, got {num!r}")
        ident = self.ident(idx, dim)
        size = self.size(ident)
        total = num
        for factor, _, n in op.splits:   # a piece of a piece splits what is left of the factor
            if factor == ident.name:
                size //= n
                total *= n
        if size % num != 0:
            raise ValueError(
                f"uneven split of op {op.name!r} ({op.where()}): '{ident.name}' has size {size}, "
                f"which {num} does not divide. Choose num among the divisors of {size}.")
        if ident.inside:
            self._check_inside(ident, total)
        if ident.inside and op_info(op.name).inside == "experts":   # the tokens split too (cube.ir.experts)
            from cube.ir.experts import TOKENS
            tokens = self.size(op.anno.ident(TOKENS))
            for factor, _, n in op.splits:
                tokens //= n
            if tokens % num:
                raise ValueError(
                    f"uneven split of op {op.name!r} ({op.where()}): expert parallel gives each of the {num} ranks "
                    f"of a group its block of the {tokens} tokens here, which {num} does not divide. Choose a batch "
                    f"(times sequence) divisible by the data parallel degree")
        return ident

    def _check_inside(self, ident: Ident, total: int) -> None:
        """A ``~`` factor: the op must say how its pieces communicate, and a halo must fit."""
        op = self.op
        kind = op_info(op.name).inside
        if kind is None:
            raise ValueError(
                f"illegal split of op {op.name!r} ({op.where()}): '{ident.name}' is marked '~' (its pieces must "
                f"communicate inside their call) but the op names no way to (OpInfo.inside). Leave the dim whole, "
                f"or give the op a kind of cube.passes.inside.KINDS with "
                f"cube.ir.ops.register({op.name!r}, inside=...).")
        if kind == "ring" and op.kwargs.get("is_causal", op.args[5] if len(op.args) > 5 else False):
            size = op.inputs[0].shape[-2]
            if size % (2 * total):
                raise ValueError(
                    f"uneven split of op {op.name!r} ({op.where()}): ring attention under a causal mask cuts "
                    f"each of the {total} sequence blocks into two chunks (zigzag load balancing), so the "
                    f"sequence length {size} must be divisible by {2 * total}. Choose a number of pieces n "
                    f"with 2 n dividing {size}, or pad the sequence.")
        if kind == "gather_kv":
            self._check_query_blocks(ident, total)
        if kind.startswith("halo"):   # halo, halo_transposed, halo_linear: windows must fit
            for d, dim in enumerate(op.anno.inputs[0]):
                if dim.head is not None and dim.head.name == ident.name:
                    halo.check(op, d, total)

    def _check_query_blocks(self, ident: Ident, total: int) -> None:
        """``flex_attention`` split along the sequence: each piece reads its rows of the block mask,
        so its block of queries must be whole query blocks of the mask or a part of one."""
        import json
        op = self.op
        spec = json.loads(op.args[1])
        if "kv_num_blocks" not in spec["given"]:
            return
        size, q_block = self.size(ident), spec["block_size"][0]
        if size % total or not query_blocks.aligned(size // total, q_block):
            raise ValueError(
                f"uneven split of op {op.name!r} ({op.where()}): context parallel gives each of the {total} "
                f"pieces {size / total:g} of the {size} queries, which is neither a multiple nor a divisor of "
                f"its block mask's query block size {q_block} (each piece reads whole rows of the block mask). "
                f"Choose a number of pieces n with {size} / n a multiple or a divisor of {q_block}, or build "
                f"the block mask with a BLOCK_SIZE that divides or is a multiple of {size} / n.")

    def size(self, ident: Ident) -> int:
        """The size of one annotated factor, read from the tensors that carry it."""
        op = self.op
        for tensors, groups in ((op.inputs, op.anno.inputs), (op.outputs, op.anno.outputs)):
            for t, g in zip(tensors, groups):
                for s, d in zip(t.shape, g):
                    if d.head is not None and d.head.name == ident.name:
                        if len(d.idents) == 1:
                            return s
        # only seen as a merge head: the outer factor of (h d ...) with all inner sizes known
        raise ValueError(f"op {op.name!r}: cannot tell the size of '{ident.name}' from its tensors")
