"""The end of a rank's step: gradient buckets, their reduction, ZeRO and the optimizer.

A mixin of ``cube.sim.program.Builder``: buckets launch (asynchronously, on the
communication stream) once every gradient in them is made, in the reducer's
order; ``reduce_gradients`` waits for them as ``Reducer.finish`` does (launching
the rest one by one); the optimizer steps this rank's parameters (ZeRO: its
chunks), then ZeRO-1/2 gather the updated chunks back.
"""
from __future__ import annotations

from typing import Dict

import torch

from cube.ir.tensor import TensorKind

ADAM_STATE_BYTES = 2 * 4   # per trainable element: AdamW's two float32 moments
MAIN_PARAM_BYTES = 4       # per trainable element: its float32 main parameter (precision="bf16")


class StepEnd:
    """Gradient reduction and the optimizer step (needs the ``Builder`` state)."""

    def launch_ready(self, i: int) -> None:
        """After backward of call ``i``: launches the next buckets whose gradients are all made."""
        for idx, b in enumerate(self.buckets):
            if idx in self.launched:
                continue
            if any(self.first_read.get(id(t), -1) < i for t in b.params):
                return
            self.launch_bucket(idx)

    def launch_bucket(self, idx: int) -> None:
        b = self.buckets[idx]
        self.compute(self.costs.copy_cost(b.nbytes), "flatten bucket", "backward")
        kind = "reduce_scatter" if self.backend == "nccl" and self.zero >= 2 and b in self.sharded else "all_reduce"
        self.launched[idx] = self.coll(kind, b.ranks, b.padded * b.itemsize, "bucket", blocking=False)
        self.mem.add("comm", b.nbytes)
        self.settle()

    def reduce_gradients(self) -> None:
        for idx, b in enumerate(self.buckets):
            if idx not in self.launched:
                self.launch_bucket(idx)
            self.wait(self.launched[idx], "bucket wait")
            for t in b.params:   # the sums replace the gradients (views of the bucket)
                self.mem.release(("pg", id(t)), "grads")
            self.mem.add("comm", -b.nbytes)
            if b in self.sharded and self.zero >= 2:
                self.compute(self.costs.copy_cost(b.chunk * b.itemsize), "take chunk", "backward")
                self.mem.add("grads", b.chunk * b.itemsize)
            else:
                self.mem.add("grads", b.nbytes)
            self.settle()
        if self.zero == 3:
            for idx, b in enumerate(self.sharded):
                self.mem.add("params", -(b.padded - b.chunk) * b.itemsize)
            self.gathers = {}
            self.settle()

    def optimizer(self) -> None:
        trainable = [t for t, _ in self.plan.attrs if t.kind is TensorKind.PARAM and t.requires_grad]
        in_shard = {id(t) for b in self.sharded for t in b.params}
        numels = [b.chunk for b in self.sharded] + \
            [self.attr_bytes[id(t)] // t.dtype.itemsize for t in trainable if id(t) not in in_shard]
        self.compute(self.costs.optimizer_cost(numels), "optimizer step", "optimizer")
        work = self.costs.optimizer_workspace(numels)   # its temporaries, while it runs
        self.mem.add("optimizer", work)
        self.settle()
        self.mem.add("optimizer", -work)
        if self.zero in (1, 2):
            keys = [self.coll("all_gather", b.ranks, b.padded * b.itemsize, "zero", blocking=False)
                    for b in self.sharded]
            for key in keys:
                self.wait(key, "zero gather")
        self.compute(0.0, "zero_grad", "optimizer")
        self.mem.release_all("grads")
        self.mem.add("grads", -sum((b.chunk * b.itemsize if b in self.sharded and self.zero >= 2 else b.nbytes)
                                   for b in self.buckets))
        self.settle()

    # ------------------------------------------------------------------ the step
    def base(self) -> Dict[str, int]:
        """Memory at the start of the step: parameters (ZeRO-3: chunks) and optimizer state."""
        params = sum(self.attr_bytes.values())
        trainable = sum(self.attr_bytes[id(t)] // t.dtype.itemsize for t, _ in self.plan.attrs
                        if t.kind is TensorKind.PARAM and t.requires_grad)
        if getattr(self, "main", False):   # low-precision weights; float32 main parameters with the state
            params -= sum(self.attr_bytes[id(t)] // 2 for t, _ in self.plan.attrs
                          if t.kind is TensorKind.PARAM and t.requires_grad and t.dtype == torch.float32)
        for b in self.sharded:
            trainable -= b.numel - b.chunk
            if self.zero == 3:
                # main recipe: the chunk is a float32 main parameter (with the state), no weight at rest
                params -= b.nbytes // 2 if getattr(self, "main", False) else b.nbytes - b.chunk * b.itemsize
        state = ADAM_STATE_BYTES + (MAIN_PARAM_BYTES if getattr(self, "main", False) else 0)
        return {"params": params, "optimizer": state * trainable}

