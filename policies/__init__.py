"""The shipped policies moved to ``cube.policies``; this folder keeps ``import policies`` and
``from policies.data import PASData`` working from a checkout (each module here is the
``cube.policies`` module of that name). It is not installed: write ``cube.policies``."""
from cube.policies import *  # noqa: F401,F403
from cube.policies import __all__  # noqa: F401
