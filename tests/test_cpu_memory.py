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
NUMEL = {NUMEL}
COUNT = max(4, (32 << 20) // (4 * NUMEL))
for _ in range(3):   # warm up: the heap grows once
    a = [torch.ones(NUMEL) for _ in range(COUNT)]   # buffers, as one micro-batch's activations
    del a
before = faults()
for _ in range(6):
    a = [torch.ones(NUMEL) for _ in range(COUNT)]
    del a
print(json.dumps({"ok": ok, "again": cpu_memory.keep_freed_memory(), "faults": (faults() - before) / 6}))
"""


def _probe(mode: str, numel: int = 1 << 20) -> dict:
    env = dict(os.environ, CUBE_CPU_MALLOC=mode, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", PROBE.replace("{NUMEL}", str(numel))], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_cached_malloc_reuses_freed_buffers_without_page_faults():
    # 4 x 64 MiB, over glibc's 32 MiB ceiling of its dynamic mmap threshold (a collective's result):
    # under glibc's defaults each is mapped anew, 16384 pages of 4 KiB each touched afresh
    cached, system = _probe("cache", 16 << 20), _probe("system", 16 << 20)
    assert cached["ok"] and cached["again"], "glibc's mallopt did not take the thresholds"
    assert not system["ok"]
    if system["faults"] < 1000:   # e.g. transparent huge pages always on: few faults to save
        pytest.skip(f"fresh 64 MiB mappings cost only {system['faults']:.0f} page faults a round on this kernel")
    assert cached["faults"] < system["faults"] / 100, (cached, system)
    # 8 x 4 MiB (a micro-batch's activations): none after warm-up either
    small = _probe("cache", 1 << 20)
    assert small["faults"] < 100, small


def test_bad_setting_is_a_value_error(monkeypatch):
    from cube import config
    monkeypatch.setenv("CUBE_CPU_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match="CUBE_CPU_MALLOC must be 'cache' or 'system'"):
        config.cpu_malloc()
