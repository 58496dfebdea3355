"""``CUBE_P2P_ORDER=strict``: point-to-point messages between two ranks match in posting order, tags
ignored, as NCCL matches them, in the in-process world and on gloo; a pair posted in other orders on its
two ranks fails with ``P2POrderError`` (with tags, the default, it trains)."""
import os
import sys

import pytest
import torch

import cube.debug
from cube.runtime import p2p
from tests.launch import ROOT


def _crossed():
    """Rank 0 sends messages 1 then 2; rank 1 receives 2 first: fine by tags, crossed for NCCL."""
    if cube.debug.rank() == 0:
        works = [p2p._send_work(torch.full((3,), float(t)), 1, t) for t in (1, 2)]
        for w in works:
            w.wait()
        return None
    got = {}
    for t in (2, 1):
        y = torch.empty(3)
        p2p._recv_work(y, 0, t).wait()
        got[t] = float(y[0])
    return got


def _in_order():
    """Both ranks in one order, the receives posted before they are waited for in the other order
    (a posted receive is matched when it is posted, as NCCL's)."""
    if cube.debug.rank() == 0:
        for t in (1, 2):
            p2p._send_work(torch.full((3,), float(t)), 1, t).wait()
        return None
    ys = {t: torch.empty(3) for t in (1, 2)}
    works = {t: p2p._recv_work(ys[t], 0, t) for t in (1, 2)}
    works[2].wait()
    works[1].wait()
    return {t: float(y[0]) for t, y in ys.items()}


def test_tags_match_a_crossed_pair(monkeypatch):
    monkeypatch.delenv("CUBE_P2P_ORDER", raising=False)
    assert cube.debug.run(_crossed, 2)[1] == {1: 1.0, 2: 2.0}


def test_strict_order_catches_a_crossed_pair(monkeypatch):
    monkeypatch.setenv("CUBE_P2P_ORDER", "strict")
    with pytest.raises(RuntimeError, match=r"CUBE_P2P_ORDER=strict: rank 1's receive of message 2 .* meets that "
                                           r"rank's send of message 1"):
        cube.debug.run(_crossed, 2)


def test_strict_order_matches_receives_by_posting_order(monkeypatch):
    monkeypatch.setenv("CUBE_P2P_ORDER", "strict")
    assert cube.debug.run(_in_order, 2)[1] == {1: 1.0, 2: 2.0}


def test_a_bad_order_setting_is_refused(monkeypatch):
    from cube import config
    monkeypatch.setenv("CUBE_P2P_ORDER", "fifo")
    with pytest.raises(ValueError, match="CUBE_P2P_ORDER must be 'strict' or 'tags'"):
        config.p2p_strict()


_GLOO = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from cube.runtime import p2p
dist.init_process_group("gloo", init_method="file://" + {store!r}, rank=int(sys.argv[1]), world_size=2)
if dist.get_rank() == 0:
    for w in [p2p._send_work(torch.full((3,), float(t)), 1, t) for t in (1, 2)]:
        w.wait()
else:
    try:
        for t in (2, 1):
            y = torch.empty(3)
            p2p._recv_work(y, 0, t).wait()
            assert float(y[0]) == t
        print("MATCHED")
    except p2p.P2POrderError as e:
        print("ORDER", e)
os._exit(0)
"""


@pytest.mark.parametrize("strict", [False, True], ids=["tags", "strict"])
def test_on_gloo_processes(strict, tmp_path):
    import subprocess
    script = tmp_path / "crossed.py"
    script.write_text(_GLOO.format(root=str(ROOT), store=str(tmp_path / "store")))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("CUBE_P2P_ORDER", None)
    if strict:
        env["CUBE_P2P_ORDER"] = "strict"
    procs = [subprocess.Popen([sys.executable, str(script), str(r)], stdout=subprocess.PIPE, text=True, env=env)
             for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    if strict:
        assert "ORDER CUBE_P2P_ORDER=strict: rank 1's receive of message 2" in outs[1], outs
    else:
        assert "MATCHED" in outs[1], outs


def _both_receive_first():
    """Each rank waits for the other's message before sending its own: no order of posting saves it."""
    me = cube.debug.rank()
    y = torch.empty(2)
    p2p._recv_work(y, 1 - me, 5).wait()
    p2p._send_work(torch.ones(2), 1 - me, 5).wait()


def test_the_in_process_world_names_a_deadlock_instead_of_hanging():
    with pytest.raises(RuntimeError, match=r"every rank waits and none can go on: rank 0 waits for a message with "
                                           r"tag 5 from rank 1; rank 1 waits for a message with tag 5 from rank 0"):
        cube.debug.run(_both_receive_first, 2)


def test_an_ordered_channel_delivers_each_value_to_its_receive_in_any_order(monkeypatch):
    """The pipeline's ordered channel: sent 1, 2, 3, read 3, 1, 2 (the earlier ones kept on the way)."""
    monkeypatch.setenv("CUBE_P2P_ORDER", "strict")

    def body():
        from cube.runtime import session
        st = session.current().p2p
        if cube.debug.rank() == 0:
            for t in (1, 2, 3):
                p2p._channel_send(torch.full((t, 2), float(t)), 1, t).wait()
            return None
        got = {t: p2p._channel_take(st, 0, t, torch.device("cpu")) for t in (3, 1, 2)}
        assert not st.mailbox
        return {t: (tuple(y.shape), float(y[0, 0])) for t, y in got.items()}

    assert cube.debug.run(body, 2)[1] == {3: ((3, 2), 3.0), 1: ((1, 2), 1.0), 2: ((2, 2), 2.0)}
