"""Per-rank programs: what each rank does in one training step, as instructions for the engine.

A rank's program follows its generated code: the forward calls of its
``cube.passes.program.RankProgram`` (the calls, stages and recompute runs the
generated code prints), then backward in reverse
order, with each communication step replaced by its adjoint (all-gather <->
reduce-scatter, identity <-> all-reduce, send <-> receive); under a pipeline
schedule, one forward or backward per action and micro-batch (of one stage,
on a rank holding several: the segment of that stage). Gradient
buckets launch on the communication stream as soon as their last gradient is
made (not during a schedule: the reducer is held until the end), the step
waits for them, then the optimizer steps (with ZeRO's gathers). Memory changes
are attached to the instructions that cause them (``cube.sim.memory``); the
instructions are those of ``cube.sim.instructions``. Under a schedule, an action a
micro-batch reaches after the same actions as an earlier one is replayed from it
(``cube.sim.replay``). Under mixed precision activations take the dtypes autocast
gives them and low-precision ops hold cast copies of their weights
(``cube.sim.precision``); a float8 linear piece whose scales its op's pieces share
(``Call.amax_ranks``) all-reduces its amaxes before its product, forward and backward.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Dict, Hashable, List, Optional

import torch

from cube.ir.graph import IRGraph
from cube.ir.layout import box_shape
from cube.ir.tensor import IRTensor, TensorKind
from cube.passes.adapter import P2P_KINDS
from cube.passes.rank_plans import Call
from cube.passes.program import DEFERRABLE, RankProgram, last_uses
from cube.runtime.amp import DTYPES
from cube.runtime.pipeline import parse_action
from cube.sim.buckets import make_buckets
from cube.sim.costs import needs_grad
from cube.sim.instructions import COLLECTIVES, Ins, Program, Writer, nbytes_of
from cube.sim.memory import MemTracker
from cube.runtime.amp import main_params
from cube.sim.precision import autocast_dtypes, casts_weights
from cube.sim.replay import MicroState, Replays
from cube.sim.step_end import StepEnd

__all__ = ["Builder", "Ins", "Program", "COLLECTIVES", "ACCUMULATE"]

ACCUMULATE = "grad accumulate"   # the label of a gradient added to the one a parameter holds


class Builder(Writer, StepEnd):
    """Builds one rank's program; see the module docstring.

    Args:
        graph: the placed graph.
        program: this rank's program (its plan, segments and pipeline actions).
        costs: the compute cost model (``op_cost``, ``optimizer_cost``, ``copy_cost``).
        comm: the communication model (``cost(kind, nbytes, n)``).
        zero: the ZeRO stage (0-3).
        dtypes: ``autocast_dtypes(graph, graph.precision)`` when already known (every rank's
            builder shares it).
    """

    def __init__(self, graph: IRGraph, program: RankProgram, costs, comm, zero: int = 0,
                 dtypes: Optional[Dict[int, torch.dtype]] = None):
        super().__init__(costs, comm)
        plan = program.plan
        self.graph, self.plan, self.zero = graph, plan, zero
        self._memo: dict = {}   # per op piece: what every micro-batch asks again (keyed by id; calls live on)
        self._statics: Dict[int, tuple] = {}   # call index -> what its forward does (_fw_static)
        self.actions = actions = program.actions
        self.backend = getattr(comm, "backend", "gloo")
        self.moe_imbalance = float(getattr(costs, "moe_imbalance", 1.0))   # a split MoE layer's busiest rank
        self.buckets = make_buckets(graph, plan, getattr(comm, "group_size", None))
        self.attrs = {id(t): t for t, _ in plan.attrs}
        self.attr_bytes = {id(t): nbytes_of(box_shape(b), t.dtype) for t, b in plan.attrs}
        self.calls: List[Call] = []
        self.spans: Dict[Optional[int], range] = {}   # stage (None: the only one) -> its calls in self.calls
        self.runs = []
        self._lay_out(program)
        self.run_of = {i: r for r in self.runs for i in range(r.start, r.stop)}
        self.last_use = last_uses(self.calls, plan.loss)
        self.first_read: Dict[int, int] = {}
        for i, call in enumerate(self.calls):
            for t in call.inputs:
                self.first_read.setdefault(id(t), i)
        self.sharded = [b for b in self.buckets if zero >= 1 and len(b.ranks) > 1]
        self.shard_of = {id(t): b for b in self.sharded for t in b.params}
        self.tag = ""                   # "re" while a run is recomputed in backward
        self.re_made: set = set()       # ids of the values a recompute made again
        self.re_values: List[IRTensor] = []
        self.launched: Dict[int, Hashable] = {}   # bucket index -> comm item
        self.gathers: Dict[int, Hashable] = {}    # ZeRO-3 shard index -> comm item
        self.held = actions is not None
        self.micros: Dict[int, MicroState] = {}   # micro-batch -> its values' memory and deferred work
        precision = getattr(graph, "precision", None)
        if dtypes is None:
            dtypes = autocast_dtypes(graph, precision)
        self.dtypes = dtypes   # activation id -> dtype under autocast
        # autocast's copies of float32 weights (none when the weights are low precision themselves)
        self.cast_itemsize = DTYPES[precision].itemsize if precision and not main_params(precision) else 0
        self.main = main_params(precision)   # low-precision weights, float32 main parameters in the optimizer
        self.replays = Replays(self)
        self.grads_made: set = set()   # (micro-batch, value key) that got a gradient in backward
        self.price_casts = getattr(costs, "price_casts", True)   # autocast's weight casts cost time

    def _lay_out(self, program: RankProgram) -> None:
        """The calls of each segment (each stage this rank holds, or its only forward) one after
        the other, as the generated code runs them, with their recompute runs."""
        for seg in program.segments:
            start = len(self.calls)
            for run in seg.runs:
                self.runs.append(replace(run, start=run.start + start, stop=run.stop + start))
            self.calls += seg.calls
            self.spans[seg.stage] = range(start, len(self.calls))

    # ------------------------------------------------------------------ values
    def vkey(self, t: IRTensor):
        """The key of value ``t`` in its micro-batch's memory (recomputed values apart)."""
        return id(t), self.tag if id(t) in self.re_made else ""

    def state(self, micro: int) -> MicroState:
        """Micro-batch ``micro``'s state, its own (a replayed action leaves a shared one)."""
        st = self.micros.get(micro)
        if st is None:
            st = self.micros[micro] = MicroState(MemTracker(self.mem.pending))
        elif st.shared:
            st = self.micros[micro] = st.copy()
        return st

    @staticmethod
    def input_value(call: Call, k: int) -> IRTensor:
        t = call.op.inputs[k]
        return call.subst.get(id(t), t)

    def is_attr(self, t: IRTensor) -> bool:
        return id(t) in self.attrs

    def dtype_of(self, t: IRTensor):
        """The dtype ``t`` (a logical tensor or a part of one) has when the rank runs (autocast's)."""
        return self.dtypes.get(id(t.logical), t.dtype)

    # ------------------------------------------------------------------ forward
    def forward(self, micro: int, stage: Optional[int] = None, cat: str = "forward") -> None:
        if self.zero == 3 and not self.gathers and self.sharded:
            for idx in reversed(range(len(self.sharded))):   # zero_begin: every bucket, forward order
                b = self.sharded[idx]
                self.gathers[idx] = self.coll("all_gather", b.ranks, b.padded * b.itemsize, "zero", blocking=False)
                self.mem.add("params", (b.padded - b.chunk) * b.itemsize)
                self.settle()
        mem = self.state(micro).mem
        for t in self.plan.data.outputs:
            mem.alloc(self.vkey(t), nbytes_of(t.shape, t.dtype))
        waited = set()
        for i in self.spans[stage]:
            call = self.calls[i]
            run = self.run_of.get(i)
            if run is not None and i == run.start:
                for t in run.inputs:
                    mem.hold(self.vkey(t), ("ckpt", run.start))
            if self.zero == 3:
                for t in call.inputs:
                    b = self.shard_of.get(id(t))
                    if b is not None and id(b) not in waited:
                        waited.add(id(b))
                        self.wait(self.gathers.get(self.sharded.index(b)), "zero_wait")
            self.fw_call(i, call, micro, cat, keep_saved=run is None)
            for t in self.last_use.get(i, []):
                if not self.is_attr(t):
                    mem.release(self.vkey(t))
            self.settle()
        mem.release_all(("autocast", ""))   # the forward call's cast cache goes
        self.settle()

    def fw_call(self, i: int, call: Call, micro: int, cat: str, keep_saved: bool) -> None:
        if call.op is None:
            self.fw_step(call, micro, cat)
            return
        label, fw, outs, saved = self._fw_static(i, call)
        mem, tag = self.micros[micro].mem, self.tag
        casts = self._casts(call) if self.cast_itemsize else ()
        if casts and self.price_casts:   # autocast's copies this forward call has not made yet: one kernel each
            cast = sum(self._cast_seconds(vid, nbytes) for vid, nbytes in casts if not mem.alive(("cast", vid, tag)))
            if cast:
                self.compute(cast, "autocast cast", cat, host=False)
        if len(call.amax_ranks) > 1:   # a float8 piece's two amaxes, maxed over the pieces of its op
            self.coll("all_reduce", call.amax_ranks, 8, cat)
        if call.inside is not None:
            self.inside_comm(call, micro, cat, "f", fw)
        else:
            self.compute(fw, label, cat)
        if tag:
            made = self.re_made
            for o, _, _ in outs:
                made.add(id(o))
                self.re_values.append(o)

            def key(vid):
                return vid, tag if vid in made else ""
        else:
            def key(vid):
                return vid, ""
        for o, base, nbytes in outs:
            if base is not None:
                mem.alias(key(id(o)), key(base))
            elif nbytes is not None:
                mem.alloc(key(id(o)), nbytes)
        holder = ("saved", i, tag)
        if casts:
            self.cast_weights(mem, casts, holder if keep_saved and self._needs_grad(call) else None)
        if not keep_saved:
            return
        for n, vid, nbytes in saved:
            if vid is not None:
                mem.hold(key(vid), holder)
            else:
                mem.alloc(("x", i, tag, n), nbytes, holder=holder)

    def _fw_static(self, i: int, call: Call) -> tuple:
        """What the forward of op piece ``i`` does every time it runs: its label, seconds, outputs
        (each: the tensor, the id of the input value it is a view of or None, and the bytes it
        allocates, None when it is a view of a parameter) and what autograd saves (each: its
        index, the id of the value held or None, and the bytes of a tensor of its own)."""
        got = self._statics.get(i)
        if got is not None:
            return got
        op = call.op
        cost = self.costs.op_cost(call)
        outs = []
        for j, o in enumerate(op.outputs):
            k = cost.alias[j] if j < len(cost.alias) else -1
            if k >= 0:
                v = self.input_value(call, k)
                outs.append((o, None, None) if self.is_attr(v) else (o, id(v), None))
            else:
                outs.append((o, None, self._out_bytes(call, j)))
        saved = []
        for n, (what, arg) in enumerate(cost.saved):
            if what == "in":
                v = self.input_value(call, arg)
                if not self.is_attr(v):
                    saved.append((n, id(v), 0))
            elif what == "out" and arg < len(op.outputs):
                saved.append((n, id(op.outputs[arg]), 0))
            elif what == "x":
                saved.append((n, None, arg))
        got = self._statics[i] = (_label(op), cost.fw, tuple(outs), tuple(saved))
        return got

    def cast_weights(self, mem: MemTracker, casts: tuple, saved) -> None:
        """Autocast's low-precision copy of each float32 parameter piece the call reads (``casts``:
        ``_casts``), in the micro-batch's tracker ``mem``: made once per forward call (its cache,
        holder ``("autocast", tag)``), held until the call returns and, by ``saved``, until the op's
        backward. Only the micro-batch's own memory changes, so a replayed action repeats it."""
        tag = self.tag
        cache = ("autocast", tag)
        for vid, nbytes in casts:
            key = ("cast", vid, tag)
            if not mem.alive(key):
                mem.alloc(key, nbytes, holder=cache)
            if saved is not None:
                mem.hold(key, saved)

    def _cast_seconds(self, vid: int, nbytes: int) -> float:
        """Seconds of one elementwise kernel reading the float32 parameter piece ``vid`` and writing its
        ``nbytes`` copy (or, in backward, the reverse): memory bound (``copy_cost(n)`` moves ``2 n``)."""
        return self.costs.copy_cost((self.attr_bytes[vid] + nbytes) // 2)

    def param_grad_seconds(self, call: Call) -> tuple:
        """``(cast, accumulate)``: seconds a backward spends on the gradients of the parameters ``call``
        reads beyond the op's own backward (which makes them in the op's dtype):

        - ``cast``: the backward of autocast's cast of a float32 weight (``ToCopyBackward``) turns
          its low-precision gradient back into float32, one kernel as large as the forward's cast;
        - ``accumulate``: a parameter that already has a gradient (every micro-batch after the
          first of the step, or a second reader) gets the new one added in place by autograd's
          ``AccumulateGrad`` (``grad += new``: two reads and a write of the parameter's size);
          the first gradient is taken as it is, without a copy.

        Megatron-LM (2021) pays the accumulation every micro-batch too, in its data-parallel
        wrapper's hook ``param.main_grad.add_(param.grad.data)`` (megatron/model/distributed.py).
        Ask before ``grad_flow`` makes the call's gradients."""
        reads = [v for v in self._grad_reads(call) if id(v) in self.attrs and v.kind is TensorKind.PARAM]
        if not reads:
            return 0.0, 0.0
        casts = dict(self._casts(call)) if self.cast_itemsize and self.price_casts else {}
        cast = accumulate = 0.0
        for v in reads:
            vid = id(v)
            if vid in casts:
                cast += self._cast_seconds(vid, casts[vid])
            if self.mem.alive(("pg", vid)):
                accumulate += self.costs.copy_cost(3 * self.attr_bytes[vid] // 2)
        return cast, accumulate

    def param_grads(self, grads: tuple) -> None:
        """The instructions of ``param_grad_seconds``' work."""
        cast, accumulate = grads
        if cast:
            self.compute(cast, "grad cast", "backward", host=False)
        if accumulate:
            self.compute(accumulate, ACCUMULATE, "backward", host=False)

    def _casts(self, call: Call) -> tuple:
        """The float32 parameter pieces autocast casts for op piece ``call``: (id, bytes of the copy)."""
        return self._once(call, "casts", self._find_casts)

    def _find_casts(self, call: Call) -> tuple:
        if not casts_weights(call.op):
            return ()
        out = []
        for k in range(len(call.op.inputs)):
            v = self.input_value(call, k)
            if not self.is_attr(v) or v.kind is not TensorKind.PARAM or v.dtype != torch.float32:
                continue
            out.append((id(v), self.attr_bytes[id(v)] // 4 * self.cast_itemsize))
        return tuple(out)

    def inside_comm(self, call: Call, micro: int, cat: str, way: str, dur: float) -> None:
        """A piece communicating inside its call (``cube.passes.inside``) and its ``dur`` of compute:
        its messages (point to point; a halo's go the other way in backward), in ``rounds`` rounds
        each overlapping a share of the compute (a ring's steps), a reordering's messages around
        them, and its all-reduce; or its all-gather before the compute (and its gradients'
        reduce-scatter after it in backward)."""
        inside, me, tag = call.inside, self.plan.rank, ("inside", id(call.op.root))
        if inside.all_to_all:
            self.exchange_rows(call, cat, way, dur)
            return
        if inside.all_gather:   # gathered before the compute; the gradients reduce-scattered after it
            if way == "f":
                self.coll("all_gather", inside.groups[0], inside.all_gather, cat)
            self.compute(dur * inside.work, _label(call.op), cat)
            if way == "b":
                self.coll("reduce_scatter", inside.groups[0], inside.all_gather, cat)
            return
        if way == "f":
            sends, recvs = inside.p2p, inside.recvs
        elif inside.bw_p2p is not None:
            sends, recvs = inside.bw_p2p, inside.bw_recvs
        else:
            sends, recvs = inside.recvs, inside.p2p
        k = 1 if way == "f" else 2
        for peer, *nbytes in inside.reorder:   # into the order the call computes in
            self.send(((me, peer), tag + ("reorder",), micro, way), nbytes[k - 1] // 2, cat)
        for peer, *_ in inside.reorder_recvs:
            self.recv(((peer, me), tag + ("reorder",), micro, way), cat)
        dur *= inside.work
        rounds = max(inside.rounds, 1)
        if rounds == 1 and way == "b":   # a halo's adjoint sends the gradient the op computed
            self.compute(dur, _label(call.op), cat)
            dur = 0.0
        for step in range(rounds):
            for peer, nbytes in sends:
                share = nbytes * (step + 1) // rounds - nbytes * step // rounds
                self.send(((me, peer), tag + (step,), micro, way), share, cat)
            if rounds > 1:
                self.compute(dur / (rounds + 1), _label(call.op), cat)
            for peer, _ in recvs:
                self.recv(((peer, me), tag + (step,), micro, way), cat)
        if dur:
            self.compute(dur / (rounds + 1) if rounds > 1 else dur, _label(call.op), cat)
        for peer, *nbytes in inside.reorder:   # and back
            self.send(((me, peer), tag + ("back",), micro, way), nbytes[k - 1] - nbytes[k - 1] // 2, cat)
        for peer, *_ in inside.reorder_recvs:
            self.recv(((peer, me), tag + ("back",), micro, way), cat)
        nbytes = inside.all_reduce if way == "f" or inside.bw_all_reduce is None else inside.bw_all_reduce
        if nbytes and inside.groups:
            self.coll("all_reduce", inside.groups[0], nbytes, cat)

    def exchange_rows(self, call: Call, cat: str, way: str, dur: float) -> None:
        """A MoE layer split by experts (``cube.runtime.experts``): in forward the per-expert row
        counts (an all-to-all of one integer per expert), the rows to the ranks holding their
        experts (an all-to-all of this rank's rows, ``Inside.all_to_all``), the experts' compute,
        the rows back (another); backward runs the two all-to-alls' adjoints around its compute.
        The busiest rank of the group receives ``moe_imbalance`` times the mean rows (a router that
        is not balanced): its all-to-alls move and its experts compute that many, and every rank is
        priced as that one, as the all-to-alls make the others wait for it (its memory is not)."""
        inside, f = call.inside, self.moe_imbalance
        group, nbytes = inside.groups[0], int(round(inside.all_to_all * f))
        if way == "f" and inside.experts:
            self.coll("all_to_all", group, 8 * inside.experts, cat)
        self.coll("all_to_all", group, nbytes, cat)
        self.compute(dur * f, _label(call.op), cat)
        self.coll("all_to_all", group, nbytes, cat)

    def fw_step(self, call: Call, micro: int, cat: str) -> None:
        s = call.step
        out = call.outputs[0] if call.outputs else None
        if s.kind in ("stash", "unstash"):   # the value stays where it is, for a later stage
            return
        if s.kind == "send":
            if s.grad != "only":   # a gradient-only link sends nothing forward
                nbytes = nbytes_of(box_shape(s.box), self.dtype_of(call.inputs[0]))
                self.send((s.ranks, s.tag, micro, "f"), nbytes, cat)
        elif s.kind == "assemble":
            self.compute(self.costs.copy_cost(nbytes_of(out.shape, self.dtype_of(out))), "assemble", cat)
        elif s.kind == "recv":
            self.recv((s.ranks, s.tag, micro, "f"), cat)
        elif s.kind == "gather":
            me = s.ranks[0]
            for src, tag, *_ in s.takes:
                if src != me:
                    self.recv(((src, me), tag, micro, "f"), cat)
            local = sum(math.prod(box_shape(place)) for src, _, _, place, _, _ in s.takes if src == me)
            self.compute(self.costs.copy_cost(local * self.dtype_of(out).itemsize), "gather", cat)
        elif s.kind in COLLECTIVES:
            nbytes = nbytes_of(out.shape, self.dtype_of(out)) * (len(s.ranks) if s.kind == "reduce_scatter" else 1)
            self.coll(s.kind, s.ranks, nbytes, cat)
        elif s.kind == "chunk":
            self.compute(self.costs.copy_cost(nbytes_of(out.shape, self.dtype_of(out))), "chunk", cat)
        if out is None:
            return
        if self.tag:
            self.re_made.add(id(out))
            self.re_values.append(out)
        mem = self.micros[micro].mem
        if s.kind in ("identity_all_reduce", "narrow", "region", "grad_to", "detach"):
            mem.alias(self.vkey(out), self.vkey(call.inputs[0]))
        else:
            mem.alloc(self.vkey(out), nbytes_of(out.shape, self.dtype_of(out)))

    # ------------------------------------------------------------------ backward
    def backward(self, micro: int, stage: Optional[int] = None) -> None:
        st = self.state(micro)
        mem = st.mem
        for i in reversed(self.spans[stage]):
            run = self.run_of.get(i)
            if run is not None and i == run.stop - 1:
                self.recompute(run, micro)
            call = self.calls[i]
            if call.op is not None:
                saved = ("saved", i, self.tag if run is not None else "")
                if self._needs_grad(call):
                    bw, label = self.costs.op_cost(call).bw, self._fw_static(i, call)[0]
                    if len(call.amax_ranks) > 1:   # the float8 output gradient's amax, as in forward
                        self.coll("all_reduce", call.amax_ranks, 4, "backward")
                    grads = self.param_grad_seconds(call)
                    if call.defer_wgrad:   # B: the input's gradient; W gets the weight's (cube.runtime.zb)
                        x = call.op.inputs[DEFERRABLE[call.op.name][0]]
                        share = 0.5 if x.requires_grad else 0.0   # two equal products
                        self.compute(bw * share, label, "backward")
                        st.deferred.setdefault(stage, []).append((bw * (1 - share), call, saved, grads))
                    else:
                        if call.inside is not None:
                            self.inside_comm(call, micro, "backward", "b", bw)
                        else:
                            self.compute(bw, label, "backward")
                        self.param_grads(grads)
                    self.grad_flow(call, micro)
                if not call.defer_wgrad:
                    mem.release_all(saved)
            else:
                self.bw_step(call, micro)
                self.grad_flow(call, micro)
            if run is not None and i == run.start:
                mem.release_all(("ckpt", run.start))
                self.tag = ""
            self.settle()
            if not self.held:
                self.launch_ready(i)
        mem.release_all("g")   # gradients nothing consumed (the loss's seed)
        self.settle()

    def weight(self, micro: int, stage: Optional[int] = None) -> None:
        """A W action: the weight gradients its B deferred; their saved inputs go after."""
        st = self.state(micro)
        for seconds, call, saved, grads in st.deferred.pop(stage, []):
            self.compute(seconds, _label(call.op) + " (W)", "backward")
            self.param_grads(grads)
            st.mem.release_all(saved)
            self.settle()

    def recompute(self, run, micro: int) -> None:
        """The run's forward again, its saved tensors held until its backward is done."""
        self.tag, self.re_made, self.re_values = "re", set(), []
        for k in range(run.start, run.stop):
            self.fw_call(k, self.calls[k], micro, "recompute", keep_saved=True)
        mem = self.micros[micro].mem
        for t in self.re_values:   # only what autograd saved stays
            mem.release(self.vkey(t))
        mem.release_all(("autocast", "re"))   # the recompute's cast cache goes (saved copies stay)
        self.settle()

    def bw_step(self, call: Call, micro: int) -> None:
        s = call.step
        if s.kind in ("stash", "unstash"):
            return
        if s.kind == "send":
            if s.grad != "none" and call.inputs[0].requires_grad:
                self.recv((s.ranks, s.tag, micro, "b"), "backward")
            return
        out = call.outputs[0]
        if s.grad == "none" or not out.requires_grad:
            return
        nbytes, n = nbytes_of(out.shape, self.dtype_of(out)), len(s.ranks)
        if s.kind in ("recv", "grad_to"):
            self.send((s.ranks, s.tag, micro, "b"), nbytes, "backward")
        elif s.kind == "gather":
            me = s.ranks[0]
            for src, tag, _, place, back, links in s.takes:
                size = nbytes_of(box_shape(place), self.dtype_of(out))
                if back and src != me:
                    self.send(((src, me), tag, micro, "b"), size, "backward")
                for q, t in links:
                    self.send(((q, me), t, micro, "b"), size, "backward")
        elif s.kind == "identity_all_reduce":
            self.coll("all_reduce", s.ranks, nbytes, "backward")
        elif s.kind == "all_gather" and s.grad == "V":
            self.coll("reduce_scatter", s.ranks, nbytes, "backward")
        elif s.kind == "all_gather":
            self.compute(self.costs.copy_cost(nbytes // n), "chunk grad", "backward")
        elif s.kind in ("reduce_scatter", "chunk"):
            self.coll("all_gather", s.ranks, nbytes * n, "backward")
        elif s.kind == "all_to_all":
            self.coll("all_to_all", s.ranks, nbytes, "backward")

    # per op piece, the same every micro-batch: asked once
    def _once(self, call: Call, what, compute):
        key = (id(call), what)
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = compute(call)
        return got

    def _out_bytes(self, call: Call, j: int) -> int:
        return self._once(call, j, lambda c: nbytes_of(box_shape(c.layout.outputs[j]),
                                                       self.dtype_of(c.op.outputs[j])))

    def _needs_grad(self, call: Call) -> bool:
        return self._once(call, "grad", needs_grad)

    def _grad_reads(self, call: Call) -> list:
        """The values of a piece that receive a gradient (float, requiring one, read)."""
        return self._once(call, "reads", self._reads)

    def _reads(self, call: Call) -> list:
        if call.op is not None:
            pairs = [(self.input_value(call, k), t) for k, t in enumerate(call.op.inputs)
                     if k not in call.layout.unread]
        else:
            pairs = [(v, v) for v in call.inputs]
        return [v for v, logical in pairs if logical.requires_grad and logical.dtype.is_floating_point]

    def _grad_outs(self, call: Call) -> list:
        """The ids of a piece's outputs (whose gradients go once its backward ran)."""
        return self._once(call, "outs", lambda c: [id(o) for o in (c.op.outputs if c.op is not None else c.outputs)])

    def grad_flow(self, call: Call, micro: int) -> None:
        """Gradients: the inputs' appear (parameters' stay until the optimizer), the outputs' go."""
        mem, made, tag = self.micros[micro].mem, self.re_made, self.tag
        for v in self._grad_reads(call):
            vid = id(v)
            if vid in self.attrs:
                if v.kind is TensorKind.PARAM and not self.mem.alive(("pg", vid)):
                    self.mem.alloc(("pg", vid), self.attr_bytes[vid], "grads", holder="grads")
                continue
            vkey = (vid, tag if vid in made else "")
            root = mem.root_of(vkey)
            if root is None:
                continue
            if (micro, vkey) in self.grads_made:   # read twice: autograd adds this gradient to the first
                self.compute(self.costs.copy_cost(3 * mem.sizes.get(vkey, mem.sizes.get(root, 0)) // 2),
                             "grad sum", "backward", host=False)
            self.grads_made.add((micro, vkey))
            if not mem.alive(("g", root)):
                mem.alloc(("g", root), mem.sizes.get(root, 0), holder="g")
        for oid in self._grad_outs(call):
            key = (oid, tag if oid in made else "")
            if mem.root_of(key) == key:
                mem.release(("g", key), "g")

    def build(self, optimizer: bool = True) -> Program:
        base = self.base()
        plan = self.plan
        has_p2p = any(c.step is not None and c.step.kind in P2P_KINDS for c in self.calls)
        if self.actions is None:
            self.forward(0)
            loss_key = self.coll("all_reduce", plan.loss_sum, 4, "loss", blocking=False) if plan.loss_sum else None
            self.backward(0)
            if has_p2p:
                self.emit("flush", label="p2p.finish", cat="wait")
            self.reduce_gradients()
            self.wait(loss_key, "loss sum")
        else:
            run = {"F": self.forward, "B": self.backward, "W": self.weight}
            for kind, micro, stage in map(parse_action, self.actions):
                if not self.replays.replay(kind, micro, stage):
                    self.replays.record(kind, micro, stage, run[kind])
            self.emit("flush", label="p2p.finish", cat="wait")
            self.reduce_gradients()
            if plan.loss_from is None:
                for dst in plan.loss_to:
                    self.send(("loss", plan.rank, dst), 4, "loss")
                if plan.loss_to:
                    self.emit("flush", label="loss sent", cat="wait")
            else:
                self.recv(("loss", plan.loss_from, plan.rank), "loss")
        micros = {micro for _, micro, _ in map(parse_action, self.actions)} if self.actions else {0}
        for micro in micros:   # the step returns the losses
            self.state(micro).mem.release(self.vkey(plan.loss))
        self.settle()
        if optimizer:
            self.optimizer()
        return Program(plan.rank, self.ins, base, self.buckets)


def _label(op) -> str:
    return f"{op.name} [{op.module_path}]" if op.module_path else op.name
