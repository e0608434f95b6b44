"""Classic HA failover with three controllers (pysyncobj), as real processes on loopback.

The deployment shape of docs/deploy.md: controllers c0..c2 form one Raft group; broker-b
is a SYNC_MASTER + slave with `allAckInSyncStateSet=true`, `minInSyncReplicas=1` and
`controllerAddr` listing all three controllers. A steady producer writes while the master
is killed with SIGKILL.

Regression: with allAckInSyncStateSet the master acked writes at once while the slave was
outside the SyncStateSet, so the confirm offset ran ahead of the slave on every write; the
master's periodic in-sync check (slave ack >= confirm offset, sampled once a second) then
failed under steady load, the slave never joined the SyncStateSet and, when the master
died, the controllers had no candidate (no election until the old master returned).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.integration.test_ha_processes import ROOT, TOPIC, free_ports, http, wait_for, wait_role

pytestmark = pytest.mark.slow


class Group3:
    """Three controllers and brokers 0 and 1 of broker-b; every process logs into `tmp`."""

    def __init__(self, tmp: str):
        self.tmp = tmp
        p = free_ports(10)
        self.ctl_api, self.ctl_raft = p[0:3], p[3:6]
        self.api = {0: p[6], 1: p[7]}
        self.ha = {0: p[8], 1: p[9]}
        self.procs: dict[str, subprocess.Popen] = {}

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(os.path.join(self.tmp, f"{name}.log"), "ab") as log:
            self.procs[name] = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def start_controllers(self) -> None:
        for i in range(3):
            others = [j for j in range(3) if j != i]
            self._spawn(f"c{i}", [
                sys.executable, "-m", "ha", "--port", str(self.ctl_api[i]), "--raft-port", str(self.ctl_raft[i]),
                "--peers", ",".join(f"127.0.0.1:{self.ctl_raft[j]}" for j in others),
                "--peer-apis", ",".join(f"127.0.0.1:{self.ctl_api[j]}" for j in others),
                "--data-dir", os.path.join(self.tmp, f"ctl{i}"), "--heartbeat-timeout-ms", "3000"])
        wait_for(lambda: self.leader_controller() is not None, timeout=30, what="a controller leader")

    def leader_controller(self) -> int | None:
        leaders = []
        for i in range(3):
            try:
                if http("GET", f"http://127.0.0.1:{self.ctl_api[i]}/health", timeout=2)[1].get("role") == "LEADER":
                    leaders.append(i)
            except OSError:
                pass
        return leaders[0] if len(leaders) == 1 else None

    def start_broker(self, b: int) -> None:
        conf = os.path.join(self.tmp, f"broker{b}.conf")
        ctl = ";".join(f"127.0.0.1:{p}" for p in self.ctl_api)
        with open(conf, "w") as f:
            f.write("\n".join([
                "brokerClusterName=ha-test", "brokerName=broker-b", f"brokerId={b}", "brokerRole=SYNC_MASTER",
                "allAckInSyncStateSet=true", "minInSyncReplicas=1",
                "flushDiskType=ASYNC_FLUSH", f"storePathRootDir={os.path.join(self.tmp, f'store{b}')}",
                "mappedFileSizeCommitLog=1048576", "maxMessageSize=262144", f"listenPort={self.api[b]}", f"haListenPort={self.ha[b]}",
                "brokerIP1=127.0.0.1", "bindAddress=127.0.0.1", f"controllerAddr={ctl}",
                "slaveReadEnable=true", ""]))      # the tests read every replica's queue
        self._spawn(f"b{b}", [sys.executable, "-m", "node", "-c", conf])

    def url(self, b: int, path: str) -> str:
        return f"http://127.0.0.1:{self.api[b]}{path}"

    def health(self, b: int) -> dict:
        return http("GET", self.url(b, "/health"), timeout=2)[1]

    def wait_role(self, b: int, role: str, timeout: float = 30.0) -> dict:
        return wait_role(self, b, role, timeout)

    def sss(self, ctl: int) -> list[int]:
        st, r = http("GET", f"http://127.0.0.1:{self.ctl_api[ctl]}/groups/broker-b/sync-state-set", timeout=2)
        return sorted(r.get("sync_state_set", [])) if st == 200 else []

    def send(self, b: int, body: str) -> str:
        try:
            st, r = http("POST", self.url(b, f"/topics/{TOPIC}/messages"),
                         {"messages": [{"body": body, "queue_id": 0}]}, timeout=3)
        except OSError as e:
            return f"ERR:{type(e).__name__}"
        return r["results"][0]["status"] if st == 200 else f"HTTP{st}:{r.get('error')}"

    def bodies(self, b: int) -> list[str]:
        out, offset = [], 0
        for _ in range(10_000):
            st, r = http("GET", self.url(b, f"/topics/{TOPIC}/queues/0/messages?offset={offset}&max=64"))
            if st != 200 or r["status"] != "FOUND":
                break
            out += [m["body"] for m in r["messages"]]
            offset = r["next_offset"]
        return out

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class Producer(threading.Thread):
    """Steady writes to broker `target` (switchable), one at a time, bounded by `max_sends`."""

    def __init__(self, g: Group3, prefix: str = "p", max_sends: int = 20_000):
        super().__init__(daemon=True)
        self.g, self.target, self.max_sends, self.prefix = g, 0, max_sends, prefix
        self.stop_evt = threading.Event()
        self.acked: list[str] = []
        self.acked_on: dict[str, int] = {}
        self.results: list[tuple[float, int, str]] = []   # (monotonic time, broker, status)

    def run(self) -> None:
        for i in range(self.max_sends):
            if self.stop_evt.is_set():
                return
            body, b = f"{self.prefix}{i:06d}", self.target
            status = self.g.send(b, body)
            self.results.append((time.monotonic(), b, status))
            if status == "SEND_OK":
                self.acked.append(body)
                self.acked_on[body] = b
            else:
                time.sleep(0.05)


@pytest.fixture
def group3(tmp_path):
    g = Group3(str(tmp_path))
    yield g
    g.stop_all()


def test_three_controllers_elect_slave_under_steady_load_with_all_ack_in_sss(group3):
    g = group3
    g.start_controllers()
    g.start_broker(0)
    g.wait_role(0, "MASTER")
    st, r = http("POST", g.url(0, "/topics"), {"topic": TOPIC, "queues": 1})
    assert st in (200, 201), r
    # Concurrent producers: the confirm offset moves while the slave's reports are in flight.
    prods = [Producer(g, prefix) for prefix in ("p", "q", "r")]
    prod = prods[0]
    for p in prods:
        p.start()
    try:
        # The slave starts while the producer already writes: it must still join the SyncStateSet.
        time.sleep(1.0)
        g.start_broker(1)
        g.wait_role(1, "SLAVE")
        wait_for(lambda: g.sss(g.leader_controller() or 0) == [0, 1], timeout=20,
                 what="slave joins the SyncStateSet under steady load")
        # Every controller (leader and followers) answers heartbeats and agrees on the SSS.
        wait_for(lambda: all(g.sss(i) == [0, 1] for i in range(3)), timeout=10, what="all controllers agree")
        time.sleep(2.0)   # stays in it while writes continue
        assert g.sss(g.leader_controller() or 0) == [0, 1], "slave dropped out of the SyncStateSet under load"
        n_before = sum(len(p.acked) for p in prods)
        assert n_before > 10, f"too few writes acked before the fault: {n_before}"
        g.procs["b0"].send_signal(signal.SIGKILL)
        g.procs["b0"].wait()
        t0 = time.monotonic()
        for p in prods:
            p.target = 1
        g.wait_role(1, "MASTER", timeout=15)
        wait_for(lambda: any(t > t0 and b == 1 and s == "SEND_OK" for t, b, s in prod.results), timeout=10,
                 what="first SEND_OK on the new master")
        first_ok = min(t for t, b, s in prod.results if t > t0 and b == 1 and s == "SEND_OK") - t0
        print(f"\n3 controllers, allAckInSyncStateSet: master kill -9 -> first SEND_OK on the new master in "
              f"{first_ok:.2f} s; {n_before} acked before the fault; load {os.getloadavg()[0]:.2f}")
        assert first_ok < 8.0, f"failover took {first_ok:.2f} s"
        leader = g.leader_controller()
        assert leader is not None and g.sss(leader) == [1], "after failover the SyncStateSet is the new master"
    finally:
        for p in prods:
            p.stop_evt.set()
        for p in prods:
            p.join(10)
    # The dispatcher may still be building the consume queue for the last writes: wait for them.
    on_new: set[str] = set()

    def all_there() -> bool:
        on_new.update(g.bodies(1))
        return all(b in on_new for p in prods for b in p.acked)
    try:
        wait_for(all_there, timeout=10, what="every acked message readable on the new master")
    except AssertionError:
        lost = [(b, p.acked_on[b]) for p in prods for b in p.acked if b not in on_new]
        raise AssertionError(f"{len(lost)} acked messages lost (body, acked by broker): {lost[:5]}") from None
