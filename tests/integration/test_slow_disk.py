"""A DLedger group of 3 real node processes on a slow disk: every fsync waits 1.5 s.

Goal: a group whose disk is slow (a contended or throttled volume; a term-and-vote write of
two fsyncs took 1.5 s on one) keeps acknowledging writes, elects a new leader when its
leader is killed, and loses nothing. Regression: a term-and-vote write longer than the
election timeout stopped elections altogether (the terms climbed, no leader came; fixed in
dledger/shell.py, which holds the node's clock during such a write and as long after it).
Figures (printed): elected_s = kill -9 -> a writable new leader on /cluster; failover_s =
kill -9 -> the first ack of a request sent after it; the new leader's term.
Method: tests/integration/slowsync.py (an LD_PRELOAD shim that makes one process's fsync and
fdatasync wait; writes and reads keep their speed). The group starts at full speed, then
every node's syncs wait 1.5 s. With ASYNC_FLUSH an ack needs no fsync, so writes go on; an
election needs each candidate's and voter's term and vote on disk, two fsyncs each. After
the failover the disks are fast again, the old leader restarts, and the stores are checked as
in test_dledger_processes.py.
"""

from __future__ import annotations

import time

import pytest

from tests.integration.dledger_harness import DLedgerCluster, Workload, try_http
from tests.integration.test_dledger_processes import finish

pytestmark = pytest.mark.slow

SYNC_DELAY_MS = 1500
ELECTION_BOUND_S = 40.0     # a few elections' worth of 3 s term-and-vote writes (the old code never elected)


def test_a_group_on_a_slow_disk_elects_a_new_leader_after_a_kill_and_loses_nothing(tmp_path):
    c = DLedgerCluster(str(tmp_path / "cluster"), slow_sync=True)
    w: Workload | None = None
    try:
        c.start()
        w = Workload(c)
        w.create_topic()
        w.start()
        w.wait_acks(100)
        old = c.leader()
        old_term = try_http(c.nodes[old].api, "/cluster")["log"]["term"]
        for i in c.ids:
            c.syncs.set(i, SYNC_DELAY_MS)
        time.sleep(0.1)                  # the shims have read the new delay
        w.wait_acks(100, after=time.monotonic())     # acks need no fsync under ASYNC_FLUSH
        c.nodes[old].kill9()
        fault_at = time.monotonic()
        new = c.leader(timeout_s=ELECTION_BOUND_S, exclude=(old,))
        elected_s = round(time.monotonic() - fault_at, 3)
        doc = try_http(c.nodes[new].api, "/cluster")["log"]
        w.wait_acks(100, after=fault_at, timeout_s=ELECTION_BOUND_S)
        paused = {i: (try_http(c.nodes[i].api, "/cluster") or {}).get("log", {}).get("ticks_paused")
                  for i in c.ids if i != old}
        assert doc["term"] <= old_term + 3, f"terms climbed from {old_term} to {doc['term']}"
        assert all(p for p in paused.values()), paused
        assert doc["term_vote_write_ms_max"] >= SYNC_DELAY_MS, doc   # the slow writes happened
        c.syncs.reset()
        c.nodes[old].start()
        c.wait_healthy([old])
        w.wait_acks(100, after=time.monotonic())
        finish(c, w, "slow_disk_kill9_leader", fault_at,
               {"elected_s": elected_s, "old_term": old_term, "new_term": doc["term"],
                "term_vote_write_ms_max": doc["term_vote_write_ms_max"]}, failover_bound_s=ELECTION_BOUND_S)
    finally:
        if w is not None:
            w.halt()
        c.close()
