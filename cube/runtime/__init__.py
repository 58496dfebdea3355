"""What generated code and training scripts call at run time."""
from cube.runtime import collectives, utils
from cube.runtime.device import Env, init
from cube.runtime.module import CubeModule, next_batch, piece

__all__ = ["CubeModule", "next_batch", "piece", "init", "Env", "utils", "collectives"]
