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
5. A master cut off from the controller (a TCP fault proxy between it and the controller
   drops every connection) steps down and refuses writes; the controller elects the slave;
   after the cut heals the old master follows the new one; no acked message is lost.
6. Consumer offsets and topic config written on the master are readable on the slave.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time

import pytest

from mqstore import localcluster as lc
from mqstore.localcluster import ROOT, free_ports, wait_for  # noqa: F401 - shared with other process tests
from mqstore.localcluster import request as http

pytestmark = pytest.mark.slow
TOPIC = "HaTopic"


def wait_role(group, b: int, role: str, timeout: float) -> dict:
    """Broker `b` of `group` (with `health(b)`) UP in `role` (a broker shows MASTER once it
    accepts writes: test_ha_promotion_role.py)."""
    def ready() -> dict | None:
        h = group.health(b)
        return h if h.get("role") == role and h.get("status") == "UP" else None
    return wait_for(ready, timeout, f"broker {b} {role}")


class FaultProxy:
    """A loopback TCP proxy that can be cut: while cut, every open connection is closed and new
    ones are closed on accept. Bounded: at most 64 live connections, 64 KiB per read."""

    MAX_CONNS = 64

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.cut = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except (socket.timeout, OSError):
                continue
            with self._lock:
                full = len(self._socks) >= self.MAX_CONNS
            if self.cut.is_set() or full:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self.cut.is_set():
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass
            with self._lock:
                self._socks = [s for s in self._socks if s not in (src, dst)]

    def partition(self) -> None:
        self.cut.set()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass

    def heal(self) -> None:
        self.cut.clear()

    def close(self) -> None:
        self._stop.set()
        self.partition()
        self.listener.close()


class Group:
    """One controller and two brokers (ids 0 and 1) of group broker-b."""

    def __init__(self, tmp: str, role: str = "SYNC_MASTER"):
        self.tmp = tmp
        self.role = role
        p = free_ports(7)
        self.ctl_api, self.ctl_raft = p[0], p[1]
        self.api = {0: p[2], 1: p[3]}
        self.ha = {0: p[4], 1: p[5]}
        self.procs: dict[str, lc.Proc] = {}
        self.controller_addr = {0: f"127.0.0.1:{self.ctl_api}", 1: f"127.0.0.1:{self.ctl_api}"}
        self.extra_lines: dict[int, list[str]] = {0: [], 1: []}   # more config keys per broker
        self.ctl_heartbeat_timeout_ms = 3000

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.procs[name] = lc.Proc(argv, os.path.join(self.tmp, f"{name}.log"), name).start()

    def start_controller(self) -> None:
        self._spawn("ctl", lc.controller_argv(self.ctl_api, self.ctl_raft, os.path.join(self.tmp, "ctl"),
                                              heartbeat_timeout_ms=self.ctl_heartbeat_timeout_ms))
        wait_for(lambda: http("GET", f"http://127.0.0.1:{self.ctl_api}/health")[1].get("role") == "LEADER",
                 what="controller up")

    def start_broker(self, b: int) -> None:
        conf = lc.write_conf(os.path.join(self.tmp, f"broker{b}.conf"), lc.node_lines(
            self.api[b], os.path.join(self.tmp, f"store{b}"),
            ["brokerClusterName=ha-test", "brokerName=broker-b", "flushDiskType=ASYNC_FLUSH",
             "mappedFileSizeCommitLog=1048576", "maxMessageSize=262144",
             *lc.classic_lines(b, self.role, self.ha[b], self.controller_addr[b]),
             "slaveReadEnable=true",      # the tests read the slave's queues
             *self.extra_lines[b]]))
        self._spawn(f"b{b}", lc.node_argv(conf))

    def start_dledger_node(self, name: str = "dl") -> int:
        """A single-node DLedger group (it leads itself) reporting to this controller; its API port."""
        api, raft = free_ports(2)
        conf = lc.write_conf(os.path.join(self.tmp, f"{name}.conf"), lc.node_lines(
            api, os.path.join(self.tmp, f"{name}store"),
            ["brokerClusterName=dl", "brokerName=broker-a", "mappedFileSizeCommitLog=1048576",
             "maxMessageSize=262144", *lc.dledger_lines("n0", "broker-a", {"n0": raft}, {"n0": api}),
             f"controllerAddr=127.0.0.1:{self.ctl_api}"]))
        self._spawn(name, lc.node_argv(conf))
        return api

    def wait_registered(self, broker_name: str, addr: str, timeout: float = 30.0) -> dict:
        """The controller's view of `broker_name` once it names `addr` as the group's master."""
        def known():
            _, doc = http("GET", f"http://127.0.0.1:{self.ctl_api}/groups", timeout=2)
            v = {g["broker_name"]: g for g in doc.get("groups", [])}.get(broker_name)
            return v if v and v["master_addr"] == addr else None
        return wait_for(known, timeout, f"{broker_name} master {addr} registered at the controller")

    def url(self, b: int, path: str) -> str:
        return f"http://127.0.0.1:{self.api[b]}{path}"

    def health(self, b: int) -> dict:
        return http("GET", self.url(b, "/health"), timeout=2)[1]

    def wait_role(self, b: int, role: str, timeout: float = 30.0) -> dict:
        return wait_role(self, b, role, timeout)

    def sss(self) -> dict:
        return http("GET", f"http://127.0.0.1:{self.ctl_api}/groups/broker-b/sync-state-set", timeout=2)[1]

    def send(self, b: int, i: int) -> str:
        return self.send_to(b, TOPIC, f"m{i:06d}")

    def send_to(self, b: int, topic: str, body: str = "x") -> str:
        st, r = http("POST", self.url(b, f"/topics/{topic}/messages"), {"messages": [{"body": body, "queue_id": 0}]})
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
        self.procs[name].kill9()

    def stop_all(self) -> None:
        for p in self.procs.values():
            p.stop(10)           # SIGCONT first if it was SIGSTOPped


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
    g.procs["b1"].sigstop()
    filler = "y" * 200_000
    st, r = http("POST", g.url(0, f"/topics/{TOPIC}/messages"),
                 {"messages": [{"body": f"t{i:06d}{filler}", "queue_id": 0} for i in range(40)]
                  + [{"body": "m001000", "queue_id": 0}]}, timeout=30)
    assert st == 200 and {x["status"] for x in r["results"]} == {"FLUSH_SLAVE_TIMEOUT"}, r
    g.kill("b0")
    g.procs["b1"].cont()
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
    g.procs["b1"].sigstop()   # a slow slave: what ASYNC_MASTER acks now is at risk
    for i in range(30):
        if g.send(0, i) == "SEND_OK":
            acked.append(i)
    g.kill("b0")
    g.procs["b1"].cont()
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


def test_master_partitioned_from_controller_steps_down_and_slave_takes_over(group):
    g = group
    proxy = FaultProxy(g.ctl_api)
    try:
        g.controller_addr[0] = f"127.0.0.1:{proxy.port}"   # only broker 0 reaches the controller through it
        _bring_up(g)
        acked = [i for i in range(20) if g.send(0, i) == "SEND_OK"]
        assert len(acked) == 20
        proxy.partition()
        t0 = time.monotonic()
        # Broker 0 still runs and still reaches its slave; only the controller is gone.
        wait_for(lambda: g.health(0).get("role") == "SLAVE", timeout=10, what="partitioned master steps down")
        stepped = time.monotonic() - t0
        refused = g.send(0, 500)
        assert refused.startswith("HTTP"), f"a master cut off from the controller accepted a write: {refused}"
        g.wait_role(1, "MASTER", timeout=20)
        elected = time.monotonic() - t0
        print(f"\npartition: old master stopped writing after {stepped:.2f} s; slave elected after {elected:.2f} s")
        assert stepped < elected, "the old master must stop writing before a new master exists"
        assert g.send(1, 600) in ("SEND_OK", "SLAVE_NOT_AVAILABLE")
        proxy.heal()
        g.wait_role(0, "SLAVE", timeout=20)
        wait_for(lambda: g.health(0).get("leader") == f"127.0.0.1:{g.api[1]}", timeout=20,
                 what="old master follows the new one")
        wait_for(lambda: g.send(1, 700) == "SEND_OK", timeout=20, what="SYNC_MASTER acked by the old master")
        on_new = g.bodies(1)
        assert all(f"m{i:06d}" in on_new for i in acked), "an acked message was lost"
        assert "m000500" not in on_new
        wait_for(lambda: g.bodies(0) == g.bodies(1), timeout=20, what="replicas agree")
    finally:
        proxy.close()


def _commitlog_bytes(store: str, end: int) -> bytes:
    d = os.path.join(store, "commitlog")
    data = b""
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name), "rb") as f:
            data += f.read(end - len(data))
    return data


def test_regression_demoted_live_master_truncates_and_catches_up(group):
    """Regression (docker drill disk_full): a live master holding a tail its slave never got is
    cut off from the controller, steps down, the slave is elected, and the old master follows
    it in the same process (no restart). It must cut that tail durably, then ack new writes
    and hold exactly the new master's committed bytes; it used to stall silently instead."""
    g = group
    proxy = FaultProxy(g.ctl_api)
    try:
        g.controller_addr[0] = f"127.0.0.1:{proxy.port}"   # only broker 0 reaches the controller through it
        # A longer controller heartbeat timeout (the lease stays at 2 s): the master steps down and
        # the frozen slave is thawed before the controller would count the slave dead.
        g.ctl_heartbeat_timeout_ms = 8000
        _bring_up(g)
        acked = [i for i in range(20) if g.send(0, i) == "SEND_OK"]
        assert len(acked) == 20
        pid0 = g.procs["b0"].pid
        # The slave freezes; the master stores an 8 MiB tail nobody acks. Loopback buffers hold
        # only part of it, and the rest never leaves the master once it stops its HA service.
        g.procs["b1"].sigstop()
        result: dict = {}
        filler = "y" * 200_000

        def write_tail() -> None:
            result["r"] = http("POST", g.url(0, f"/topics/{TOPIC}/messages"),
                               {"messages": [{"body": f"t{i:06d}{filler}", "queue_id": 0} for i in range(40)]
                                + [{"body": "m001000", "queue_id": 0}]}, timeout=30)
        writer = threading.Thread(target=write_tail, daemon=True)
        writer.start()
        time.sleep(0.4)
        proxy.partition()   # the master loses the controller and lives on
        wait_for(lambda: g.health(0).get("role") == "SLAVE", timeout=6, what="cut-off master steps down")
        g.procs["b1"].cont()
        writer.join(30)
        st, r = result["r"]
        assert st != 200 or "SEND_OK" not in {x["status"] for x in r["results"]}, r
        g.wait_role(1, "MASTER", timeout=20)
        wait_for(lambda: g.send(1, 2000) in ("SEND_OK", "SLAVE_NOT_AVAILABLE"), timeout=10,
                 what="first write on the new master")
        proxy.heal()
        wait_for(lambda: g.health(0).get("leader") == f"127.0.0.1:{g.api[1]}", timeout=20,
                 what="old master follows the new one")
        # Naming the new master comes before the truncation and the HA connection; until the old
        # master is connected and caught up, SYNC_MASTER answers SLAVE_NOT_AVAILABLE, as it should.
        wait_for(lambda: sorted(g.sss().get("sync_state_set", [])) == [0, 1], timeout=20,
                 what="old master back in the SyncStateSet")
        sent = {i: g.send(1, i) for i in range(3000, 3020)}
        more = [i for i, status in sent.items() if status == "SEND_OK"]
        assert len(more) == 20, ("the old master, now a slave, must ack the new master's writes", sent)
        wait_for(lambda: g.health(0)["committed_offset"] == g.health(1)["committed_offset"], timeout=20,
                 what="old master caught up")
        assert g.procs["b0"].pid == pid0, "the old master must follow in-process, not by a restart"
        log0 = open(os.path.join(g.tmp, "b0.log")).read()
        assert "truncated commitlog" in log0, "the old master had an unreplicated tail to cut"
        on_old = wait_for(lambda: (lambda b: b if b == g.bodies(1) else None)(g.bodies(0)), what="same messages")
        missing = [i for i in acked + more + [2000] if f"m{i:06d}" not in on_old]
        assert not missing, (missing, [b[:7] for b in on_old])
        assert "m001000" not in on_old
        end = g.health(1)["committed_offset"]
        assert _commitlog_bytes(os.path.join(g.tmp, "store0"), end) == \
            _commitlog_bytes(os.path.join(g.tmp, "store1"), end), "committed bytes differ"
    finally:
        proxy.close()


def test_a_slave_without_slave_read_enable_sends_pulls_to_the_master(group):
    """slaveReadEnable=false (RocketMQ's default): the slave answers a pull with NOT_LEADER
    naming the master, and the SDK, given only the slave's address, reads from the master.
    Before, the key was read and ignored: a slave served every pull."""
    g = group
    g.extra_lines[1] = ["slaveReadEnable=false"]
    _bring_up(g)
    assert [g.send(0, i) for i in range(3)] == ["SEND_OK"] * 3
    st, r = http("GET", g.url(1, f"/topics/{TOPIC}/queues/0/messages?offset=0&max=8"))
    assert st == 421 and r["error"] == "NOT_LEADER" and r["leader"] == f"127.0.0.1:{g.api[0]}", (st, r)
    assert "slaveReadEnable=false" in r["message"]
    st, r = http("GET", g.url(0, f"/topics/{TOPIC}/queues/0/messages?offset=0&max=8"))
    assert st == 200 and [m["body"] for m in r["messages"]] == ["m000000", "m000001", "m000002"]

    async def pull_through_the_slave() -> list[str]:
        from mqstore.client import AsyncPullConsumer
        async with AsyncPullConsumer("G", brokers=f"127.0.0.1:{g.api[1]}") as pc:
            (mq,) = [q for q in await pc.fetch_queues(TOPIC) if q.queue_id == 0]
            return [m.body.decode() for m in (await pc.pull(mq, 0, 8)).messages]
    assert asyncio.run(pull_through_the_slave()) == ["m000000", "m000001", "m000002"]


def test_consumer_offsets_and_topic_config_reach_the_slave(group):
    g = group
    _bring_up(g)
    st, r = http("POST", g.url(0, "/topics"), {"topic": "CfgTopic", "queues": 3})
    assert st in (200, 201), r
    assert g.send(0, 1) == "SEND_OK"
    st, r = http("POST", g.url(0, "/groups/cg1/offsets"), {"topic": TOPIC, "queue_id": 0, "offset": 1})
    assert st == 200 and r["status"] == "SEND_OK", r      # the slave acked it (SYNC_MASTER)

    def on_slave():
        st1, topics = http("GET", g.url(1, "/topics"))
        st2, offs = http("GET", g.url(1, f"/groups/cg1/offsets?topic={TOPIC}"))
        names = {t["topic"]: t for t in topics.get("topics", [])} if st1 == 200 else {}
        rows = offs.get("offsets", []) if st2 == 200 else []
        return (names, rows) if "CfgTopic" in names and rows else None
    names, rows = wait_for(on_slave, timeout=20, what="topic config and offsets on the slave")
    assert names["CfgTopic"]["read_queue_nums"] == 3, names["CfgTopic"]
    assert rows == [{"topic": TOPIC, "queue_id": 0, "offset": 1}], rows

    # A topic held by the controller: its perm, changed there, reaches master and slave
    # (regression: only topic creation and growth were pushed).
    ctl = f"http://127.0.0.1:{g.ctl_api}/topics"
    st, r = http("POST", ctl, {"topic": "CtlPerm", "queues": 2, "perm": 6})
    assert st == 201, r
    wait_for(lambda: g.send_to(0, "CtlPerm") == "SEND_OK", timeout=15, what="CtlPerm writable on the master")
    st, r = http("POST", ctl, {"topic": "CtlPerm", "queues": 2, "perm": 4})
    assert st == 201, r

    def perm_of(b: int) -> int | None:
        st, topics = http("GET", g.url(b, "/topics"), timeout=2)
        return {t["topic"]: t["perm"] for t in topics.get("topics", [])}.get("CtlPerm") if st == 200 else None
    wait_for(lambda: perm_of(0) == 4 and perm_of(1) == 4, timeout=15, what="read-only perm on master and slave")
    st, r = http("POST", g.url(0, "/topics/CtlPerm/messages"), {"messages": [{"body": "x", "queue_id": 0}]})
    assert st == 403 and r["error"] == "NO_PERMISSION", (st, r)


def _cli(*args: str) -> str:
    import io
    from mqstore import cli
    out = io.StringIO()
    assert cli.main(list(args), out=out) == 0, args
    return out.getvalue()


def test_admin_verbs_against_running_group(group):
    g = group
    _bring_up(g)
    assert g.send(0, 1) == "SEND_OK"
    ctl = f"127.0.0.1:{g.ctl_api}"
    text = _cli("haStatus", "-n", f"127.0.0.1:{g.api[0]}")
    print("\n" + text)
    assert f"#MasterAddr\t127.0.0.1:{g.api[0]}\n" in text and "#SlaveNum\t1\n#InSyncSlaveNum\t1\n" in text
    assert "#SlaveAckOffset" in text and " OK " in text
    text = _cli("haStatus", "-n", f"127.0.0.1:{g.api[1]}")
    print(text)
    assert f"#MasterAddr\t127.0.0.1:{g.api[0]}\n#CommitLogMaxOffset\t" in text
    text = _cli("getSyncStateSet", "-a", ctl, "-b", "broker-b")
    print(text)
    assert "#brokerName\tbroker-b\n" in text and "#SyncStateSetNums\t2\n" in text
    assert text.count("InSyncReplica:") == 2 and "NotInSyncReplica" not in text
    text = _cli("electMaster", "-a", ctl, "-b", "broker-b", "-i", "1")
    print(text)
    assert f"#BrokerMasterAddr\t127.0.0.1:{g.api[1]}" in text
    g.wait_role(1, "MASTER", timeout=15)
    g.wait_role(0, "SLAVE", timeout=15)
    wait_for(lambda: g.send(1, 2) == "SEND_OK", timeout=15, what="new master acked by its slave")
    doc = json.loads(_cli("haStatus", "-n", f"127.0.0.1:{g.api[1]}", "--json"))
    assert doc["master"] and doc["slave_num"] == 1
    assert "#ControllerLeaderAddress\t" + ctl in _cli("getControllerMetaData", "-a", ctl)
