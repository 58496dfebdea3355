"""CPU ranks keep freed memory (cube.runtime.cpu_memory): set once per process, switchable, and it
removes the page faults of re-allocating a step's buffers."""
import json
import os
import subprocess
import sys

import pytest

from tests.launch import ROOT

PROBE = r"""
import json, resource, torch
from cube.runtime import cpu_memory
torch.set_num_threads(1)
ok = cpu_memory.keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):   # warm up: the heap grows once
    a = [torch.ones(1 << 20) for _ in range(8)]   # 8 buffers of 4 MiB, as one micro-batch's activations
    del a
before = faults()
for _ in range(20):
    a = [torch.ones(1 << 20) for _ in range(8)]
    del a
print(json.dumps({"ok": ok, "again": cpu_memory.keep_freed_memory(), "faults": (faults() - before) / 20}))
"""


def _probe(mode: str) -> dict:
    env = dict(os.environ, CUBE_CPU_MALLOC=mode, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_cached_malloc_reuses_freed_buffers_without_page_faults():
    cached, system = _probe("cache"), _probe("system")
    assert cached["ok"] and cached["again"], "glibc's mallopt did not take the thresholds"
    assert not system["ok"]
    # 32 MiB per round: about 8192 pages of 4 KiB touched afresh under glibc's defaults
    assert system["faults"] > 1000, system
    assert cached["faults"] < system["faults"] / 10, (cached, system)


def test_bad_setting_is_a_value_error(monkeypatch):
    from cube import config
    monkeypatch.setenv("CUBE_CPU_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match="CUBE_CPU_MALLOC must be 'cache' or 'system'"):
        config.cpu_malloc()
