"""DLedger 3-node benchmarks on real node processes (DESIGN sections 4 and 7).

    python -m bench.bench_dledger [--quick] [--only CASE,...]

Three `python -m node --config broker.conf` processes form one DLedger group on free
loopback ports, each with its own store under a temp dir (removed at the end). A client
in this process sends 1 KiB messages to the current leader on its produce stream (the SDK's
StreamConnection: pipelined SEND frames, node/produce_stream.py); every ASYNC_FLUSH case is
then run again over the HTTP API with msgpack bodies as `<case>_http`, which shows what one
HTTP request costs. Cases (each bounded in messages and seconds):

- async_batched     ASYNC_FLUSH, `BATCH` messages per request, `BATCH_CONNS` requests in flight
- per_message_256   ASYNC_FLUSH, one message per request, 256 requests in flight; on the stream
                    sent from one loop with done callbacks, as the NATS anchor's client does
- one_at_a_time     ASYNC_FLUSH, one message per request, one request in flight: p50/p99
- sync_flush_64     SYNC_FLUSH on every replica, 64 producers, `SYNC_BATCH` messages each
- failover          kill -9 of the leader -> first write acknowledged by the new leader;
                    the killed node is restarted and catches up before the next kill
- catch_up          a follower stopped while the leader takes `CATCH_UP_MIB` MiB, the leader's
                    commitlog then dropped from the page cache but for its newest 64 MiB
                    (posix_fadvise DONTNEED on our own descriptors; what coldReadHotBytes
                    takes as cached), the follower restarted: its catch-up in MB/s, and a
                    producer sending one at a time meanwhile (p50/p99/max against the same
                    producer just before, with every node up: `ratio_to_anchor`), and the
                    leader's event-loop stalls over loopStallWarnMs (200 ms) meanwhile (/metrics)

Anchors (bench/anchors.py, same run): NATS JetStream R3 async msgs/s and sync p99. Figures
follow bench_store.figure(): value, unit, target, anchor, ratio_to_anchor, meets_target.
The 1-minute load average is recorded with every figure: the machine is shared. Each load
case also reports `cpu_us_per_msg` (CPU time of every node process and of the client per
acknowledged message, from /proc): it moves far less with other load than msg/s does, and
comparing the per-request and batched cases shows what one HTTP request costs. From it
come `leader_one_core_msgs_s` (the leader's CPU per message on one free core) and
`group_all_cores_msgs_s` (the three nodes' CPU per message on all of this machine's cores),
and `nodes_sys_total`, the system part of the three nodes' CPU per message.
`page_cache_probe_start` / `_end` give what new page-cache pages cost this machine before and
after the cases (bench_store.page_cache_probe): every stored message lands in new pages on
each node, and on a VM that cost can change several-fold within one run.
A leader change during a case is followed (NOT_LEADER hint) and counted in `leader_changes`;
ERROR lines from the nodes' logs are attached as `node_errors_<flush>`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import msgpack
from prometheus_client.parser import text_string_to_metric_families

from bench.bench_store import figure, page_cache_probe, proc_user_sys_s
from mqstore import localcluster as lc
from mqstore.client.stream import StreamConnection
from mqstore.localcluster import free_ports

BODY_BYTES = 1024
TOPIC = "BenchTopic"
QUEUES = 8
MSGPACK = "application/x-msgpack"
BATCH = 256                 # messages per request, batched case
BATCH_CONNS = 4             # batched requests in flight
WINDOW = 256                # per-message case: requests in flight
SYNC_PRODUCERS = 64
SYNC_BATCH = 16             # messages per request from each SYNC_FLUSH producer
START_TIMEOUT_S = 30.0
LEADER_TIMEOUT_S = 15.0
FAILOVER_GIVE_UP_S = 15.0   # a kill with no acked write by then counts as this long
REQUEST_TIMEOUT_S = 10.0
CATCH_UP_MIB = 384          # > the leader's 64 MiB entry cache + coldReadHotBytes (64 MiB)
CATCH_UP_GIVE_UP_S = 180.0   # for the leader to take CATCH_UP_MIB, then for the follower to catch up
COLD_READ_HOT_BYTES = 64 << 20   # broker.conf coldReadHotBytes' default
# broker.conf peerPushThrottlePoint (its default, or as MQSTORE_peerPushThrottlePoint sets it for the nodes)
PEER_PUSH_THROTTLE_POINT = int(os.environ.get("MQSTORE_peerPushThrottlePoint", 300 << 20))
CASES = ("async_batched", "per_message_256", "one_at_a_time", "sync_flush_64", "failover", "catch_up")


class Node(lc.NodeProc):
    def __init__(self, node_id: str, api_port: int, raft_port: int, stream_port: int, config: Path, log: Path):
        super().__init__(str(config), api_port, str(log), node_id)
        self.node_id, self.api_port, self.raft_port, self.config, self.log = node_id, api_port, raft_port, config, log
        self.stream_port = stream_port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"


def load1() -> float:
    return round(os.getloadavg()[0], 2)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc), 0.0 if it is gone."""
    return sum(user_sys_seconds(pid))


def sys_seconds(pid: int) -> float:
    """System CPU time of a process so far, 0.0 if it is gone."""
    return user_sys_seconds(pid)[1]


def user_sys_seconds(pid: int) -> tuple[float, float]:
    try:
        return proc_user_sys_s(pid)
    except OSError:
        return 0.0, 0.0


class CpuMeter:
    """CPU microseconds per acknowledged message, per node role and for the client.

    Throughput on a shared 2-core machine moves with everyone else's load; the CPU each
    process spends per message moves much less, so it is the figure to compare runs by."""

    def __init__(self, cluster: "Cluster", leader: "Node"):
        self.procs = {("leader" if n is leader else f"follower_{n.node_id}"): n.proc.pid
                      for n in cluster.alive() if n.proc is not None}
        self.start = {k: cpu_seconds(p) for k, p in self.procs.items()}
        self.sys0 = {k: sys_seconds(p) for k, p in self.procs.items()}
        self.client0 = time.process_time()

    def per_msg_us(self, msgs: int) -> dict:
        if msgs <= 0:
            return {}
        out = {k: round((cpu_seconds(p) - self.start[k]) * 1e6 / msgs, 1) for k, p in self.procs.items()}
        nodes_us = sum(out.values())
        out["client"] = round((time.process_time() - self.client0) * 1e6 / msgs, 1)
        # What the CPU per message allows when the load is not shared with anyone else: the
        # leader alone on one core, and the whole group (3 nodes, no client) on this machine's cores.
        out["nodes_total"] = round(nodes_us, 1)
        # The system part carries new page-cache pages, whose cost can change within a run
        # (bench_store.page_cache_probe).
        out["nodes_sys_total"] = round(sum(sys_seconds(p) - self.sys0[k] for k, p in self.procs.items()) * 1e6 / msgs, 1)
        leader_us = out.get("leader") or 0.0
        out["leader_one_core_msgs_s"] = round(1e6 / leader_us) if leader_us else None
        out["group_all_cores_msgs_s"] = round((os.cpu_count() or 1) * 1e6 / nodes_us) if nodes_us else None
        return out


class Cluster:
    """Three node processes of one DLedger group; `stop()` ends exactly the ones started here."""

    def __init__(self, work: Path, flush: str):
        self.work = work
        ports = free_ports(9)
        self.nodes = [Node(f"n{i}", ports[i], ports[3 + i], ports[6 + i], work / f"n{i}" / "broker.conf",
                           work / f"n{i}" / "node.log") for i in range(3)]
        raft = {n.node_id: n.raft_port for n in self.nodes}
        api = {n.node_id: n.api_port for n in self.nodes}
        for n in self.nodes:
            lc.write_conf(str(n.config), lc.node_lines(n.api_port, str(n.config.parent / "store"), [
                "brokerClusterName=BenchCluster", "brokerName=bench-a", "brokerId=0", f"flushDiskType={flush}",
                "mappedFileSizeCommitLog=268435456", "autoCreateTopicEnable=true", "logLevel=WARNING",
                f"streamListenPort={n.stream_port}", *lc.dledger_lines(n.node_id, "bench-a", raft, api)]))

    def start_node(self, n: Node) -> None:
        n.launch()

    def start(self) -> None:
        for n in self.nodes:
            self.start_node(n)

    def kill9(self, n: Node) -> None:
        assert n.proc is not None
        n.kill9()

    def stop(self) -> None:
        for n in self.nodes:
            if n.running:
                n.proc.terminate()      # all at once, then wait: a group stops in one bound
        for n in self.nodes:
            n.stop(10)

    def alive(self) -> list[Node]:
        return [n for n in self.nodes if n.running]

    def tail(self, n: Node, chars: int = 800) -> str:
        return n.tail(chars)


# --- client ---------------------------------------------------------------------------------------
def batch_payload(n: int, first_queue: int = 0) -> bytes:
    body = os.urandom(BODY_BYTES)
    return msgpack.packb({"messages": [{"body": body, "queue_id": (first_queue + i) % QUEUES}
                                       for i in range(n)]}, use_bin_type=True)


async def health(session: aiohttp.ClientSession, n: Node, timeout: float = 1.0) -> dict | None:
    try:
        async with session.get(f"{n.url}/health", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return await r.json()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None


async def wait_healthy(session: aiohttp.ClientSession, cluster: Cluster, nodes: list[Node]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    for n in nodes:
        while await health(session, n) is None:
            if n.proc is not None and n.proc.poll() is not None:
                raise RuntimeError(f"node {n.node_id} exited: {cluster.tail(n)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {n.node_id} not healthy in {START_TIMEOUT_S} s: {cluster.tail(n)}")
            await asyncio.sleep(0.1)


async def find_leader(session: aiohttp.ClientSession, cluster: Cluster, timeout: float = LEADER_TIMEOUT_S) -> Node:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for n in cluster.alive():
            h = await health(session, n, 0.5)
            if h and h.get("role") == "LEADER":
                return n
        await asyncio.sleep(0.05)
    raise RuntimeError("no DLedger leader elected")


class NotLeaderAnswer(RuntimeError):
    def __init__(self, leader: str | None, text: str):
        super().__init__(text)
        self.leader = leader


async def send(session: aiohttp.ClientSession, url: str, payload: bytes, timeout: float = REQUEST_TIMEOUT_S) -> int:
    """POST one batch; the number of SEND_OK results (raises on any other answer)."""
    async with session.post(url, data=payload, headers={"Content-Type": MSGPACK, "Accept": MSGPACK},
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        raw = await r.read()
        if r.status == 421:
            try:
                hint = msgpack.unpackb(raw, raw=False).get("leader")
            except (ValueError, msgpack.UnpackException, AttributeError):
                hint = None
            raise NotLeaderAnswer(hint, f"HTTP 421: {raw[:300]!r}")
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {raw[:300]!r}")
    results = msgpack.unpackb(raw, raw=False)["results"]
    ok = sum(1 for x in results if x["status"] == "SEND_OK")
    if ok != len(results):
        raise RuntimeError(f"{len(results) - ok} of {len(results)} not SEND_OK: {results[0]}")
    return ok


def batch_doc(n: int, first_queue: int = 0) -> dict:
    body = os.urandom(BODY_BYTES)
    return {"messages": [{"body": body, "queue_id": (first_queue + i) % QUEUES} for i in range(n)]}


def count_ok(results: list[dict]) -> int:
    ok = sum(1 for x in results if x["status"] == "SEND_OK")
    if ok != len(results):
        raise RuntimeError(f"{len(results) - ok} of {len(results)} not SEND_OK: {results[0]}")
    return ok


class HttpSender:
    """POST /topics/{TOPIC}/messages with msgpack bodies to the leader."""
    transport = "http"

    def __init__(self, session: aiohttp.ClientSession, cluster: Cluster, leader: Node):
        self.session, self.url = session, f"{leader.url}/topics/{TOPIC}/messages"

    def payload(self, n: int) -> bytes:
        return batch_payload(n)

    async def send(self, payload: bytes) -> int:
        return await send(self.session, self.url, payload)

    async def retarget(self, api_addr: str) -> bool:
        new = f"http://{api_addr}/topics/{TOPIC}/messages"
        changed, self.url = new != self.url, new
        return changed

    def close(self) -> None:
        pass


class StreamSender:
    """SEND frames on the leader's produce stream (the SDK's StreamConnection), answers pipelined."""
    transport = "stream"

    def __init__(self, session: aiohttp.ClientSession, cluster: Cluster, leader: Node):
        self.cluster, self.node = cluster, leader
        self.conn: StreamConnection | None = None
        self._lock = asyncio.Lock()

    def payload(self, n: int) -> dict:
        return batch_doc(n)

    async def _conn(self) -> StreamConnection:
        if self.conn is None or self.conn.closed:
            async with self._lock:
                if self.conn is None or self.conn.closed:
                    self.conn = await StreamConnection.open("127.0.0.1", self.node.stream_port)
        return self.conn

    async def send(self, doc: dict) -> int:
        conn = self.conn
        if conn is None or conn.closed:
            conn = await self._conn()
        status, answer = await conn.send(TOPIC, doc, REQUEST_TIMEOUT_S)
        if status == 421:
            raise NotLeaderAnswer(answer.get("leader"), f"NOT_LEADER: {answer.get('message')}")
        if status != 200:
            raise RuntimeError(f"{status}: {answer}")
        return count_ok(answer["results"])

    async def retarget(self, api_addr: str) -> bool:
        node = next((n for n in self.cluster.nodes if f"127.0.0.1:{n.api_port}" == api_addr), None)
        if node is None or node is self.node:
            return False
        self.node = node
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        return True

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


SENDERS = {"stream": StreamSender, "http": HttpSender}


async def load(sender, payload, per_request: int, inflight: int,
               seconds: float, max_msgs: int, latencies: list[float] | None = None) -> dict:
    """`inflight` workers sending `payload` until `seconds` or `max_msgs` have passed."""
    state = {"acked": 0, "sent": 0, "errors": 0, "first_error": None, "leader_changes": 0}
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline and state["sent"] + per_request <= max_msgs:
            state["sent"] += per_request
            t0 = time.perf_counter()
            try:
                # Await first: `state["acked"] += await ...` would read the count before the await
                # and lose every update made by the other workers meanwhile.
                ok = await sender.send(payload)
            except NotLeaderAnswer as e:  # leadership moved (a starved node missed heartbeats)
                state["errors"] += 1
                state["first_error"] = state["first_error"] or repr(e)[:300]
                if e.leader:
                    state["leader_changes"] += await sender.retarget(e.leader)
                else:
                    await asyncio.sleep(0.05)
                continue
            except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, OSError) as e:
                state["errors"] += 1
                state["first_error"] = state["first_error"] or repr(e)[:300]
                continue
            state["acked"] += ok
            if latencies is not None:
                latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(inflight)))
    return load_result(sender, state, time.perf_counter() - start)


def load_result(sender, state: dict, elapsed: float, **extra) -> dict:
    """A load loop's figures from its `state` counters (acked, errors, first_error, leader_changes)."""
    return {"transport": sender.transport, **extra, "msgs": state["acked"], "errors": state["errors"],
            "first_error": state["first_error"], "leader_changes": state.get("leader_changes", 0),
            "seconds": round(elapsed, 3), "msgs_per_s": state["acked"] / elapsed if elapsed else 0.0,
            "load1": load1()}


async def load_windowed(sender: StreamSender, payload: dict, window: int, seconds: float, max_msgs: int) -> dict:
    """One message per send from ONE loop, at most `window` unanswered, each counted by a
    callback (StreamConnection.send_with_callback): how the NATS anchor's client publishes
    (bench/anchors.py `_publish_async`, done callbacks), not a coroutine per message."""
    state = {"acked": 0, "errors": 0, "first_error": None, "inflight": 0}
    room = asyncio.Event()

    def done(result: tuple[int, dict] | None, err: BaseException | None) -> None:
        state["inflight"] -= 1
        if state["inflight"] < window:
            room.set()
        if err is None:
            status, answer = result
            if status == 200 and answer["results"][0]["status"] == "SEND_OK":
                state["acked"] += 1
                return
            err = f"{status}: {answer}"
        state["errors"] += 1
        state["first_error"] = state["first_error"] or repr(err)[:300]

    conn = await sender._conn()
    start = time.perf_counter()
    deadline = start + seconds
    sent = 0
    while sent < max_msgs and time.perf_counter() < deadline and not conn.closed:
        if state["inflight"] >= window or not conn.has_room:
            room.clear()
            await room.wait()
            continue
        conn.send_with_callback(TOPIC, payload, done, REQUEST_TIMEOUT_S)
        state["inflight"] += 1
        sent += 1
    while state["inflight"] and time.perf_counter() < deadline + REQUEST_TIMEOUT_S:
        room.clear()
        try:
            await asyncio.wait_for(room.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
    return load_result(sender, state, time.perf_counter() - start, client="one loop, window, send callbacks")


def pct_ms(sorted_s: list[float], q: float) -> float | None:
    if not sorted_s:
        return None
    return round(sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))] * 1000, 3)


# --- cases ----------------------------------------------------------------------------------------
async def throughput_cases(cluster: Cluster, quick: bool, cases: set[str], anchors: dict) -> dict:
    """The ASYNC_FLUSH cases, each on the produce stream (the SDK's path) and then over HTTP
    (`<case>_http`: what one HTTP request costs, for comparison)."""
    secs = 3.0 if quick else 10.0
    out: dict = {}
    conn = aiohttp.TCPConnector(limit=WINDOW + 8)
    async with aiohttp.ClientSession(connector=conn) as session:
        await wait_healthy(session, cluster, cluster.nodes)
        leader = await find_leader(session, cluster)
        url = f"{leader.url}/topics/{TOPIC}/messages"
        await send(session, url, batch_payload(16))                      # creates the topic
        nats_async = (anchors.get("nats_r3_async") or {}).get("msgs_per_s")
        nats_sync_p99 = (anchors.get("nats_r3_sync") or {}).get("p99_ms")
        for transport, suffix in (("stream", ""), ("http", "_http")):
            leader = await find_leader(session, cluster)
            sender = SENDERS[transport](session, cluster, leader)
            try:
                await load(sender, sender.payload(BATCH), BATCH, BATCH_CONNS, 1.0, 50_000)  # warm-up
                if "async_batched" in cases:
                    meter = CpuMeter(cluster, leader)
                    r = await load(sender, sender.payload(BATCH), BATCH, BATCH_CONNS, secs, 2_000_000)
                    r["cpu_us_per_msg"] = meter.per_msg_us(r["msgs"])
                    out["async_batched" + suffix] = figure(r["msgs_per_s"], "msg/s", 60_000, "nats_r3_async",
                                                           nats_async, batch=BATCH, inflight_requests=BATCH_CONNS, **r)
                if "per_message_256" in cases:
                    meter = CpuMeter(cluster, leader)
                    if isinstance(sender, StreamSender):    # the NATS anchor's client pattern
                        r = await load_windowed(sender, sender.payload(1), WINDOW, secs, 500_000)
                    else:                                  # aiohttp: a request per coroutine
                        r = await load(sender, sender.payload(1), 1, WINDOW, secs, 500_000)
                    r["cpu_us_per_msg"] = meter.per_msg_us(r["msgs"])
                    target = 1.5 * nats_async if nats_async else None
                    out["per_message_256" + suffix] = figure(r["msgs_per_s"], "msg/s", target, "nats_r3_async",
                                                             nats_async, inflight_requests=WINDOW, **r)
                if "one_at_a_time" in cases:
                    lat: list[float] = []
                    meter = CpuMeter(cluster, leader)
                    r = await load(sender, sender.payload(1), 1, 1, secs, 20_000 if quick else 100_000, lat)
                    r["cpu_us_per_msg"] = meter.per_msg_us(r["msgs"])
                    lat.sort()
                    p50, p99 = pct_ms(lat, 0.50), pct_ms(lat, 0.99)
                    meets = p99 <= nats_sync_p99 if (p99 is not None and nats_sync_p99) else None
                    out["one_at_a_time" + suffix] = figure(p99 or 0.0, "ms p99", nats_sync_p99, "nats_r3_sync_p99",
                                                           nats_sync_p99, meets=meets, p50_ms=p50, p99_ms=p99,
                                                           max_ms=pct_ms(lat, 1.0), **r)
            finally:
                sender.close()
        out["leader_metrics"] = await leader_metrics(session, leader)
    return out


async def sync_case(cluster: Cluster, quick: bool) -> dict:
    secs = 3.0 if quick else 10.0
    conn = aiohttp.TCPConnector(limit=SYNC_PRODUCERS + 8)
    async with aiohttp.ClientSession(connector=conn) as session:
        await wait_healthy(session, cluster, cluster.nodes)
        leader = await find_leader(session, cluster)
        await send(session, f"{leader.url}/topics/{TOPIC}/messages", batch_payload(16))
        sender = StreamSender(session, cluster, leader)
        try:
            payload = sender.payload(SYNC_BATCH)
            await load(sender, payload, SYNC_BATCH, SYNC_PRODUCERS, 1.0, 50_000)
            meter = CpuMeter(cluster, leader)
            r = await load(sender, payload, SYNC_BATCH, SYNC_PRODUCERS, secs, 2_000_000)
            r["cpu_us_per_msg"] = meter.per_msg_us(r["msgs"])
        finally:
            sender.close()
        return {"sync_flush_64": figure(r["msgs_per_s"], "msg/s", 25_000, None, None, producers=SYNC_PRODUCERS,
                                        batch=SYNC_BATCH, **r),
                "sync_leader_metrics": await leader_metrics(session, leader)}


async def cluster_doc(session: aiohttp.ClientSession, n: Node) -> dict:
    try:
        async with session.get(f"{n.url}/cluster", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return (await r.json()).get("log", {})
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return {}


async def leader_metrics(session: aiohttp.ClientSession, leader: Node) -> dict:
    st = await cluster_doc(session, leader)
    return {k: st.get(k) for k in ("term", "commit_index", "last_index", "transport")} if st else {}


async def first_acked_write(session: aiohttp.ClientSession, cluster: Cluster, payload: bytes, t_kill: float) -> float:
    """Seconds from t_kill until some live node acknowledges a write."""
    while time.perf_counter() - t_kill < FAILOVER_GIVE_UP_S:
        for n in cluster.alive():
            try:
                await send(session, f"{n.url}/topics/{TOPIC}/messages", payload, timeout=1.0)
                return time.perf_counter() - t_kill
            except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, OSError):
                continue
        await asyncio.sleep(0.01)
    return FAILOVER_GIVE_UP_S


async def failover_case(cluster: Cluster, kills: int) -> dict:
    times: list[float] = []
    payload = batch_payload(1)
    async with aiohttp.ClientSession() as session:
        await wait_healthy(session, cluster, cluster.nodes)
        leader = await find_leader(session, cluster)
        await send(session, f"{leader.url}/topics/{TOPIC}/messages", batch_payload(16))
        for _ in range(kills):
            leader = await find_leader(session, cluster)
            # Background writes while we kill: a real client is mid-stream when the leader dies.
            await send(session, f"{leader.url}/topics/{TOPIC}/messages", batch_payload(64))
            t_kill = time.perf_counter()
            cluster.kill9(leader)
            times.append(await first_acked_write(session, cluster, payload, t_kill))
            cluster.start_node(leader)
            await wait_healthy(session, cluster, [leader])
            await asyncio.sleep(0.3)  # let it rejoin before the next kill
    times.sort()
    p50 = times[len(times) // 2]
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
    return {"failover": figure(p50, "s median", 2.0, None, None, meets=p50 <= 2.0 and p99 <= 4.0,
                               median_s=round(p50, 3), p99_s=round(p99, 3), max_s=round(times[-1], 3),
                               kills=len(times), all_s=[round(t, 3) for t in times], load1=load1())}


def drop_old_from_page_cache(data_dir: Path, end: int, keep: int) -> int:
    """Write back, then drop from the page cache, the bytes of the commitlog segments in
    `data_dir` (files named by base offset) below `end - keep`: what a node has not touched
    for a while, while its newest `keep` bytes stay cached as they would (the node reads
    those on its loop: coldReadHotBytes). Our own descriptors: no root, no system-wide drop."""
    below, dropped = end - keep, 0
    for path in sorted(data_dir.iterdir()):
        if not path.name.isdigit():
            continue
        base = int(path.name)
        n = min(path.stat().st_size, below - base)
        if n <= 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, n, os.POSIX_FADV_DONTNEED)
            dropped += n
        finally:
            os.close(fd)
    return dropped


async def loop_stalls(session: aiohttp.ClientSession, n: Node) -> dict[str, float]:
    """`n`'s rocketmq_event_loop_stall_seconds series from /metrics (every stall over
    loopStallWarnMs): `_count`, `_sum`, and `_bucket{le="..."}` by bound."""
    try:
        async with session.get(f"{n.url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
            text = await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "rocketmq_event_loop_stall_seconds":
            for sample in family.samples:
                le = sample.labels.get("le")
                out[sample.name[len(family.name):] + (f'{{le="{le}"}}' if le else "")] = sample.value
    return out


async def one_at_a_time_until(sender, payload, done, give_up_s: float,
                              sent_at: list[float] | None = None) -> tuple[list[float], dict]:
    """Send one message at a time until `done()` is true (checked every 100 ms) or `give_up_s`;
    the latencies sorted. With `sent_at`, the latencies in send order, and there when each send
    began (perf_counter)."""
    lat: list[float] = []
    state = {"acked": 0, "errors": 0, "first_error": None}
    stop = asyncio.Event()

    async def watch() -> None:
        t_end = time.perf_counter() + give_up_s
        while time.perf_counter() < t_end and not await done():
            await asyncio.sleep(0.1)
        stop.set()

    watcher = asyncio.create_task(watch())
    t0 = time.perf_counter()
    while not stop.is_set():
        t = time.perf_counter()
        try:
            state["acked"] += await sender.send(payload)
            lat.append(time.perf_counter() - t)
            if sent_at is not None:
                sent_at.append(t)
        except (NotLeaderAnswer, aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, OSError) as e:
            state["errors"] += 1
            state["first_error"] = state["first_error"] or repr(e)[:300]
            await asyncio.sleep(0.01)
    await watcher
    if sent_at is None:
        lat.sort()
    return lat, {"msgs": state["acked"], "errors": state["errors"], "first_error": state["first_error"],
                 "seconds": round(time.perf_counter() - t0, 3)}


async def catch_up_case(cluster: Cluster, quick: bool) -> dict:
    mib = CATCH_UP_MIB // 2 if quick else CATCH_UP_MIB
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=BATCH_CONNS + 8)) as session:
        await wait_healthy(session, cluster, cluster.nodes)
        leader = await find_leader(session, cluster)
        await send(session, f"{leader.url}/topics/{TOPIC}/messages", batch_payload(16))   # creates the topic
        follower = next(n for n in cluster.nodes if n is not leader)
        sender = StreamSender(session, cluster, leader)
        try:
            one = sender.payload(1)
            await load(sender, one, 1, 1, 1.0, 5_000)                                      # warm-up
            before_lat: list[float] = []
            before = await load(sender, one, 1, 1, 3.0 if quick else 6.0, 20_000, before_lat)
            before_lat.sort()
            follower.stop(10)
            start_pos = (await cluster_doc(session, leader)).get("committed_position", 0)
            target, fill_until = start_pos + mib * 1024 * 1024, time.perf_counter() + CATCH_UP_GIVE_UP_S
            while (await cluster_doc(session, leader)).get("committed_position", 0) < target:
                if time.perf_counter() > fill_until:
                    raise RuntimeError(f"the leader did not take {mib} MiB in {CATCH_UP_GIVE_UP_S:.0f} s")
                await load(sender, sender.payload(BATCH), BATCH, BATCH_CONNS, 2.0, 200_000)
            filled = await cluster_doc(session, leader)
            end, leader_last = filled.get("committed_position", 0), filled.get("last_index", 0)
            behind = end - start_pos
            dropped = drop_old_from_page_cache(leader.config.parent / "store" / f"dledger-{leader.node_id}" / "data",
                                               end, COLD_READ_HOT_BYTES)
            stalls_before = await loop_stalls(session, leader)
            t_start = time.perf_counter()
            caught: dict = {}

            async def caught_up() -> bool:
                doc = await cluster_doc(session, follower)
                if "within" not in caught and end - doc.get("committed_position", 0) <= PEER_PUSH_THROTTLE_POINT:
                    caught["within"] = time.perf_counter()
                if "s" not in caught and doc.get("applied_index", 0) >= leader_last:
                    caught["s"] = time.perf_counter() - t_start
                return "s" in caught

            cluster.start_node(follower)
            sent_at: list[float] = []
            lat, r = await one_at_a_time_until(sender, one, caught_up, CATCH_UP_GIVE_UP_S, sent_at)
            stalls_after = await loop_stalls(session, leader)
        finally:
            sender.close()
    secs = caught.get("s")
    within = caught.get("within", float("inf"))
    far = sorted(x for x, t in zip(lat, sent_at) if t < within)      # the quota's phase (peerPushQuota)
    near = sorted(x for x, t in zip(lat, sent_at) if t >= within)
    lat.sort()
    p99_before, p99 = pct_ms(before_lat, 0.99), pct_ms(lat, 0.99)
    stalls = {k: round(v - stalls_before.get(k, 0.0), 3) for k, v in stalls_after.items()
              if k in ("_count", "_sum", '_bucket{le="0.05"}', '_bucket{le="0.1"}')}
    return {"catch_up": figure(round(behind / 1e6 / secs, 1) if secs else 0.0, "MB/s", None, None, None,
                               meets=None, bytes_behind=behind, seconds=round(secs, 2) if secs else None,
                               gave_up=secs is None, page_cache_dropped_bytes=dropped,
                               leader_loop_stalls=stalls),
            "catch_up_producer": figure(p99 or 0.0, "ms p99", None, "one_at_a_time_before_catch_up_p99",
                                        p99_before, meets=None, p50_ms=pct_ms(lat, 0.5), p99_ms=p99,
                                        max_ms=pct_ms(lat, 1.0), before_p50_ms=pct_ms(before_lat, 0.5),
                                        before_p99_ms=p99_before, before_msgs_per_s=round(before["msgs_per_s"], 1),
                                        far_behind_sends=len(far), far_behind_p99_ms=pct_ms(far, 0.99),
                                        within_throttle_point_sends=len(near),
                                        within_throttle_point_p99_ms=pct_ms(near, 0.99),
                                        far_behind_note="sends while the follower was more than peerPushThrottlePoint "
                                                        "behind (pushed at most peerPushQuota), then the rest",
                                        **r)}


def node_errors(cluster: Cluster, limit: int = 5) -> list[str]:
    """The first ERROR/CRITICAL log lines of the nodes: a failed request names its cause here."""
    out: list[str] = []
    for n in cluster.nodes:
        try:
            lines = n.log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            if '"level":"ERROR"' not in line and '"level":"CRITICAL"' not in line:
                continue
            try:
                doc = json.loads(line)
                text = f"{doc.get('msg')} {str(doc.get('exc', ''))[-500:]}"
            except ValueError:
                text = line[-600:]
            out.append(f"{n.node_id}: {text}")
    return out[:limit]


START_ATTEMPTS = 3          # free ports are probed, then bound by the nodes: another process may win the race


def run_cluster(work: Path, flush: str, body) -> dict:
    """Start a fresh 3-node group, run `body` on it, stop it. A node that loses its probed
    port to another process (EADDRINUSE) makes the start repeat with new ports."""
    for attempt in range(START_ATTEMPTS):
        cluster = Cluster(work / f"try{attempt}", flush)
        try:
            cluster.start()
            result = asyncio.run(body(cluster))
        except RuntimeError as e:
            if "address already in use" in str(e) and attempt + 1 < START_ATTEMPTS:
                continue
            raise
        finally:
            cluster.stop()
        errors = node_errors(cluster)
        if errors:
            result[f"node_errors_{flush.lower()}"] = errors
        return result
    raise AssertionError("unreachable")


def _case(out: dict, names: list[str], fn) -> None:
    """Run one cluster's cases; a failure becomes {"error": ...} on those cases only."""
    try:
        out.update(fn())
    except Exception as e:  # noqa: BLE001 - one broken case must not lose the others
        for name in names:
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}


def run(quick: bool = False, anchors: dict | None = None, cases: set[str] | None = None) -> dict:
    anchors = anchors or {}
    cases = set(cases or CASES)
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="mqbench-dledger-"))
    out: dict = {"load1_start": load1(), "body_bytes": BODY_BYTES,
                 "transports": "produce stream (SDK StreamConnection); *_http: aiohttp, msgpack bodies",
                 "nodes": 3, "processes": True, "page_cache_probe_start": page_cache_probe(str(work))}
    try:
        wanted = [c for c in ("async_batched", "per_message_256", "one_at_a_time") if c in cases]
        if wanted:
            _case(out, wanted, lambda: run_cluster(work / "async", "ASYNC_FLUSH",
                                                   lambda c: throughput_cases(c, quick, cases, anchors)))
        if "sync_flush_64" in cases:
            _case(out, ["sync_flush_64"], lambda: run_cluster(work / "sync", "SYNC_FLUSH",
                                                              lambda c: sync_case(c, quick)))
        if "failover" in cases:
            _case(out, ["failover"], lambda: run_cluster(work / "failover", "ASYNC_FLUSH",
                                                         lambda c: failover_case(c, 3 if quick else 20)))
        if "catch_up" in cases:
            _case(out, ["catch_up", "catch_up_producer"],
                  lambda: run_cluster(work / "catch_up", "ASYNC_FLUSH", lambda c: catch_up_case(c, quick)))
        out["page_cache_probe_end"] = page_cache_probe(str(work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["elapsed_s"] = round(time.monotonic() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_dledger")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default=None, help=f"comma-separated cases: {', '.join(CASES)}")
    p.add_argument("--anchors", default=None, help="JSON file of anchors (default: none, or "
                   "MQSTORE_BENCH_ANCHORS)")
    args = p.parse_args(argv)
    anchors = json.loads(Path(args.anchors).read_text()) if args.anchors else \
        json.loads(os.environ.get("MQSTORE_BENCH_ANCHORS", "{}"))
    cases = set(args.only.split(",")) if args.only else None
    if cases and cases - set(CASES):
        p.error(f"unknown cases {sorted(cases - set(CASES))}; known: {', '.join(CASES)}")
    print(json.dumps(run(args.quick, anchors, cases), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
