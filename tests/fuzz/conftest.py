"""Skips the slow fuzz tests (marked ``fuzz_slow``) unless ``CUBE_FUZZ_SLOW=1``."""
import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("CUBE_FUZZ_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow plan fuzzer tier: set CUBE_FUZZ_SLOW=1 to run it")
    for item in items:
        if "fuzz_slow" in item.keywords:
            item.add_marker(skip)
