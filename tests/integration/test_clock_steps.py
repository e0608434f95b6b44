"""Wall-clock steps on real processes, as an NTP step or `date -s` makes them.

Goal: Raft ticks, election and heartbeat timers, HA leases and heartbeats and the
controller's heartbeat timeout all run on monotonic clocks, so a step of hours either way on
a DLedger leader or follower, a classic master or slave, or the controller changes no
leadership, fails over nothing and loses nothing. Stored timestamps follow the stepping
node's wall clock, as RocketMQ's do (`store_timestamp` is the leader's `System.currentTimeMillis`).
Method: tests/integration/wallclock.py (an LD_PRELOAD shim that moves one process's
CLOCK_REALTIME only); every step is held under load for longer than the timeout it could
trip (an election timeout; the controller's 3 s heartbeat timeout), and each test first shows
the step took effect (a message stored after it carries the shifted time).
Out of scope: requests signed with the cluster secret (+-60 s) or an ACL key
(aclReplayWindowMs, +-5 min) carry a timestamp checked against the receiver's wall clock
(docs/security.md, "Clocks"): a step beyond that on a secure cluster refuses them, as
Kerberos does for a skewed clock.
"""

from __future__ import annotations

import time

import pytest

from mqstore import localcluster as lc
from tests.integration.dledger_harness import ACKED, DLedgerCluster, Workload, verify_stores
from tests.integration.test_ha_processes import Group, _bring_up, wait_for
from tests.integration.wallclock import WallClock

pytestmark = pytest.mark.slow

HOUR_S = 3600.0
DLEDGER_HOLD_S = 3.0        # longer than the election timeout (and CheckQuorum's lease)
CLASSIC_HOLD_S = 4.0        # longer than the controller's heartbeat timeout (3 s here)
PROBE_TOPIC = "ClockProbe"


def _shift_ms(store_timestamp_ms: int, sent_at_s: float) -> float:
    return store_timestamp_ms - sent_at_s * 1000


def _probe(api: str, create: bool = False) -> int:
    """Store one message on `api` (a leader or master); its store timestamp."""
    if create:
        st, doc = lc.http(api, "POST", "/topics", {"topic": PROBE_TOPIC, "queues": 1})
        assert st in (200, 201), doc
    st, doc = lc.http(api, "POST", f"/topics/{PROBE_TOPIC}/messages", {"messages": [{"body": "probe", "queue_id": 0}]})
    assert st == 200 and doc["results"][0]["status"] in ("SEND_OK", "SLAVE_NOT_AVAILABLE"), doc
    offset = doc["results"][0]["queue_offset"]
    # An ack means committed; dispatch to the consume queue follows (RocketMQ's reput): long-poll.
    st, got = lc.http(api, "GET", f"/topics/{PROBE_TOPIC}/queues/0/messages?offset={offset}&max=1&wait_ms=5000",
                      timeout=10)
    assert st == 200 and got["messages"], got
    return got["messages"][0]["store_timestamp"]


# --- DLedger -----------------------------------------------------------------------------------------
def _raft_view(c: DLedgerCluster) -> dict[str, tuple[str, int]]:
    out = {}
    for i, n in c.nodes.items():
        doc = lc.get_ok(n.api, "/cluster", 2.0) or {}
        out[i] = (doc.get("role"), doc.get("log", {}).get("term"))
    return out


def _settled(read_view, leader: str, within_s: float = 10.0) -> dict[str, tuple[str, int]]:
    """read_view() once every node is in the leader's term, as its leader or a follower."""
    deadline = time.monotonic() + within_s
    while True:
        view = read_view()
        term = view[leader][1]
        if all(v == (("LEADER" if i == leader else "FOLLOWER"), term) for i, v in view.items()):
            return view
        assert time.monotonic() < deadline, f"no settled view within {within_s} s: {view}"
        time.sleep(0.05)


def test_regression_the_clock_step_baseline_waits_for_a_follower_not_yet_in_the_leaders_term():
    """Two acks make a quorum: after 20 acks the third node had not heard the leader (term 0),
    and that view, taken as the baseline, failed the first step's check for no reason."""
    views = iter([{"n0": ("FOLLOWER", 1), "n1": ("LEADER", 1), "n2": ("FOLLOWER", 0)},
                  {"n0": ("FOLLOWER", 1), "n1": ("LEADER", 1), "n2": ("FOLLOWER", 1)}])
    assert _settled(lambda: next(views), "n1", within_s=5.0)["n2"] == ("FOLLOWER", 1)


def test_wall_clock_steps_on_a_dledger_leader_and_followers_change_no_leader_and_lose_nothing(tmp_path):
    c = DLedgerCluster(str(tmp_path / "cluster"), wall_clock=True)
    clock = c.clock
    w: Workload | None = None
    try:
        c.start()
        w = Workload(c)
        w.create_topic()
        w.start()
        leader = c.leader()
        f1, f2 = [i for i in c.ids if i != leader]
        w.wait_acks(20)
        # The baseline is the settled view: two acks take a quorum, and the third node may not
        # have heard the leader yet (it was last to start on a loaded machine).
        before = _settled(lambda: _raft_view(c), leader)
        # the shim is in effect: the leader's +2 h shows in what it stores, and goes when undone
        t_steps = time.monotonic()
        clock.step(leader, +2 * HOUR_S)
        sent = time.time()
        assert abs(_shift_ms(_probe(c.nodes[leader].api, create=True), sent) - 2 * HOUR_S * 1000) < 60_000
        steps = [(f1, -2 * HOUR_S), (leader, -4 * HOUR_S), (f2, +24 * HOUR_S), (f1, +2 * HOUR_S),
                 (leader, +2 * HOUR_S)]
        for who, by in [(leader, 0.0), *steps]:
            clock.step(who, by)
            t0 = time.monotonic()
            time.sleep(DLEDGER_HOLD_S)
            view = _raft_view(c)
            assert view == before, f"after a {by / HOUR_S:+g} h step on {who}: {view} (was {before})"
            assert sum(1 for a in w.snapshot() if a.outcome == ACKED and a.start >= t0) >= 20, w.summary()
        sent = time.time()        # every clock back where it started (the leader's net step is 0)
        assert abs(_shift_ms(_probe(c.nodes[leader].api), sent)) < 60_000
        w.stop()
        c.wait_converged()
        codes = c.stop_all("TERM")
        assert all(code == 0 for code in codes.values()), codes
        attempts = w.snapshot()
        # (before the steps a thread may have asked a follower first: NOT_LEADER, then the leader)
        assert all(a.outcome == ACKED for a in attempts if a.start >= t_steps), w.summary()
        figures = verify_stores(c, attempts, w.topic)
        print(f"\nclock steps on a DLedger group: {len(steps) + 1} steps, term {before[leader][1]} throughout, "
              f"{figures}")
    finally:
        if w is not None:
            w.halt()
        c.close()


# --- classic HA with the controller --------------------------------------------------------------
class ClockGroup(Group):
    """test_ha_processes' group with every process (ctl, b0, b1) under the wall-clock shim."""

    def __init__(self, tmp: str, clock: WallClock):
        super().__init__(tmp, "SYNC_MASTER")
        self.clock = clock

    def _spawn(self, name: str, argv: list[str]) -> None:
        proc = lc.Proc(argv, f"{self.tmp}/{name}.log", name)
        self.clock.attach(name, proc)
        self.procs[name] = proc.start()

    def controller_view(self) -> tuple:
        doc = lc.get_ok(f"127.0.0.1:{self.ctl_api}", "/groups", 2.0) or {}
        g = {x["broker_name"]: x for x in doc.get("groups", [])}.get("broker-b", {})
        return g.get("master_addr"), g.get("master_epoch"), sorted(g.get("sync_state_set", []))


def test_wall_clock_steps_on_a_classic_master_slave_and_controller_fail_nothing_over(tmp_path):
    g = ClockGroup(str(tmp_path), WallClock(str(tmp_path / "clock")))
    try:
        _bring_up(g)
        before = g.controller_view()
        assert before[0] and before[2] == [0, 1], before
        g.clock.step("b0", +2 * HOUR_S)
        sent = time.time()
        assert abs(_shift_ms(_probe(f"127.0.0.1:{g.api[0]}", create=True), sent) - 2 * HOUR_S * 1000) < 60_000
        acked, i = [], 0
        steps = [("b0", 0.0), ("b1", -2 * HOUR_S), ("ctl", +24 * HOUR_S), ("b0", -4 * HOUR_S),
                 ("ctl", -48 * HOUR_S), ("b1", +2 * HOUR_S), ("b0", +2 * HOUR_S), ("ctl", +24 * HOUR_S)]
        for who, by in steps:
            g.clock.step(who, by)
            end = time.monotonic() + CLASSIC_HOLD_S
            while time.monotonic() < end:
                status = g.send(0, i)
                assert status == "SEND_OK", f"after a {by / HOUR_S:+g} h step on {who}: send {i} got {status}"
                acked.append(f"m{i:06d}")
                i += 1
            assert g.health(0).get("role") == "MASTER" and g.health(1).get("role") == "SLAVE"
            view = g.controller_view()
            assert view == before, f"after a {by / HOUR_S:+g} h step on {who}: controller says {view} (was {before})"
        wait_for(lambda: g.health(1)["committed_offset"] == g.health(0)["committed_offset"], what="slave caught up")
        assert g.bodies(1) == acked == g.bodies(0)
        print(f"\nclock steps on a classic group: {len(steps)} steps, {len(acked)} SYNC_MASTER sends acked, "
              f"master epoch {before[1]} throughout")
    finally:
        g.stop_all()
