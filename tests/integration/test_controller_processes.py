"""Goal: three real `controller` processes on loopback agree on decisions and keep them
when the leader controller is killed with SIGKILL; a restarted controller comes back with
its fsynced state. Expected outcome: the master elected before the kill is still the
master, with the same epoch, on the survivors; a topic created before the kill still
routes; a new election after the kill (the master stops beating) picks the in-sync
slave with a higher epoch. Method: this test plays the brokers, posting heartbeats."""

from __future__ import annotations

import itertools
import json
import os
import time

import pytest

from mqstore import localcluster as lc
from mqstore.localcluster import free_ports, wait_for
from mqstore.localcluster import request as http

pytestmark = pytest.mark.slow


class Cluster:
    def __init__(self, tmp):
        ports = free_ports(6)
        self.api = ports[:3]
        self.raft = ports[3:]
        self.tmp = tmp
        self.procs: dict[int, lc.Proc] = {}
        self._seq = itertools.count(1)     # the master's report numbers (one session)

    def start(self, i: int) -> None:
        peers = [f"127.0.0.1:{self.raft[j]}" for j in range(3) if j != i]
        apis = [f"127.0.0.1:{self.api[j]}" for j in range(3) if j != i]
        self.procs[i] = lc.Proc(lc.controller_argv(self.api[i], self.raft[i], os.path.join(self.tmp, f"c{i}"),
                                                   peers, apis, 1500),
                                os.path.join(self.tmp, f"c{i}.log"), f"c{i}").start()

    def url(self, i: int, path: str) -> str:
        return f"http://127.0.0.1:{self.api[i]}{path}"

    def alive(self) -> list[int]:
        return [i for i, p in self.procs.items() if p.running]

    def leader(self, timeout: float = 15.0) -> int:
        """The ready controller claiming leadership in the highest Raft term (a deposed leader may
        still claim it for a moment)."""
        deadline = time.monotonic() + timeout
        seen = {}
        while time.monotonic() < deadline:
            claims = []
            for i in self.alive():
                try:
                    st, h = http("GET", self.url(i, "/health"))
                except OSError:
                    continue
                seen[i] = h
                if st == 200 and h["role"] == "LEADER" and h["ready"]:
                    claims.append((h["raft"]["raft_term"] or 0, i))
            if claims:
                return max(claims)[1]
            time.sleep(0.1)
        raise AssertionError(f"no leader controller: {seen}")

    def beat(self, broker: int, epoch: int, offset: int, in_sync=()) -> dict | None:
        body = {"group": "g", "broker_id": broker, "addr": f"127.0.0.1:{20000 + broker}",
                "ha_addr": f"127.0.0.1:{21000 + broker}", "epoch": epoch, "max_offset": offset,
                "priority": broker, "in_sync": list(in_sync), "session": 1, "seq": next(self._seq)}
        best = None
        for i in self.alive():
            try:
                st, r = http("POST", self.url(i, "/brokers/heartbeat"), body, timeout=1.0)
            except OSError:
                continue
            if st == 200 and (best is None or r["epoch"] > best["epoch"]):
                best = r
        return best

    def stop_all(self) -> None:
        for p in self.procs.values():
            p.stop(5)


def test_decisions_survive_leader_controller_kill(tmp_path):
    c = Cluster(str(tmp_path))
    for i in range(3):
        c.start(i)
    try:
        c.leader()
        # Both brokers beat until broker 0 (lower priority value) is master at epoch 1.
        def master_elected():
            c.beat(1, 0, 0)
            r = c.beat(0, 0, 0)
            return r if r and r["role"] == "MASTER" else None
        r = wait_for(master_elected, what="first master")
        assert r["epoch"] == 1 and r["master_id"] == 0
        # The master reports broker 1 in sync: the SyncStateSet grows to {0, 1}.
        def sss_grown():
            c.beat(1, 1, 100)
            r = c.beat(0, 1, 100, in_sync=[1])
            return r if r and sorted(r["sync_state_set"]) == [0, 1] else None
        wait_for(sss_grown, what="SyncStateSet {0,1}")
        st, route = http("POST", c.url(c.leader(), "/topics"), {"topic": "TopicA", "queues": 4})
        assert st == 201 and len(route["queues"]) == 4

        # Kill -9 the leader controller. Decisions must survive on the other two.
        old = c.leader()
        c.procs[old].kill9()
        new = c.leader(timeout=20)
        for i in c.alive():
            # Committed on a majority before the kill; a follower applies it once the new
            # leader commits an entry of its own term (Raft 5.4.2), so allow a moment.
            st, sss = wait_for(lambda: (lambda r: r if r[0] == 200 else None)(
                http("GET", c.url(i, "/groups/g/sync-state-set"))), timeout=5, what=f"group on controller {i}")
            assert sss["master_id"] == 0 and sss["master_epoch"] == 1
            assert sorted(sss["sync_state_set"]) == [0, 1]
            st, route = wait_for(lambda: (lambda r: r if r[0] == 200 else None)(
                http("GET", c.url(i, "/routes/TopicA"))), timeout=5, what=f"route on controller {i}")
            assert [q["addr"] for q in route["queues"]] == ["127.0.0.1:20000"] * 4

        # The master stops beating: after the timeout the new leader elects broker 1, epoch 2.
        def failed_over():
            r = c.beat(1, 1, 100)
            return r if r and r["role"] == "MASTER" else None
        r = wait_for(failed_over, what="failover to broker 1")
        assert r["epoch"] == 2 and r["master_id"] == 1
        st, route = http("GET", c.url(new, "/routes/TopicA"))
        assert route["queues"][0]["addr"] == "127.0.0.1:20001"

        # The killed controller restarts and converges (fsynced state + Raft catch-up).
        c.start(old)
        def caught_up():
            try:
                st, g = http("GET", c.url(old, "/groups/g/sync-state-set"))
            except OSError:
                return None
            return g if st == 200 and g["master_epoch"] == 2 else None
        g = wait_for(caught_up, what="restarted controller catches up")
        assert g["master_id"] == 1
        # Manual electMaster of a broker outside the SyncStateSet is refused.
        st, err = http("POST", c.url(c.leader(), "/groups/g/elect-master"), {"broker_id": 0})
        assert st == 409
        with open(os.path.join(tmp_path, f"c{new}", "controller-state.json")) as f:
            assert json.load(f)["groups"]["g"]["master_epoch"] == 2
    finally:
        c.stop_all()
