import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# the graph checker runs after every compile stage and pass in tests (cube.config.check_graphs);
# set here, before anything compiles, so multi-rank workers inherit it
os.environ.setdefault("CUBE_CHECK_GRAPHS", "1")

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
