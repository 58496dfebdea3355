import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# the graph checker runs after every compile stage and pass in tests (cube.config.check_graphs);
# set here, before anything compiles, so multi-rank workers inherit it
os.environ.setdefault("CUBE_CHECK_GRAPHS", "1")

# under pytest-xdist (the README's test command runs two workers, a file each at a time) every
# worker keeps its own cache of generated code and calibrations (cube.config.cache_dir), so two
# workers never write the same plan's files at once
if os.environ.get("PYTEST_XDIST_WORKER") and "CUBE_CACHE_DIR" not in os.environ:
    _base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    os.environ["CUBE_CACHE_DIR"] = os.path.join(_base, f"cube-test-{os.environ['PYTEST_XDIST_WORKER']}")

# opt-in tiers: a test with one of these markers is skipped, with the reason shown, unless its
# environment variable is 1
TIERS = {
    "slow": ("CUBE_SLOW", "slow tier: set CUBE_SLOW=1 to run it"),
    "fuzz_slow": ("CUBE_FUZZ_SLOW", "slow plan fuzzer tier: set CUBE_FUZZ_SLOW=1 to run it"),
}


def pytest_collection_modifyitems(config, items):
    import pytest
    for marker, (var, reason) in TIERS.items():
        if os.environ.get(var) == "1":
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
