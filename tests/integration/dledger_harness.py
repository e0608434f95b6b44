"""Real DLedger node processes on loopback, a recorded workload, and offline checks.

- `DLedgerCluster`: 3 `python -m node --config broker.conf` processes, configs as
  `mqstore.cluster.plan` writes them, on free ports, with every Raft link (one per ordered
  pair: a node only sends on its own outbound connection) passing through a
  `deploy.faultproxy` link named "n0>n1", so partitions can be set per direction.
- `Workload`: client threads sending unique single-message requests, following the
  NOT_LEADER hint, recording every attempt as acked / failed / unknown. Over HTTP, or with
  `stream_threads`, that many of the threads over the produce stream (the SDK's
  StreamConnection, `_StreamSends`: the path a DLedger leader answers from its Raft round):
    acked    200 + SEND_OK: the message must be committed at the acked (queue, offset)
    failed   the node said so before anything was proposed (NOT_LEADER without "unknown",
             a full disk's 507, connection refused): the message must never become visible
    unknown  timeout, reset after the request left, FLUSH_SLAVE_TIMEOUT, or an error that
             says the outcome is unknown: it may appear, at most once
  A retry after any outcome is a new message with a new body, so "exactly once" is checkable.
- `verify_stores`: after the processes are stopped, reads each replica's files:
  audit (pipeline.jobs.audit) plus raw byte equality of entries up to the lowest committed
  index, every acked message exactly once at its acked place, no failed message, queue
  offsets dense and unique, and consume queues equal to pipeline.jobs.rebuild of the log.
Every wait has a deadline; every loop a bound.

DLEDGER_NODE_WRAPPER=/path/script.py runs each node as `python script.py --config ...` instead
of `python -m node` (e.g. a script that dumps asyncio tasks on a signal, to debug a hang); a node
that ignores SIGTERM then gets SIGUSR1 before the test fails.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
from dataclasses import dataclass, field

from deploy.faultproxy import ProxyHub
from mqstore import localcluster as lc
from mqstore.client.stream import StreamConnection, StreamRefused
from mqstore.cluster import plan
from mqstore.localcluster import free_ports
from mqstore.localcluster import get_ok as try_http
from node.store import layout as L
from tests.integration.slowsync import SlowSync
from tests.integration.small_disk import SmallDisk
from tests.integration.wallclock import WallClock

GROUP = "broker-a"
SEGMENT_BYTES = 256 * 1024          # small data segments: rolls and blanks happen during the run
CQ_UNITS_PER_FILE = 300             # small consume-queue files, as the rebuild must be told
SMALL_FILES = ("maxMessageSize=65536", f"mappedFileSizeCommitLog={SEGMENT_BYTES}",
               f"mapedFileSizeConsumeQueue={CQ_UNITS_PER_FILE * 20}", "maxHashSlotNum=1000", "maxIndexNum=4000",
               "bindAddress=127.0.0.1", "syncFlushTimeout=3000")


def http(addr: str, method: str, path: str, doc=None, timeout: float = 3.0):
    """(status, document); raises OSError / urllib.error.URLError on transport failures."""
    return lc.http(addr, method, path, doc, timeout)


# --- processes -----------------------------------------------------------------------------------
class NodeProc(lc.NodeProc):
    def __init__(self, node_id: str, api_port: int, raft_port: int, conf: str, store_dir: str, log_path: str):
        super().__init__(conf, api_port, log_path, node_id)
        self.node_id, self.api_port, self.raft_port, self.store_dir = node_id, api_port, raft_port, store_dir
        if os.environ.get("DLEDGER_NODE_WRAPPER"):
            self.argv = [sys.executable, os.environ["DLEDGER_NODE_WRAPPER"], "--config", conf]

    @property
    def api(self) -> str:
        return self.addr

    def start(self) -> None:
        """Spawn only; the cluster waits for /health."""
        self.launch()

    def terminate(self, timeout_s: float = 20.0) -> int:
        try:
            return super().terminate(timeout_s)
        except subprocess.TimeoutExpired:
            if os.environ.get("DLEDGER_NODE_WRAPPER"):
                self.proc.send_signal(signal.SIGUSR1)
                time.sleep(1)
            raise

    def tail(self, n: int = 4000) -> str:
        return super().tail(n)


class DLedgerCluster:
    """Three DLedger nodes whose Raft links all pass through a fault proxy."""

    def __init__(self, root: str, ids: tuple[str, ...] = ("n0", "n1", "n2"), extra_conf: tuple[str, ...] = (),
                 disk_mib: int | None = None, wall_clock: bool = False, slow_sync: bool = False):
        self.root = root
        self.ids = ids
        # With `wall_clock`, each node's CLOCK_REALTIME can be stepped (tests/integration/wallclock.py).
        self.clock = WallClock(os.path.join(root, "wallclock")) if wall_clock else None
        # With `slow_sync`, each node's fsyncs can be made to wait (tests/integration/slowsync.py).
        self.syncs = SlowSync(os.path.join(root, "slowsync")) if slow_sync else None
        self.hub = ProxyHub()
        ports = free_ports(3 * len(ids))
        api = dict(zip(ids, ports[:len(ids)]))
        raft = dict(zip(ids, ports[len(ids):2 * len(ids)]))
        # Every port free, none of plan()'s fixed ones: a group here must not collide with
        # `make run` or with another test's group on this machine.
        stream = dict(zip(ids, ports[2 * len(ids):]))
        self.stream_ports = {f"127.0.0.1:{api[i]}": stream[i] for i in ids}     # by node API address
        # mqstore.cluster.plan writes the configs `mqstore cluster up` uses; ports are ours.
        specs = plan(root, "dledger", len(ids), 10911)
        self.links: dict[tuple[str, str], int] = {}
        for src in ids:
            for dst in ids:
                if src != dst:
                    self.links[(src, dst)] = self.hub.add(f"{src}>{dst}", ("127.0.0.1", raft[dst]))
        self.nodes: dict[str, NodeProc] = {}
        for s in specs:
            assert s.node_id in ids
            peers = ";".join(f"{d}-127.0.0.1:{raft[d] if d == s.node_id else self.links[(s.node_id, d)]}"
                             for d in ids)
            apis = ";".join(f"{d}-127.0.0.1:{api[d]}" for d in ids)
            _rewrite_conf(s.config_path, {"listenPort": str(api[s.node_id]), "dLegerPeers": peers,
                                          "dLegerPeerApis": apis, "streamListenPort": str(stream[s.node_id])},
                          SMALL_FILES + tuple(extra_conf))
            self.nodes[s.node_id] = NodeProc(s.node_id, api[s.node_id], raft[s.node_id], s.config_path,
                                             s.store_dir, s.log_path)
            if self.clock is not None:
                self.clock.attach(s.node_id, self.nodes[s.node_id])
            if self.syncs is not None:
                self.syncs.attach(s.node_id, self.nodes[s.node_id])
        # With `disk_mib`, each store is a file system of its own that a test can fill (small_disk).
        self.disks: dict[str, SmallDisk] = {}
        try:
            for s in specs if disk_mib else ():
                self.disks[s.node_id] = SmallDisk(s.store_dir, disk_mib).mount()
        except BaseException:
            self.close()
            raise

    @property
    def apis(self) -> list[str]:
        return [n.api for n in self.nodes.values()]

    def data_dir(self, node_id: str) -> str:
        """Where the node's log keeps its data files."""
        return os.path.join(self.nodes[node_id].store_dir, f"dledger-{node_id}", "data")

    def stream_port(self, api: str) -> int:
        """The produce stream's port of the node at API address `api`."""
        return self.stream_ports[api]

    def start(self, timeout_s: float = 30.0) -> None:
        for n in self.nodes.values():
            n.start()
        self.wait_healthy(list(self.nodes), timeout_s)

    def wait_healthy(self, ids: list[str], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        for i in ids:
            n = self.nodes[i]
            while try_http(n.api, "/health") is None:
                if not n.running:
                    raise AssertionError(f"{i} exited with {n.proc.returncode}:\n{n.tail()}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"{i} not healthy in {timeout_s} s:\n{n.tail()}")
                time.sleep(0.05)

    def leader(self, timeout_s: float = 15.0, exclude: tuple[str, ...] = ()) -> str:
        """The node id of a writable leader (waits for one)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for i, n in self.nodes.items():
                if i in exclude or not n.running or n.stopped:
                    continue
                doc = try_http(n.api, "/cluster", 0.5)
                if doc and doc.get("role") == "LEADER" and doc.get("log", {}).get("writable"):
                    return i
            time.sleep(0.05)
        raise AssertionError("no writable leader in time:\n" + self.describe())

    def describe(self) -> str:
        out = []
        for i, n in self.nodes.items():
            doc = try_http(n.api, "/cluster", 0.5) if n.running and not n.stopped else None
            st = (doc or {}).get("log", {})
            out.append(f"{i}: running={n.running} stopped={n.stopped} role={st.get('role')} term={st.get('term')} "
                       f"commit={st.get('commit_index')} last={st.get('last_index')} leader={st.get('leader')}")
        return "\n".join(out)

    def wait_converged(self, timeout_s: float = 20.0) -> int:
        """All nodes up, one leader, the same commit and last index everywhere and nothing pending."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            docs = [try_http(n.api, "/cluster", 0.5) for n in self.nodes.values()]
            if all(docs):
                logs = [d["log"] for d in docs]
                commits = {lg.get("commit_index") for lg in logs}
                lasts = {lg.get("last_index") for lg in logs}
                applied = {lg.get("applied_index") for lg in logs}
                leaders = [lg for lg in logs if lg.get("role") == "LEADER"]
                if len(commits) == 1 and commits == lasts == applied and len(leaders) == 1 \
                        and not any(lg.get("pending_appends") for lg in logs) \
                        and not any(d.get("dispatch_behind_bytes") for d in docs):
                    return commits.pop()
            time.sleep(0.1)
        raise AssertionError("replicas did not converge:\n" + self.describe())

    # --- faults ---------------------------------------------------------------------------
    def isolate(self, node_id: str, mode: str = "blackhole", way: str = "both") -> None:
        """Cut node_id's Raft links: "out" (what it sends), "in" (what it receives) or "both"."""
        if way not in ("in", "out", "both"):
            raise ValueError(f"way must be in, out or both, got {way!r}")
        if way in ("out", "both"):
            self.hub.set(f"{node_id}>*", "both", mode)
        if way in ("in", "both"):
            self.hub.set(f"*>{node_id}", "both", mode)

    def heal(self) -> None:
        self.hub.heal("*")

    def stop_all(self, sig: str = "TERM") -> dict[str, int]:
        codes = {}
        for i, n in self.nodes.items():
            if n.proc is None:
                continue
            if sig == "KILL":
                if n.stopped:
                    n.cont()
                n.kill9()
                codes[i] = n.proc.returncode
            elif n.proc.poll() is None:
                codes[i] = n.terminate()
        return codes

    def close(self, keep_stores: bool = False) -> None:
        """Kill what still runs, close the proxy, unmount the small disks (their stores copied
        onto the directories underneath with `keep_stores`)."""
        for n in self.nodes.values():
            if n.proc is not None and n.proc.poll() is None:
                if n.stopped:
                    n.cont()
                n.kill9()
        self.hub.close()
        for disk in self.disks.values():
            disk.unmount(keep=keep_stores)


def _rewrite_conf(path: str, replace: dict[str, str], extra: tuple[str, ...]) -> None:
    with open(path) as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    seen = set()
    out = []
    for ln in lines:
        key = ln.split("=", 1)[0]
        if key in replace:
            out.append(f"{key}={replace[key]}")
            seen.add(key)
        else:
            out.append(ln)
    missing = set(replace) - seen
    assert not missing, f"plan() no longer writes {missing}"
    out.extend(extra)
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


# --- workload ------------------------------------------------------------------------------------
ACKED, FAILED, UNKNOWN = "acked", "failed", "unknown"


@dataclass
class Attempt:
    body: str
    queue_id: int
    node: str
    start: float
    end: float = 0.0
    outcome: str = UNKNOWN
    queue_offset: int | None = None
    commitlog_offset: int | None = None
    detail: str = ""

    @property
    def transport(self) -> str:
        """How it was sent: a produce-stream thread names its bodies "s<thread>-<seq>"."""
        return "stream" if self.body.startswith("s") else "http"


class _NotSent(Exception):
    """The produce stream could not be opened: the request never left."""


class _StreamSends:
    """One workload thread's produce streams: a StreamConnection per node, on an event loop
    of the thread's own, one request at a time (bounded by the request timeout)."""

    def __init__(self, cluster: DLedgerCluster, timeout_s: float):
        self.cluster, self.timeout_s = cluster, timeout_s
        self.loop = asyncio.new_event_loop()
        self.conns: dict[str, StreamConnection] = {}

    def send(self, api: str, topic: str, doc: dict) -> tuple[int, dict]:
        return self.loop.run_until_complete(self._send(api, topic, doc))

    async def _send(self, api: str, topic: str, doc: dict) -> tuple[int, dict]:
        conn = self.conns.get(api)
        if conn is None or conn.closed:
            try:
                conn = self.conns[api] = await StreamConnection.open("127.0.0.1", self.cluster.stream_port(api),
                                                                     timeout_s=self.timeout_s)
            except (OSError, asyncio.TimeoutError, StreamRefused) as e:
                self.conns.pop(api, None)
                raise _NotSent(f"{type(e).__name__}: {e}") from e
        try:
            return await conn.send(topic, doc, self.timeout_s)
        except BaseException:
            conn.close()                 # a late answer must not meet the next request
            self.conns.pop(api, None)
            raise

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.loop.run_until_complete(asyncio.sleep(0))     # let the transports close
        self.loop.close()


@dataclass
class Workload:
    """Client threads sending unique messages until stopped (bounded by max_attempts and max_s)."""

    cluster: DLedgerCluster
    topic: str = "Chaos"
    queues: int = 4
    threads: int = 3
    stream_threads: int = 0        # the last this many threads send over the produce stream
    request_timeout_s: float = 2.0
    max_attempts: int = 20_000
    max_s: float = 120.0
    attempts: list[Attempt] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)

    def create_topic(self) -> None:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            leader = self.cluster.nodes[self.cluster.leader()]
            status, doc = http(leader.api, "POST", "/topics", {"topic": self.topic, "queues": self.queues})
            if status == 200:
                return
            time.sleep(0.1)
        raise AssertionError(f"could not create {self.topic}: {doc}")

    def start(self) -> None:
        self._t0 = time.monotonic()
        for t in range(self.threads):
            w = threading.Thread(target=self._run, args=(t,), name=f"workload-{t}", daemon=True)
            self._workers.append(w)
            w.start()

    def halt(self) -> None:
        """Ask the threads to stop; do not wait (teardown after a failure)."""
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        for w in self._workers:
            w.join(self.request_timeout_s + 5)
            assert not w.is_alive(), "a workload thread did not stop"

    def _run(self, t: int) -> None:
        streams = _StreamSends(self.cluster, self.request_timeout_s) if t >= self.threads - self.stream_threads else None
        try:
            self._sends(t, streams)
        finally:
            if streams is not None:
                streams.close()

    def _sends(self, t: int, streams: "_StreamSends | None") -> None:
        apis = self.cluster.apis
        by_api = {n.api: i for i, n in self.cluster.nodes.items()}
        current = t % len(apis)
        seq = 0
        while not self._stop.is_set() and time.monotonic() - self._t0 < self.max_s:
            with self._lock:
                if len(self.attempts) >= self.max_attempts:
                    return
            qid = seq % self.queues
            a = Attempt(f"{'s' if streams else 'w'}{t}-{seq}", qid, by_api[apis[current]], time.monotonic())
            seq += 1
            hint = self._send(apis[current], a) if streams is None else self._send_stream(streams, apis[current], a)
            a.end = time.monotonic()
            with self._lock:
                self.attempts.append(a)
            if a.outcome == ACKED:
                continue
            if hint in apis and hint != apis[current]:
                current = apis.index(hint)
            else:
                current = (current + 1) % len(apis)
                time.sleep(0.02)   # nobody knows the leader yet: do not spin

    def _send(self, api: str, a: Attempt) -> str | None:
        """Send one message; classify the attempt; return the leader hint, if any."""
        msg = {"messages": [{"body": a.body, "queue_id": a.queue_id, "keys": a.body}]}
        try:
            status, doc = http(api, "POST", f"/topics/{self.topic}/messages", msg, self.request_timeout_s)
        except urllib.error.URLError as e:
            refused = isinstance(e.reason, ConnectionRefusedError)
            a.outcome, a.detail = (FAILED if refused else UNKNOWN), f"url error: {e.reason}"
            return None
        except (ConnectionRefusedError,) as e:
            a.outcome, a.detail = FAILED, f"refused: {e}"
            return None
        except (OSError, ValueError) as e:      # timeout, reset, broken pipe, half-read reply
            a.outcome, a.detail = UNKNOWN, f"transport: {type(e).__name__}: {e}"
            return None
        return self._classify(a, status, doc)

    def _send_stream(self, streams: "_StreamSends", api: str, a: Attempt) -> str | None:
        """`_send` over the node's produce stream: the same classes from the same answers."""
        msg = {"messages": [{"body": a.body, "queue_id": a.queue_id, "keys": a.body}]}
        try:
            status, doc = streams.send(api, self.topic, msg)
        except _NotSent as e:                   # no connection, or refused at HELLO: nothing left
            a.outcome, a.detail = FAILED, f"stream not open: {e}"
            return None
        except (OSError, asyncio.TimeoutError) as e:   # lost or timed out after the request left
            a.outcome, a.detail = UNKNOWN, f"stream: {type(e).__name__}: {e}"
            return None
        return self._classify(a, status, doc)

    def _classify(self, a: Attempt, status: int, doc: dict) -> str | None:
        if status == 200:
            r = doc["results"][0]
            if r["status"] == "SEND_OK":
                a.outcome, a.queue_offset = ACKED, r["queue_offset"]
                a.commitlog_offset = int(r["offset_msg_id"][16:], 16)
                assert r["queue_id"] == a.queue_id, (r, a)
            else:
                a.outcome, a.detail = UNKNOWN, r["status"]
            return None
        err, message = doc.get("error"), str(doc.get("message", ""))
        a.detail = f"{status} {err}: {message[:160]}"
        if (err == "NOT_LEADER" and "unknown" not in message) or (status == 507 and err == "SERVICE_NOT_AVAILABLE"):
            a.outcome = FAILED      # refused before anything was proposed or written (a full disk: DiskFull)
        else:
            a.outcome = UNKNOWN
        return doc.get("leader")

    # --- views ------------------------------------------------------------------------------
    def snapshot(self, since: int = 0) -> list[Attempt]:
        """The attempts recorded so far (from the `since`-th on); each is final once recorded."""
        with self._lock:
            return self.attempts[since:]

    def wait_acks(self, n: int, after: float = 0.0, timeout_s: float = 20.0) -> None:
        """Wait until n attempts that started at or after `after` are acked."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sum(1 for a in self.snapshot() if a.outcome == ACKED and a.start >= after) >= n:
                return
            time.sleep(0.05)
        raise AssertionError(f"fewer than {n} acks after t={after:.2f} in {timeout_s} s:\n"
                             + self.cluster.describe() + "\n" + self.summary())

    def acked_by_transport(self, after: float = 0.0) -> dict[str, int]:
        """Acked attempts started at or after `after`, for each transport some thread sends on."""
        used = (["http"] if self.threads > self.stream_threads else []) + (["stream"] if self.stream_threads else [])
        c = collections.Counter(a.transport for a in self.snapshot() if a.outcome == ACKED and a.start >= after)
        return {t: c[t] for t in used}

    def wait_each_transport_acks(self, after: float, timeout_s: float) -> dict[str, int]:
        """Wait until every transport in use has an ack of an attempt started at or after
        `after` (a stream thread may first sit out a timeout on a stopped node); the counts."""
        deadline = time.monotonic() + timeout_s
        while not all((got := self.acked_by_transport(after)).values()):
            assert time.monotonic() < deadline, \
                f"a transport acked nothing sent after t={after:.2f} in {timeout_s} s: {got}\n{self.summary()}"
            time.sleep(0.05)
        return got

    def failover_s(self, fault_at: float) -> float | None:
        """Fault -> first ack of a request sent at or after the fault."""
        acks = [a.end for a in self.snapshot() if a.outcome == ACKED and a.start >= fault_at]
        return (min(acks) - fault_at) if acks else None

    def summary(self) -> str:
        c = collections.Counter(a.outcome for a in self.snapshot())
        details = collections.Counter(a.detail.split(":")[0] for a in self.snapshot() if a.outcome != ACKED)
        return f"outcomes {dict(c)}; non-acks by kind {dict(details.most_common(6))}"


class Poller:
    """`poll()` every `period_s` on a daemon thread, until stopped or until it returns False."""

    def __init__(self, name: str, period_s: float, join_s: float = 5.0):
        self.period_s, self._join_s = period_s, join_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def halt(self) -> None:
        """Ask the thread to stop; do not wait (teardown after a failure)."""
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self._join_s)
        assert not self._thread.is_alive(), f"{self._thread.name} did not stop"

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            if self.poll() is False:
                return

    def poll(self) -> bool | None:
        raise NotImplementedError


class OffsetCommits(Poller):
    """A thread committing one consumer group's offsets on the workload's topic throughout the
    run (POST /groups/{group}/offsets to whoever leads, following NOT_LEADER hints): each commit
    is the next offset past a queue's newest acked message, so per queue the values only grow.
    A 200 answer means the commit went through the log and was applied: it must survive every
    fault. `check(store_dir)`: the stopped replica's consumerOffset.json holds, per queue, a
    value that was committed at or after the last acked commit (never an older one, never one
    nobody sent)."""

    def __init__(self, cluster, workload: Workload, group: str = "NemesisGroup", period_s: float = 0.05,
                 max_commits: int = 20_000, max_s: float = 600.0, request_timeout_s: float = 2.0):
        super().__init__("offset-commits", period_s, request_timeout_s + 5)
        self.cluster, self.workload, self.group = cluster, workload, group
        self.max_commits, self.max_s, self.timeout_s = max_commits, max_s, request_timeout_s
        self.sent: dict[int, list[tuple[int, bool]]] = collections.defaultdict(list)   # queue -> (offset, acked)
        self._top: dict[int, int] = {}      # queue -> one past its newest acked message, so far
        self._scanned = 0                   # workload attempts folded into _top
        self._current = self._n = 0
        self._t0 = time.monotonic()

    def acked(self) -> int:
        return sum(ok for rows in self.sent.values() for _, ok in rows)

    def _targets(self) -> dict[int, int]:
        new = self.workload.snapshot(self._scanned)
        self._scanned += len(new)
        top = self._top
        for a in new:
            if a.outcome == ACKED and a.queue_offset is not None and a.queue_offset + 1 > top.get(a.queue_id, 0):
                top[a.queue_id] = a.queue_offset + 1
        return top

    def poll(self) -> bool | None:
        if self._n >= self.max_commits or time.monotonic() - self._t0 >= self.max_s:
            return False
        due = [(q, off) for q, off in sorted(self._targets().items())
               if not self.sent[q] or off > self.sent[q][-1][0]]
        if not due:
            return None
        apis = self.cluster.apis
        q, off = due[self._n % len(due)]
        self._n += 1
        doc = {"topic": self.workload.topic, "queue_id": q, "offset": off}
        try:
            status, answer = http(apis[self._current], "POST", f"/groups/{self.group}/offsets", doc, self.timeout_s)
        except (OSError, ValueError):
            status, answer = 0, {}
        self.sent[q].append((off, status == 200))
        if status != 200:
            hint = answer.get("leader") if isinstance(answer, dict) else None
            self._current = apis.index(hint) if hint in apis else (self._current + 1) % len(apis)
        return None

    def check(self, store_dir: str) -> None:
        path = os.path.join(store_dir, "config", "consumerOffset.json")
        with open(path) as f:
            table = json.load(f)["offsetTable"].get(f"{self.workload.topic}@{self.group}", {})
        for q, rows in self.sent.items():
            acked_at = [i for i, (_, ok) in enumerate(rows) if ok]
            if not acked_at:
                continue
            stored = table.get(str(q))
            later = {off for off, _ in rows[acked_at[-1]:]}
            assert stored in later, (f"{store_dir}: queue {q} offset of {self.group} is {stored}; the last acked "
                                     f"commit was {rows[acked_at[-1]][0]}, later attempts {sorted(later)}")


# --- offline checks -----------------------------------------------------------------------------
ENTRY_HEADER_BYTES = L.ENTRY_HEADER.size   # a message's commitlog offset is its entry's pos + this


@dataclass
class ReplicaView:
    store_dir: str
    committed_index: int
    entries: dict            # index -> (term, pos, size)
    messages: list           # (index, topic, queue_id, queue_offset, commitlog_offset, body) committed, NORMAL

    @property
    def first_index(self) -> int:
        """The first entry the replica holds: 1, or past a retention cut (a full disk deletes
        the oldest files, as RocketMQ does above diskMaxUsedSpaceRatio)."""
        return min(self.entries) if self.entries else 1

    @property
    def min_offset(self) -> int:
        """The lowest commitlog offset (a body's start: entry pos + header) still held; 0 uncut."""
        first = self.first_index
        return self.entries[first][1] + ENTRY_HEADER_BYTES if first > 1 else 0


def read_replica(store_dir: str) -> ReplicaView:
    from pipeline import parsers as P
    from pipeline.source import committed_bound
    ci = committed_bound(store_dir, P.KIND_DLEDGER, None)
    assert ci is not None, f"{store_dir}: no committed index recorded"
    F, M = P.ENTRY_FIELD, P.MESSAGE_FIELD
    entries, messages = {}, []
    for seg in P.list_segments(store_dir):
        report = P.ParseReport()
        for e in P.parse_dledger_segment(seg.path, seg.base_offset, report=report):
            idx = e[F["index"]]
            entries[idx] = (e[F["term"]], e[F["pos"]], e[F["size"]])
            msg = e[-1]
            if msg is not None and idx <= ci:
                messages.append((idx, msg[M["topic"]], msg[M["queue_id"]], msg[M["queue_offset"]],
                                 msg[M["commitlog_offset"]], bytes(msg[M["body"]]).decode("utf-8", "replace")))
        assert report.end_reason != P.END_CORRUPT or report.last_index is None or report.last_index >= ci, \
            f"{seg.path}: corrupt inside the committed prefix: {report.__dict__}"
    return ReplicaView(store_dir, ci, entries, messages)


def _entry_bytes(store_dir: str, pos: int, size: int) -> bytes:
    from pipeline import parsers as P
    segs = P.list_segments(store_dir)
    seg = max((s for s in segs if s.base_offset <= pos), key=lambda s: s.base_offset)
    with open(seg.path, "rb") as f:
        f.seek(pos - seg.base_offset)
        return f.read(size)


def verify_stores(cluster: DLedgerCluster, attempts: list[Attempt], topic: str) -> dict:
    """All the after-healing checks over stopped replicas; returns figures for the report."""
    from pipeline.jobs import audit
    dirs = [n.store_dir for n in cluster.nodes.values()]
    result = audit(dirs)
    assert not result.committed_divergence and result.ok, f"audit: {result.as_dict()}"
    views = [read_replica(d) for d in dirs]
    low = min(v.committed_index for v in views)
    start = max(v.first_index for v in views)     # below it some replica cut its head (retention)
    # 1. committed prefixes are byte-identical (header, chain CRC and body: the raw entry bytes)
    for idx in range(start, low + 1):
        ref = views[0].entries.get(idx)
        assert ref is not None, f"{dirs[0]} lacks committed entry {idx}"
        for v in views[1:]:
            assert v.entries.get(idx) == ref, f"entry {idx}: {v.entries.get(idx)} vs {ref}"
    for idx in _sample(start, low):
        raw = [_entry_bytes(v.store_dir, *v.entries[idx][1:]) for v in views]
        assert len(set(raw)) == 1, f"entry {idx} differs in bytes between replicas"
    # 2. messages: acked exactly once at the acked place, failed never, unknown at most once
    #    (on a replica that cut its head, of what it still holds)
    for v in views:
        check_messages(v.store_dir, [m[1:] for m in v.messages if m[0] <= low], attempts, topic, v.min_offset)
    # 3. consume queues equal a rebuild from the committed log (the pipeline's rebuild)
    for v in views:
        compare_consume_queues(v.store_dir, v.committed_index, v.min_offset)
    acked = [a for a in attempts if a.outcome == ACKED]
    assert all(a.queue_offset is not None for a in acked)
    visible = {m[5] for m in views[0].messages if m[1] == topic}
    first = {os.path.basename(os.path.dirname(v.store_dir)): v.first_index for v in views}   # node id: first entry
    return {"committed_index": low, "acked": len(acked), "first_index": first,
            "failed": sum(1 for a in attempts if a.outcome == FAILED),
            "unknown": sum(1 for a in attempts if a.outcome == UNKNOWN),
            "unknown_visible": sum(1 for a in attempts if a.outcome == UNKNOWN and a.body in visible)}


def check_messages(where: str, rows: list[tuple], attempts: list[Attempt], topic: str, min_offset: int = 0) -> None:
    """One replica's stored messages, rows of (topic, queue_id, queue_offset, commitlog_offset,
    body), against the workload: every acked message exactly once at its acked place, no
    failed one, no message nobody sent, none twice, queue offsets dense and unique (from 0,
    or, when the replica's log starts at `min_offset` after a retention cut, from its first)."""
    by_body = {a.body: a for a in attempts}
    seen: dict[str, list[tuple]] = collections.defaultdict(list)
    per_queue: dict[int, list[int]] = collections.defaultdict(list)
    for t, qid, qoff, phys, body in rows:
        if t == topic:
            seen[body].append((qid, qoff, phys))
            per_queue[qid].append(qoff)
    dups = {b: p for b, p in seen.items() if len(p) > 1}
    assert not dups, f"{where}: messages stored more than once: {list(dups.items())[:5]}"
    stray = [b for b in seen if b not in by_body]
    assert not stray, f"{where}: messages nobody sent: {stray[:5]}"
    for qid, offs in per_queue.items():
        offs.sort()
        first = offs[0] if min_offset else 0
        assert offs == list(range(first, first + len(offs))), f"{where}: queue {qid} offsets not dense/unique"
    lost = [a for a in attempts
            if a.outcome == ACKED and a.commitlog_offset >= min_offset
            and seen.get(a.body) != [(a.queue_id, a.queue_offset, a.commitlog_offset)]]
    assert not lost, f"{where}: {len(lost)} acked messages missing or moved, e.g. " + \
        "; ".join(f"{a} stored as {seen.get(a.body)}" for a in lost[:3])
    visible = [(a, seen[a.body]) for a in attempts if a.outcome == FAILED and a.body in seen]
    assert not visible, f"{where}: failed sends visible: {visible[:3]}"


def _sample(first: int, last: int) -> list[int]:
    """Every index for small logs; otherwise a spread (the chain CRC already covers each entry)."""
    n = last - first + 1
    if n <= 4000:
        return list(range(first, last + 1))
    step = n // 4000 + 1
    return sorted(set(range(first, last + 1, step)) | {last})


def compare_consume_queues(store_dir: str, committed_index: int, min_offset: int = 0) -> None:
    """The node's consume queues equal a rebuild from its committed log; after a retention cut
    (`min_offset` > 0) unit by unit at each queue offset, for the messages the log still holds."""
    import tempfile

    from node.store.consume_queue import count_valid_units
    from pipeline.jobs import rebuild
    with tempfile.TemporaryDirectory(dir=os.path.dirname(store_dir)) as target:
        rebuild(store_dir, target, committed_index=committed_index, units_per_file=CQ_UNITS_PER_FILE,
                index_hash_slots=1000, index_max_entries=4000)
        if min_offset:
            mine_at = _units_at(os.path.join(store_dir, "consumequeue"), min_offset)
            built_at = _units_at(os.path.join(target, "consumequeue"), min_offset)
            assert mine_at == built_at, f"{store_dir}: consume queues past the cut differ from the rebuild: " + \
                str(sorted((q, len(mine_at.get(q, {})), len(built_at.get(q, {}))) for q in set(mine_at) | set(built_at)))
            return
        mine = _queue_units(os.path.join(store_dir, "consumequeue"), count_valid_units)
        built = _queue_units(os.path.join(target, "consumequeue"), count_valid_units)
    assert set(mine) == set(built), f"{store_dir}: queues {sorted(mine)} vs rebuilt {sorted(built)}"
    for q in mine:
        assert len(mine[q]) == len(built[q]), \
            f"{store_dir}: {q} has {len(mine[q]) // 20} units, rebuild {len(built[q]) // 20}"
        assert mine[q] == built[q], f"{store_dir}: {q} differs from the rebuild"


def _units_at(cq_root: str, min_offset: int) -> dict[str, dict[int, bytes]]:
    """queue -> {queue offset: unit} of the valid units pointing at or past `min_offset`."""
    out: dict[str, dict[int, bytes]] = {}
    if not os.path.isdir(cq_root):
        return out
    for topic in sorted(os.listdir(cq_root)):
        for qid in sorted(os.listdir(os.path.join(cq_root, topic))):
            d, units = os.path.join(cq_root, topic, qid), {}
            for name in sorted(os.listdir(d)):
                with open(os.path.join(d, name), "rb") as f:
                    raw = f.read()
                unit = L.CQ_UNIT.size
                for i in range(len(raw) // unit):
                    phys, size, _tags = L.CQ_UNIT.unpack_from(raw, i * unit)
                    if size > 0 and phys >= min_offset:
                        units[int(name) // unit + i] = raw[i * unit:(i + 1) * unit]
            if units:
                out[f"{topic}/{qid}"] = units
    return out


def _queue_units(cq_root: str, count_valid_units) -> dict[str, bytes]:
    out = {}
    if not os.path.isdir(cq_root):
        return out
    for topic in sorted(os.listdir(cq_root)):
        for qid in sorted(os.listdir(os.path.join(cq_root, topic))):
            d = os.path.join(cq_root, topic, qid)
            data = bytearray()
            for name in sorted(os.listdir(d)):
                with open(os.path.join(d, name), "rb") as f:
                    raw = f.read()
                n = count_valid_units(raw)
                data += raw[:n * 20]
                if n * 20 < len(raw):
                    break
            if data:
                out[f"{topic}/{qid}"] = bytes(data)
    return out
