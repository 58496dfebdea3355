"""Runs on every rank: checks cube.runtime.collectives against local references.

    torchrun --nproc_per_node=N tests/workers/collectives_worker.py OUTDIR

Every rank builds the same full tensors from fixed seeds and takes its pieces.
For each primitive and rank group it checks the forward against the result
computed locally from the full tensors ("fwd"), the backward against the
local reference ("bwd"), the adjoint identity <A x, g> = <x, A^T g> with
both sides summed over the group ("adj"), and the forward of an input that
needs no gradient and of one under ``torch.no_grad()`` (the primitives then
skip their autograd node: "nograd"); replicated tensors whose gradient is
replicated count once in the pairing. Writes the largest absolute errors to
OUTDIR/rank{r}.json and raises if one is above the tolerance.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from cube.runtime import collectives as C  # noqa: E402

TOL = 1e-6
DTYPE = torch.float64
PRIMITIVES = ("all_reduce", "identity_fw_all_reduce_bw", "all_gather", "all_gather_keep", "reduce_scatter",
              "all_to_all", "chunk", "p2p")
# suite name -> (dim for gather/scatter/chunk, (split_dim, concat_dim) for all_to_all)
SUITES = {"world": (0, (0, 1)), "rev": (1, (1, 0)), "pair": (-1, (2, 0)), "lazy": (1, (1, 2))}


def suites(world: int) -> dict:
    """The rank groups each rank tests, by suite name: {name: ranks}."""
    rank = dist.get_rank()
    out = {"world": tuple(range(world)), "rev": tuple(reversed(range(world)))}
    if world == 4:
        out["pair"] = (0, 1) if rank < 2 else (2, 3)        # made up front by create_groups
        out["lazy"] = (2, 0) if rank % 2 == 0 else (3, 1)   # made on first use, unsorted
    return out


def randn(seed: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.detach() - b.detach()).abs().max().item() if a.numel() else 0.0


def pair_sum(ranks, lhs: torch.Tensor, rhs: torch.Tensor) -> float:
    """|sum over ranks of lhs - sum over ranks of rhs|, with plain torch.distributed."""
    t = torch.stack([lhs.detach().to(DTYPE).reshape(()), rhs.detach().to(DTYPE).reshape(())])
    dist.all_reduce(t, group=C.group(ranks))
    return (t[0] - t[1]).abs().item()


def check(ranks, op, x, ref_y, g, ref_gx, in_weight=1.0, out_weight=1.0):
    """Forward, backward, adjoint and no-gradient forward errors of ``op`` on this rank's input ``x``."""
    plain = op(x.clone())
    assert not plain.requires_grad
    with torch.no_grad():
        quiet = op(x.clone().requires_grad_(True))
    nograd = max(err(plain, ref_y), err(quiet, ref_y))
    x = x.clone().requires_grad_(True)
    y = op(x)
    (gx,) = torch.autograd.grad(y, x, g)
    adj = pair_sum(ranks, out_weight * (y * g).sum(), in_weight * (x * gx).sum())
    return err(y, ref_y), err(gx, ref_gx), adj, nograd


def run_suite(ranks, dim, a2a) -> dict:
    n, me = len(ranks), ranks.index(dist.get_rank())
    base = (2, 3, 2)
    full = tuple(s * n for s in base)          # divisible by n along every dim
    results = {}

    # all_reduce: V -> R; output gradient replicated (same g everywhere, counted once)
    xs = [randn(10 + i, base) for i in range(n)]
    g = randn(20, base)
    results["all_reduce"] = check(ranks, lambda t: C.all_reduce(t, ranks), xs[me], sum(xs), g, g,
                                  out_weight=1.0 / n)

    # identity forward, all-reduce backward: R -> R; output gradient partial
    x = randn(30, base)
    gs = [randn(40 + i, base) for i in range(n)]
    results["identity_fw_all_reduce_bw"] = check(
        ranks, lambda t: C.identity_fw_all_reduce_bw(t, ranks), x, x, gs[me], sum(gs), in_weight=1.0 / n)

    # all_gather: D(dim) -> R; output gradient partial, input gradient = my chunk of the sum
    X = randn(50, full)
    gs = [randn(60 + i, full) for i in range(n)]
    results["all_gather"] = check(ranks, lambda t: C.all_gather(t, ranks, dim), X.chunk(n, dim)[me], X,
                                  gs[me], sum(gs).chunk(n, dim)[me])

    # all_gather(grad="R"): D(dim) -> R read by whole ops; the output gradient is complete
    # (replicated, counted once), the input gradient is my chunk of it
    G = randn(65, full)
    results["all_gather_keep"] = check(ranks, lambda t: C.all_gather(t, ranks, dim, grad="R"),
                                       X.chunk(n, dim)[me], X, G, G.chunk(n, dim)[me], out_weight=1.0 / n)

    # reduce_scatter: V -> D(dim); input gradient replicated = the whole gradient
    xs = [randn(70 + i, full) for i in range(n)]
    G = randn(80, full)
    results["reduce_scatter"] = check(ranks, lambda t: C.reduce_scatter(t, ranks, dim), xs[me],
                                      sum(xs).chunk(n, dim)[me], G.chunk(n, dim)[me], G)

    # all_to_all: D(concat) -> D(split)
    split, concat = a2a
    X, G = randn(90, full), randn(100, full)
    results["all_to_all"] = check(ranks, lambda t: C.all_to_all(t, ranks, split, concat),
                                  X.chunk(n, concat)[me], X.chunk(n, split)[me],
                                  G.chunk(n, split)[me], G.chunk(n, concat)[me])

    # chunk: R -> D(dim); input gradient replicated (counted once)
    X, G = randn(110, full), randn(120, full)
    results["chunk"] = check(ranks, lambda t: C.chunk(t, ranks, dim), X, X.chunk(n, dim)[me],
                             G.chunk(n, dim)[me], G, in_weight=1.0 / n)

    # p2p: positions 0->1, 2->3, ... of ranks
    src, dst = ranks[me - me % 2], ranks[me - me % 2 + 1]
    x, g = randn(130 + me // 2, base), randn(140 + me // 2, base)
    with torch.no_grad():   # a forward that needs no gradient
        y = C.p2p_shift(x.clone().requires_grad_(True) if ranks[me] == src else None, src, dst, base, DTYPE)
    nograd = 0.0 if ranks[me] == src else err(y, x)
    if ranks[me] == src:
        xr = x.clone().requires_grad_(True)
        marker = C.p2p_shift(xr, src, dst, base, DTYPE)
        assert marker.numel() == 0 and marker.requires_grad
        (gx,) = torch.autograd.grad(marker.sum(), xr)
        results["p2p"] = (0.0, err(gx, g), pair_sum(ranks, torch.zeros(()), (xr * gx).sum()), nograd)
    else:
        y = C.p2p_shift(None, src, dst, base, DTYPE)
        assert y.requires_grad
        torch.autograd.backward(y, g)
        results["p2p"] = (err(y, x), 0.0, pair_sum(ranks, (y * g).sum(), torch.zeros(())), nograd)
    return results


def main():
    outdir = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world in (2, 4), world
    if world == 4:
        C.create_groups([(0, 1), (2, 3), (0, 1, 2, 3)])
        mine = (0, 1) if rank < 2 else (2, 3)
        assert C.group(mine[::-1]) is C.group(mine) is not None
    assert C.group(tuple(reversed(range(world)))) is None
    checks = {}
    for name, ranks in suites(world).items():
        dim, a2a = SUITES[name]
        results = run_suite(ranks, dim, a2a)
        assert tuple(results) == PRIMITIVES, tuple(results)
        for prim, errs in results.items():
            for kind, e in zip(("fwd", "bwd", "adj", "nograd"), errs):
                checks[f"{name}.{prim}.{kind}"] = e
    if world == 4:   # the lazily made group is cached too
        lazy = suites(world)["lazy"]
        assert C.group(tuple(sorted(lazy))) is C.group(lazy) is not None
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "checks": checks}, f, indent=1)
    bad = {k: v for k, v in checks.items() if not v <= TOL}
    dist.barrier()
    dist.destroy_process_group()
    if bad:
        raise AssertionError(f"rank {rank}: errors above {TOL}: {bad}")


if __name__ == "__main__":
    main()
