"""Goal: classic HA with the controller, as real processes on loopback (one controller, two
broker nodes of group broker-b, run as `python -m node`). Expected outcomes, one test each:

1. SYNC_MASTER + slave: kill -9 the master -> the controller elects the slave -> writes
   continue on it -> no message acked SEND_OK is lost.
2. The old master, which wrote a tail no slave acked (its slave was frozen with SIGSTOP),
   returns as a slave and truncates that tail; its committed log then equals the new
   master's.
3. ASYNC_MASTER: the loss window (acked messages missing on the new master after kill -9)
   is measured and printed, not hidden.
4. A slave far behind (started after many writes) catches up.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.slow
TOPIC = "HaTopic"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def http(method: str, url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, (json.loads(raw) if raw else {})


def wait_for(pred, timeout=30.0, what=""):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            v = pred()
        except OSError as e:
            v, last = None, e
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out: {what} ({last!r})")


class Group:
    """One controller and two brokers (ids 0 and 1) of group broker-b."""

    def __init__(self, tmp: str, role: str = "SYNC_MASTER"):
        self.tmp = tmp
        self.role = role
        p = free_ports(7)
        self.ctl_api, self.ctl_raft = p[0], p[1]
        self.api = {0: p[2], 1: p[3]}
        self.ha = {0: p[4], 1: p[5]}
        self.procs: dict[str, subprocess.Popen] = {}

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(os.path.join(self.tmp, f"{name}.log"), "ab")
        self.procs[name] = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def start_controller(self) -> None:
        self._spawn("ctl", [sys.executable, "-m", "ha", "--port", str(self.ctl_api), "--raft-port", str(self.ctl_raft),
                            "--data-dir", os.path.join(self.tmp, "ctl"), "--heartbeat-timeout-ms", "2000"])
        wait_for(lambda: http("GET", f"http://127.0.0.1:{self.ctl_api}/health")[1].get("role") == "LEADER",
                 what="controller up")

    def start_broker(self, b: int) -> None:
        conf = os.path.join(self.tmp, f"broker{b}.conf")
        with open(conf, "w") as f:
            f.write("\n".join([
                "brokerClusterName=ha-test", "brokerName=broker-b", f"brokerId={b}", f"brokerRole={self.role}",
                "flushDiskType=ASYNC_FLUSH", f"storePathRootDir={os.path.join(self.tmp, f'store{b}')}",
                "mappedFileSizeCommitLog=1048576", "maxMessageSize=262144", f"listenPort={self.api[b]}", f"haListenPort={self.ha[b]}",
                "brokerIP1=127.0.0.1", "bindAddress=127.0.0.1", f"controllerAddr=127.0.0.1:{self.ctl_api}", ""]))
        self._spawn(f"b{b}", [sys.executable, "-m", "node", "-c", conf])

    def url(self, b: int, path: str) -> str:
        return f"http://127.0.0.1:{self.api[b]}{path}"

    def health(self, b: int) -> dict:
        return http("GET", self.url(b, "/health"), timeout=2)[1]

    def wait_role(self, b: int, role: str, timeout: float = 30.0) -> dict:
        return wait_for(lambda: (lambda h: h if h.get("role") == role and h.get("status") == "UP" else None)(
            self.health(b)), timeout, f"broker {b} {role}")

    def sss(self) -> dict:
        return http("GET", f"http://127.0.0.1:{self.ctl_api}/groups/broker-b/sync-state-set", timeout=2)[1]

    def send(self, b: int, i: int) -> str:
        st, r = http("POST", self.url(b, f"/topics/{TOPIC}/messages"),
                     {"messages": [{"body": f"m{i:06d}", "queue_id": 0}]})
        return r["results"][0]["status"] if st == 200 else f"HTTP{st}:{r.get('error')}"

    def bodies(self, b: int) -> list[str]:
        out, offset = [], 0
        for _ in range(10_000):
            st, r = http("GET", self.url(b, f"/topics/{TOPIC}/queues/0/messages?offset={offset}&max=32"))
            if st != 200 or r["status"] != "FOUND":
                break
            out += [m["body"] for m in r["messages"]]
            offset = r["next_offset"]
        return out

    def kill(self, name: str) -> None:
        p = self.procs[name]
        p.send_signal(signal.SIGKILL)
        p.wait()

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _bring_up(g: Group) -> None:
    g.start_controller()
    g.start_broker(0)
    g.wait_role(0, "MASTER")          # broker 0 has the lower election priority: first master
    g.start_broker(1)
    g.wait_role(1, "SLAVE")
    wait_for(lambda: sorted(g.sss().get("sync_state_set", [])) == [0, 1], what="slave joins the SyncStateSet")
    st, r = http("POST", g.url(0, "/topics"), {"topic": TOPIC, "queues": 1})
    assert st in (200, 201), r


@pytest.fixture
def group(tmp_path, request):
    """The group; on failure the process logs stay in tmp_path (ctl.log, b0.log, b1.log)."""
    g = Group(str(tmp_path), getattr(request, "param", "SYNC_MASTER"))
    yield g
    g.stop_all()


def test_sync_master_failover_loses_no_acked_message_and_old_master_truncates(group):
    g = group
    _bring_up(g)
    acked = [i for i in range(50) if g.send(0, i) == "SEND_OK"]
    assert len(acked) == 50
    # Freeze the slave: the master keeps writing, nobody acks (FLUSH_SLAVE_TIMEOUT after 5 s).
    # 8 MiB in one batch overflows the loopback socket buffers, so most of this tail never
    # reaches the slave, even after it thaws: the old master holds a tail nobody acked.
    os.kill(g.procs["b1"].pid, signal.SIGSTOP)
    filler = "y" * 200_000
    st, r = http("POST", g.url(0, f"/topics/{TOPIC}/messages"),
                 {"messages": [{"body": f"t{i:06d}{filler}", "queue_id": 0} for i in range(40)]
                  + [{"body": "m001000", "queue_id": 0}]}, timeout=30)
    assert st == 200 and {x["status"] for x in r["results"]} == {"FLUSH_SLAVE_TIMEOUT"}, r
    g.kill("b0")
    os.kill(g.procs["b1"].pid, signal.SIGCONT)
    t0 = time.monotonic()
    g.wait_role(1, "MASTER")
    # Writes continue on the new master (no slave yet: stored, SLAVE_NOT_AVAILABLE).
    first = wait_for(lambda: (lambda s: s if s in ("SEND_OK", "SLAVE_NOT_AVAILABLE") else None)(g.send(1, 2000)),
                     what="first write on the new master")
    print(f"\nclassic failover: master kill -> first accepted write on the new master in "
          f"{time.monotonic() - t0:.2f} s ({first})")
    on_new = g.bodies(1)
    assert all(f"m{i:06d}" in on_new for i in acked), "an acked message was lost"
    # The old master returns as a slave, truncates its unacked tail and resyncs.
    g.start_broker(0)
    g.wait_role(0, "SLAVE")
    wait_for(lambda: g.health(0)["committed_offset"] == g.health(1)["committed_offset"], what="old master resynced")
    on_old = wait_for(lambda: (lambda b: b if b == g.bodies(1) else None)(g.bodies(0)), what="same messages")
    assert "m002000" in on_old
    truncated = "truncated commitlog" in open(os.path.join(g.tmp, "b0.log")).read()
    print(f"old master truncated its unacked tail: {truncated}; marker survived: {'m001000' in on_old}")
    assert truncated, "the old master should have had a tail to cut"
    assert "m001000" not in on_old            # the tail nobody acked is gone, on both
    assert g.send(1, 3000) == "SEND_OK"       # and the old master now acks as a slave


@pytest.mark.parametrize("group", ["ASYNC_MASTER"], indirect=True)
def test_async_master_loss_window_is_measured(group):
    g = group
    _bring_up(g)
    acked = []
    os.kill(g.procs["b1"].pid, signal.SIGSTOP)   # a slow slave: what ASYNC_MASTER acks now is at risk
    for i in range(30):
        if g.send(0, i) == "SEND_OK":
            acked.append(i)
    g.kill("b0")
    os.kill(g.procs["b1"].pid, signal.SIGCONT)
    g.wait_role(1, "MASTER")
    on_new = set(wait_for(lambda: g.bodies(1) or None, what="read new master"))
    lost = [i for i in acked if f"m{i:06d}" not in on_new]
    print(f"\nASYNC_MASTER loss window: {len(lost)} of {len(acked)} acked messages lost after kill -9 "
          f"of the master while its slave lagged")
    assert len(acked) == 30
    assert len(lost) <= len(acked)   # measured, not asserted away: ASYNC_MASTER promises no more


def test_slave_far_behind_catches_up(group):
    g = group
    g.start_controller()
    g.start_broker(0)
    g.wait_role(0, "MASTER")
    # Without a slave SYNC_MASTER stores and answers SLAVE_NOT_AVAILABLE; fill several segments.
    st, r = http("POST", g.url(0, "/topics"), {"topic": TOPIC, "queues": 1})
    big = "x" * 20_000
    for i in range(150):
        st, r = http("POST", g.url(0, f"/topics/{TOPIC}/messages"),
                     {"messages": [{"body": f"m{i:06d}{big}", "queue_id": 0}]})
        assert st == 200
    g.start_broker(1)
    g.wait_role(1, "SLAVE")
    wait_for(lambda: g.health(1)["committed_offset"] == g.health(0)["committed_offset"], timeout=60,
             what="slave caught up")
