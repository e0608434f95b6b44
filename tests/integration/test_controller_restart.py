"""Regression: three controllers restarted from their data directories after a log compaction
must become ready again.

pysyncobj compacts its journal into a snapshot (about every 300 s in production; forced here
within a second). With a journal file but no `fullDumpFile`, that snapshot lived in memory only:
after all three controllers restarted, the journal began past the commit index, no state
machine became ready, and no master was ever elected again (seen in a docker-compose
kill_master drill). Method: 3 in-process controllers on free loopback ports, fast compaction,
a few replicated ops, destroy all, start again on the same directories, expect every one ready
and the registered brokers still there.
"""

from __future__ import annotations

import time

from ha.controller import ControllerStateMachine
from mqstore.localcluster import free_ports

FAST_COMPACTION = dict(logCompactionMinEntries=2, logCompactionMinTime=1)


def _start(addrs: list[str], dirs: list[str]) -> list[ControllerStateMachine]:
    return [ControllerStateMachine(a, [b for b in addrs if b != a], d, **FAST_COMPACTION)
            for a, d in zip(addrs, dirs)]


def _wait(pred, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def test_regression_controllers_are_ready_after_all_restart_past_a_compaction(tmp_path):
    addrs = [f"127.0.0.1:{p}" for p in free_ports(3)]
    dirs = [str(tmp_path / f"c{i}") for i in range(3)]
    sms = _start(addrs, dirs)
    try:
        assert _wait(lambda: any(s.is_leader() and s.isReady() for s in sms), 15), "no controller leader"
        leader = next(s for s in sms if s.is_leader())
        for i in range(8):
            leader.apply({"op": "register", "group": "g", "broker_id": i % 2, "addr": f"10.0.0.{i}:10911",
                          "ha_addr": "10.0.0.1:10912", "mode": "classic", "epoch": 0}, sync=True, timeout=5)
            time.sleep(0.3)
        time.sleep(2.5)   # past logCompactionMinTime: every node compacts its journal
    finally:
        for s in sms:
            s.destroy()
    time.sleep(1.0)
    sms = _start(addrs, dirs)
    try:
        assert _wait(lambda: all(s.isReady() for s in sms), 15), \
            f"not ready after a restart of all controllers: {[s.isReady() for s in sms]}"
        assert all("g" in s.state.get("groups", {}) for s in sms), "registered group lost across the restart"
    finally:
        for s in sms:
            s.destroy()
