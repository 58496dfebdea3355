"""What generated code and training scripts call at run time."""
from cube.runtime import (amp, collectives, compiled, experts, flex, float8, functions, halo, memory, norm, ops, p2p,
                          pipeline, ring, rng, scan, sync_norm, utils, vocab, zb, zero)
from cube.runtime.device import Env, init
from cube.runtime.module import CubeModule, drop_grad, narrow, next_batch, piece
from cube.runtime.reducer import Reducer

__all__ = ["CubeModule", "next_batch", "piece", "narrow", "drop_grad", "init", "Env", "utils", "collectives",
           "ops", "p2p", "pipeline", "Reducer", "amp", "compiled", "memory", "norm", "zb", "zero", "halo",
           "sync_norm", "ring", "rng", "vocab", "experts", "float8", "flex"]
