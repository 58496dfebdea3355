"""``python -m cube.debug -n N script.py [args]``: an N-rank plan in one process (see
``cube.runtime.threadworld``); ``cube.debug.run(fn, n)`` does the same for a function."""
from cube.runtime.threadworld import main, rank, run

__all__ = ["main", "run", "rank"]

if __name__ == "__main__":
    raise SystemExit(main())
