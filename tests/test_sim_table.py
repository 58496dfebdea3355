"""The search's ranked table (``python -m cube.sim --search``) keeps its columns aligned whatever
the plans' names: the plan column is as wide as its longest name."""
import re
from types import SimpleNamespace

from cube.sim import cluster_search, search


def _columns_aligned(text: str, header: str) -> None:
    lines = text.splitlines()
    end = lines[0].index(header) + len(header)   # right-aligned numbers end under the header's end
    assert all(re.fullmatch(r" *[-\d.]+", line[end - 9:end]) for line in lines[1:]), text


def test_search_table_aligns_long_plan_names():
    result = SimpleNamespace(step_time=0.0123, peak_memory=3 * 2**20)
    cands = [search.Candidate(config=cfg, result=result) for cfg in (
        {"dp": 4, "tp": 1, "pp": 1, "zero": 0},
        {"dp": 1, "tp": 1, "pp": 4, "schedule": "zb-h1", "nmicros": 16, "zero": 0, "recompute": True, "sp": True},
    )]
    assert len(cands[1].name) > 44
    _columns_aligned(search.table(cands), "step ms")


def test_cluster_table_aligns_long_plan_names():
    result = SimpleNamespace(step_time=1.5, peak_memory=40 * 2**30, model_flops=1e15)
    tried = [cluster_search.Tried(plan=SimpleNamespace(name=name), result=result, feasible=True)
             for name in ("tp8 pp8 dp24 b1 m96 v2 recompute sp", "tp8 pp8 dp24 b1 m96 v2 recompute sp zero1 " * 2)]
    _columns_aligned(cluster_search.table(tried, world=1536), "step s")
