"""Anchors: the figures every benchmark is divided by (DESIGN.md section 7).

Absolute throughput drifts between runs and machines, so each benchmark reports a ratio to an
anchor measured in the same run on the same machine:

* ``disk_anchors(dir)``      -- what the disk itself can do (sequential MB/s, fdatasync/s, raw
                                ``os.write`` of 1 KiB-message-sized records), and how fast
                                the page cache takes new data into memory freed just before
                                and freed seconds before (see ``_page_cache_writes``).
* ``loopback_anchor()``      -- one 1 KiB message back and forth between two processes over
                                loopback TCP: round trip, send and CPU per round trip. Every
                                replicated figure pays these hops; the kernel's cost for them
                                moved by 40 % within one session on the VM these benchmarks
                                were tuned on, so each run records what it met.
* ``nats_anchor(R, mode)``   -- NATS JetStream R1/R3 on loopback, 1 KiB payloads, async
                                (pipelined acks) or sync (one publish at a time).
* ``pysyncobj_anchor()``     -- 3 PySyncObj processes replicating a counter.
* ``run_anchors(quick)``     -- all of the above as one JSON-ready dict (what ``python -m bench``
                                hands to every ``bench_*.run``).

Every function is bounded by time *and* count, starts its processes in their own session, and
stops and removes everything it started in a ``finally`` (terminate, then kill after a timeout).
Only PIDs started here are ever signalled.

This module is also the entry point of the PySyncObj node processes:
``python -m bench.anchors pysyncobj-node --self HOST:PORT --peers HOST:PORT,HOST:PORT``,
and of the loopback anchor's echo process: ``python -m bench.anchors loopback-echo --port P``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from bench.bench_store import disk_seq_write_mb_s, page_cache_probe
from mqstore.localcluster import free_ports

REPO_ROOT = Path(__file__).resolve().parent.parent

# A RocketMQ commitlog record of a 1 KiB body with a short topic and no properties: 1024 bytes
# of body plus 91 bytes of fixed header/topic overhead. The standalone append target is "75 %
# of raw os.write of the same records", so the anchor writes records of exactly this size.
MSG_BODY_BYTES = 1024
MSG_OVERHEAD_BYTES = 91
MSG_RECORD_BYTES = MSG_BODY_BYTES + MSG_OVERHEAD_BYTES

MIB = 1024 * 1024
STOP_TIMEOUT_S = 5.0          # SIGTERM grace period before SIGKILL
NATS_READY_TIMEOUT_S = 30.0   # R3 needs a JetStream meta-leader election before streams exist
NATS_WINDOW = 256             # outstanding async publishes, same window as the DLedger figure
NATS_STREAM = "BENCH"
NATS_SUBJECT = "bench.msgs"
NATS_CLUSTER = "mqbench"
PYSYNCOBJ_READY_TIMEOUT_S = 30.0
PYSYNCOBJ_WINDOW = 1000       # outstanding replicated calls from the one client


# ---------------------------------------------------------------------------------------------
# small shared helpers


def _rate(count: int, seconds: float) -> float:
    return round(count / seconds, 1) if seconds > 0 else 0.0


def _percentile_ms(sorted_s: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of latencies given in seconds, returned in ms."""
    if not sorted_s:
        return None
    rank = min(len(sorted_s) - 1, max(0, int(round(q * len(sorted_s))) - 1))
    return round(sorted_s[rank] * 1000.0, 3)


def _start(argv: list[str], log_path: Path, **kwargs: Any) -> subprocess.Popen:
    """Start a child in its own session (a Ctrl-C on the bench does not reach it half-way; we
    stop it ourselves), stderr to a log file we can quote in errors."""
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(argv, stderr=log, start_new_session=True, **kwargs)
    finally:
        log.close()  # the child holds its own descriptor


def _stop(procs: Iterable[subprocess.Popen], timeout: float = STOP_TIMEOUT_S) -> None:
    """Terminate the given children, kill those still alive after `timeout`, reap all."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=timeout)


def _tail(path: Path, limit: int = 600) -> str:
    try:
        return path.read_bytes()[-limit:].decode("utf-8", "replace")
    except OSError:
        return ""


def _wait_port(port: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


# ---------------------------------------------------------------------------------------------
# disk


def _fdatasync_per_s(path: Path, seconds: float, max_syncs: int) -> float:
    """4 KiB append + fdatasync, repeated: the cost of one durable small write (a group commit
    can never go faster than this many batches per second)."""
    buf = os.urandom(4096)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    try:
        count = 0
        start = time.perf_counter()
        deadline = start + seconds
        while count < max_syncs and time.perf_counter() < deadline:
            os.write(fd, buf)
            os.fdatasync(fd)
            count += 1
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
    return _rate(count, elapsed)


def _raw_record_writes(path: Path, seconds: float, max_bytes: int) -> dict:
    """One os.write per 1115-byte record, no fsync: the ceiling for an in-process append that
    copies each message into the file once."""
    record = os.urandom(MSG_RECORD_BYTES)
    max_records = max(1, max_bytes // MSG_RECORD_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        count = 0
        start = time.perf_counter()
        deadline = start + seconds
        # Check the clock once per 1024 writes: a clock read costs about as much as the write.
        while count < max_records and time.perf_counter() < deadline:
            for _ in range(min(1024, max_records - count)):
                os.write(fd, record)
            count = min(max_records, count + 1024)
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
    return {
        "msgs_per_s": _rate(count, elapsed),
        "mb_per_s": round(count * MSG_RECORD_BYTES / MIB / elapsed, 1),
        "msgs": count,
    }


def _page_cache_writes(work: Path, size_mib: int, idle_s: float) -> dict:
    """Page-cache write rate into memory freed just before (a file of the same size deleted
    right away) and into memory freed `idle_s` earlier. On a VM that hands freed guest memory
    back to its host (virtio-balloon free page reporting) the second can be several times
    slower, each page faulted in by the host again: 0.35-0.5 GB/s against 4 GB/s at times on
    the 2-core VM these benchmarks were tuned on, about the same at others. Every log write
    into new page cache pays that, so a node's CPU per message moves with it; the two rates
    say which case a run met."""
    page_cache_probe(str(work), size_mib * MIB)           # its file, removed, frees the memory
    reused = page_cache_probe(str(work), size_mib * MIB)["write_mib_s"]
    time.sleep(idle_s)
    after_idle = page_cache_probe(str(work), size_mib * MIB)["write_mib_s"]
    return {"page_write_reused_mb_s": reused, "page_write_after_idle_mb_s": after_idle,
            "page_write_idle_s": idle_s, "page_write_mib": size_mib}


def disk_anchors(
    dir: str | os.PathLike,
    size_mib: int = 256,
    fsync_seconds: float = 2.0,
    max_fsyncs: int = 100_000,
    write_seconds: float = 2.0,
    page_idle_s: float = 4.0,
) -> dict:
    """The disk's own limits, measured in a temp dir under `dir` (removed afterwards).

    Returns ``{"dir", "seq_write_mb_s", "seq_write_mib", "fdatasync_per_s",
    "raw_write_record_bytes", "raw_write_msgs_per_s", "raw_write_mb_s", "raw_write_msgs",
    "page_write_reused_mb_s", "page_write_after_idle_mb_s", "page_write_idle_s", "page_write_mib"}``.
    """
    work = Path(tempfile.mkdtemp(prefix="mqbench-disk-", dir=dir))
    try:
        pages = _page_cache_writes(work, min(size_mib, 64), page_idle_s)
        seq = round(disk_seq_write_mb_s(str(work), size_mib * MIB), 1)
        syncs = _fdatasync_per_s(work / "sync.bin", fsync_seconds, max_fsyncs)
        raw = _raw_record_writes(work / "raw.bin", write_seconds, size_mib * MIB)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        **pages,
        "dir": str(Path(dir).resolve()),
        "seq_write_mb_s": seq,
        "seq_write_mib": size_mib,
        "fdatasync_per_s": syncs,
        "raw_write_record_bytes": MSG_RECORD_BYTES,
        "raw_write_msgs_per_s": raw["msgs_per_s"],
        "raw_write_mb_s": raw["mb_per_s"],
        "raw_write_msgs": raw["msgs"],
    }


# ---------------------------------------------------------------------------------------------
# loopback


def _loopback_echo_main(argv: Sequence[str]) -> int:
    """The echo side (child process): connect to the anchor's port, send back what arrives, end
    at EOF."""
    port = int(argv[list(argv).index("--port") + 1])
    with socket.create_connection(("127.0.0.1", port), timeout=10.0) as c:
        c.settimeout(None)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := c.recv(1 << 16):
            c.sendall(data)
    return 0


def loopback_anchor(seconds: float = 2.0, max_round_trips: int = 20_000,
                    payload_bytes: int = MSG_BODY_BYTES) -> dict:
    """`payload_bytes` sent to an echo process and read back, one round trip at a time, over
    loopback TCP with TCP_NODELAY (as the nodes' links): round-trip p50/p99, the send call's
    p50 (on loopback the kernel delivers to the receiver inside it) and this side's CPU per
    round trip."""
    work = Path(tempfile.mkdtemp(prefix="mqbench-loopback-"))
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(10.0)
    proc = _start([sys.executable, "-m", "bench.anchors", "loopback-echo", "--port", str(srv.getsockname()[1])],
                  work / "echo.log", cwd=REPO_ROOT)
    rtts: list[float] = []
    sends: list[float] = []
    try:
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(10.0)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            msg = b"x" * payload_bytes
            cpu0, deadline = time.process_time(), time.monotonic() + seconds
            while len(rtts) < max_round_trips and time.monotonic() < deadline:
                t0 = time.perf_counter()
                conn.sendall(msg)
                t1 = time.perf_counter()
                got = 0
                while got < payload_bytes:
                    data = conn.recv(1 << 16)
                    if not data:
                        raise RuntimeError(f"the echo process closed: {_tail(work / 'echo.log')}")
                    got += len(data)
                rtts.append(time.perf_counter() - t0)
                sends.append(t1 - t0)
            cpu = time.process_time() - cpu0
    finally:
        srv.close()
        _stop([proc])
        shutil.rmtree(work, ignore_errors=True)
    rtts.sort()
    sends.sort()
    us = lambda xs, q: round((_percentile_ms(xs, q) or 0.0) * 1000.0, 1)   # noqa: E731
    return {"round_trips": len(rtts), "payload_bytes": payload_bytes, "rtt_p50_us": us(rtts, 0.5),
            "rtt_p99_us": us(rtts, 0.99), "send_p50_us": us(sends, 0.5),
            "cpu_us_per_round_trip": round(cpu / len(rtts) * 1e6, 1) if rtts else None}


# ---------------------------------------------------------------------------------------------
# NATS JetStream


def ensure_nats() -> str | None:
    """Path of `nats-server`, installing Debian's package when missing and we are root.
    Returns None when it is missing and cannot be installed (the caller reports an error)."""
    path = shutil.which("nats-server")
    if path is not None or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return path
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-qq", "nats-server"]
    if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode != 0:
        # A fresh image may have no package lists yet.
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        subprocess.run(install, env=env, capture_output=True, timeout=600)
    return shutil.which("nats-server")


def _nats_version(server: str) -> str:
    out = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=10)
    return out.stdout.strip().removeprefix("nats-server: ")


def nats_server_config(
    name: str,
    client_port: int,
    store_dir: str,
    cluster_name: str | None = None,
    cluster_port: int | None = None,
    route_ports: Sequence[int] = (),
) -> str:
    """Config text for one loopback nats-server with JetStream on file storage.
    With `cluster_name`, the server also listens for routes on `cluster_port` and dials
    `route_ports` (the other members; a server does not need a route to itself)."""
    lines = [
        f'server_name: "{name}"',
        f'listen: "127.0.0.1:{client_port}"',
        "jetstream {",
        f'  store_dir: "{store_dir}"',
        "}",
    ]
    if cluster_name is not None:
        assert cluster_port is not None, "a cluster member needs a route port"
        lines += [
            "cluster {",
            f'  name: "{cluster_name}"',
            f'  listen: "127.0.0.1:{cluster_port}"',
            "  routes: [",
            *(f'    "nats-route://127.0.0.1:{p}"' for p in route_ports),
            "  ]",
            "}",
        ]
    return "\n".join(lines) + "\n"


def nats_cluster_configs(
    base_dir: str | os.PathLike,
    client_ports: Sequence[int],
    cluster_ports: Sequence[int] | None = None,
    cluster_name: str = NATS_CLUSTER,
) -> list[tuple[str, str]]:
    """`[(server_name, config_text)]` for 1 server (no cluster block) or N routed servers, each
    with its own store dir under `base_dir`. Pure: writes nothing."""
    n = len(client_ports)
    assert n >= 1
    if n > 1:
        assert cluster_ports is not None and len(cluster_ports) == n
    configs = []
    for i, port in enumerate(client_ports):
        name = f"n{i}"
        store = os.path.join(os.fspath(base_dir), name, "js")
        if n == 1:
            configs.append((name, nats_server_config(name, port, store)))
            continue
        routes = [p for j, p in enumerate(cluster_ports) if j != i]
        text = nats_server_config(name, port, store, cluster_name, cluster_ports[i], routes)
        configs.append((name, text))
    return configs


def _import_nats():
    try:
        import nats  # noqa: F401  (nats-py)
    except ImportError as exc:
        raise RuntimeError("nats-py is not installed: pip install 'nats-py>=2.6,<3'") from exc
    return nats


async def _create_stream(nats, port: int, replicas: int, deadline: float) -> str:
    """Create the bench stream, retrying until JetStream is ready (an R3 cluster must first
    elect a meta leader). Returns the name of the server leading the stream ("" when the
    server is not clustered)."""
    from nats.js.api import StorageType

    last_error: Exception | None = None
    while time.monotonic() < deadline:
        nc = None
        try:
            nc = await nats.connect(f"nats://127.0.0.1:{port}", connect_timeout=2,
                                    allow_reconnect=False)
            js = nc.jetstream(timeout=2)
            info = await js.add_stream(name=NATS_STREAM, subjects=[NATS_SUBJECT],
                                       storage=StorageType.FILE, num_replicas=replicas)
            leader = info.cluster.leader if info.cluster is not None else None
            if leader or replicas == 1:
                # A lone server reports no cluster info: it is the leader by definition.
                return leader or ""
            last_error = RuntimeError("stream has no leader yet")
        except (nats.errors.Error, OSError, asyncio.TimeoutError) as exc:
            last_error = exc
        finally:
            if nc is not None:
                await nc.close()
        await asyncio.sleep(0.25)
    raise RuntimeError(f"JetStream not ready: {last_error!r}")


async def _publish_async(js, payload: bytes, seconds: float, max_msgs: int) -> dict:
    """Pipelined publishes, at most NATS_WINDOW unacked (the client's semaphore enforces it)."""
    counts = {"acked": 0, "errors": 0}

    def on_done(fut: asyncio.Future) -> None:
        failed = fut.cancelled() or fut.exception() is not None
        counts["errors" if failed else "acked"] += 1

    async def send_all() -> None:
        sent = 0
        deadline = time.perf_counter() + seconds
        while sent < max_msgs and time.perf_counter() < deadline:
            # wait_stall=None: a per-call timeout makes nats-py spawn a task per publish, which
            # cuts throughput ~6x on 2 cores. The single wait_for below bounds the whole run.
            fut = await js.publish_async(NATS_SUBJECT, payload, wait_stall=None)
            fut.add_done_callback(on_done)
            sent += 1
        await js.publish_async_completed()

    start = time.perf_counter()
    await asyncio.wait_for(send_all(), timeout=seconds + 30.0)
    elapsed = time.perf_counter() - start
    await asyncio.sleep(0)  # let the last done-callbacks run
    return {"msgs": counts["acked"], "errors": counts["errors"], "seconds": round(elapsed, 3),
            "msgs_per_s": _rate(counts["acked"], elapsed), "window": NATS_WINDOW}


async def _publish_sync(js, payload: bytes, seconds: float, max_msgs: int) -> dict:
    """One publish at a time, each awaiting its ack: throughput and per-publish latency."""
    latencies: list[float] = []
    start = time.perf_counter()
    deadline = start + seconds
    while len(latencies) < max_msgs and time.perf_counter() < deadline:
        t0 = time.perf_counter()
        await js.publish(NATS_SUBJECT, payload, timeout=5.0)
        latencies.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {"msgs": len(latencies), "errors": 0, "seconds": round(elapsed, 3),
            "msgs_per_s": _rate(len(latencies), elapsed),
            "p50_ms": _percentile_ms(latencies, 0.50), "p99_ms": _percentile_ms(latencies, 0.99),
            "max_ms": _percentile_ms(latencies, 1.0)}


async def _nats_measure(ports: dict[str, int], replicas: int, mode: str, seconds: float,
                        max_msgs: int) -> dict:
    nats = _import_nats()
    first = next(iter(ports.values()))
    leader = await _create_stream(nats, first, replicas,
                                  time.monotonic() + NATS_READY_TIMEOUT_S)
    # Publish to the stream leader's server: the best case for NATS (no extra hop), so the
    # anchor is the strictest bar for our figures.
    port = ports.get(leader, first)
    nc = await nats.connect(f"nats://127.0.0.1:{port}", connect_timeout=2, allow_reconnect=False)
    try:
        js = nc.jetstream(timeout=5, publish_async_max_pending=NATS_WINDOW)
        payload = os.urandom(MSG_BODY_BYTES)
        await _publish_sync(js, payload, 1.0, 200)  # warm-up: connections, stream files
        if mode == "async":
            result = await _publish_async(js, payload, seconds, max_msgs)
        else:
            result = await _publish_sync(js, payload, seconds, max_msgs)
        result.update(stream_leader=leader or None, client_on_leader=leader in ports or not leader)
        return result
    finally:
        await nc.close()


def nats_anchor(replicas: int = 3, mode: str = "async", seconds: float = 5.0,
                max_msgs: int = 100_000, dir: str | os.PathLike | None = None) -> dict:
    """NATS JetStream on loopback, `replicas` in {1, 3} servers, file storage, 1 KiB payloads.

    mode "async": pipelined publishes (window 256) ->
        ``{"replicas", "mode", "msgs", "errors", "seconds", "msgs_per_s", "window", ...}``
    mode "sync": one publish at a time -> the same plus ``"p50_ms", "p99_ms", "max_ms"``.
    Bounded by `seconds` and `max_msgs` (plus ~1 s warm-up and the cluster start-up).
    """
    if replicas not in (1, 3) or mode not in ("async", "sync"):
        raise ValueError(f"replicas must be 1 or 3 and mode async or sync: {replicas}, {mode}")
    server = ensure_nats()
    if server is None:
        raise RuntimeError("nats-server not found (apt-get install -y nats-server)")
    _import_nats()  # fail before starting servers
    work = Path(tempfile.mkdtemp(prefix="mqbench-nats-", dir=dir))
    procs: list[subprocess.Popen] = []
    try:
        ports = free_ports(2 * replicas)
        client_ports, cluster_ports = ports[:replicas], ports[replicas:]
        configs = nats_cluster_configs(work, client_ports, cluster_ports)
        for (name, text), port in zip(configs, client_ports):
            conf = work / f"{name}.conf"
            conf.write_text(text)
            procs.append(_start([server, "-c", str(conf)], work / f"{name}.log",
                                stdout=subprocess.DEVNULL))
        deadline = time.monotonic() + NATS_READY_TIMEOUT_S
        for (name, _), port in zip(configs, client_ports):
            if not _wait_port(port, deadline):
                raise RuntimeError(f"nats-server {name} did not listen: "
                                   f"{_tail(work / f'{name}.log')}")
        by_name = {name: port for (name, _), port in zip(configs, client_ports)}
        result = asyncio.run(_nats_measure(by_name, replicas, mode, seconds, max_msgs))
        return {"replicas": replicas, "mode": mode, "payload_bytes": MSG_BODY_BYTES,
                "server_version": _nats_version(server), **result}
    finally:
        _stop(procs)
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# PySyncObj


def _pysyncobj_node_main(argv: Sequence[str]) -> int:
    """One PySyncObj node (child process). Protocol on stdout/stdin, one JSON object a line:
    prints {"event": "ready", "self", "leader", "is_leader"} once a leader is known, then obeys
    {"cmd": "run", "seconds", "max_ops", "window"} (prints {"event": "result", ...}) and
    {"cmd": "exit"} / EOF."""
    from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, replicated

    parser = argparse.ArgumentParser(prog="pysyncobj-node")
    parser.add_argument("--self", dest="self_addr", required=True)
    parser.add_argument("--peers", required=True)
    args = parser.parse_args(argv)

    class Counter(SyncObj):
        def __init__(self) -> None:
            # In-memory log (no journal file): PySyncObj's default and its published figures.
            super().__init__(args.self_addr, args.peers.split(","),
                             SyncObjConf(dynamicMembershipChange=False))
            self._value = 0

        @replicated
        def incr(self) -> int:
            self._value += 1
            return self._value

    def emit(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    node = Counter()
    try:
        deadline = time.monotonic() + PYSYNCOBJ_READY_TIMEOUT_S
        while time.monotonic() < deadline and node.getStatus()["leader"] is None:
            time.sleep(0.05)
        leader = node.getStatus()["leader"]
        emit({"event": "ready", "self": args.self_addr,
              "leader": None if leader is None else str(leader),
              "is_leader": leader is not None and str(leader) == args.self_addr})
        for _ in range(16):  # a handful of commands at most; EOF ends it
            line = sys.stdin.readline()
            if not line:
                break
            cmd = json.loads(line)
            if cmd.get("cmd") != "run":
                break
            emit({"event": "result", **_drive_counter(node, FAIL_REASON.SUCCESS, cmd)})
    finally:
        node.destroy()
    return 0


def _drive_counter(node, success, cmd: dict) -> dict:
    """Pipelined replicated calls from one client: at most `window` outstanding, counted when
    their callback reports them committed and applied."""
    window = int(cmd["window"])
    slots = threading.BoundedSemaphore(window)
    lock = threading.Lock()
    counts = {"ok": 0, "errors": 0}
    start = time.perf_counter()
    last = [start]

    def on_commit(_result, error) -> None:  # runs on PySyncObj's tick thread
        with lock:
            counts["ok" if error == success else "errors"] += 1
            last[0] = time.perf_counter()
        slots.release()

    issued = 0
    deadline = start + float(cmd["seconds"])
    while issued < int(cmd["max_ops"]) and time.perf_counter() < deadline:
        if not slots.acquire(timeout=5.0):
            break
        node.incr(callback=on_commit)
        issued += 1
    drained = 0  # wait for the calls still in flight, bounded
    drain_deadline = time.monotonic() + 10.0
    while drained < window and slots.acquire(timeout=max(0.0, drain_deadline - time.monotonic())):
        drained += 1
    elapsed = last[0] - start
    return {"ops": counts["ok"], "errors": counts["errors"], "issued": issued,
            "seconds": round(elapsed, 3), "ops_per_s": _rate(counts["ok"], elapsed),
            "window": window}


def _line_reader(proc: subprocess.Popen, out: queue.Queue) -> threading.Thread:
    """Forward a child's stdout lines to a queue so the parent can wait with a timeout."""
    def pump() -> None:
        for line in proc.stdout:
            out.put(line)
    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def _next_json(lines: queue.Queue, deadline: float, event: str) -> dict:
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no {event!r} line from a pysyncobj node")
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue  # a stray print from the library
        if obj.get("event") == event:
            return obj


def pysyncobj_anchor(seconds: float = 5.0, max_ops: int = 200_000,
                     window: int = PYSYNCOBJ_WINDOW) -> dict:
    """3 PySyncObj nodes (separate processes, loopback), one client in the leader's process
    issuing pipelined `@replicated` counter increments.
    Returns ``{"nodes": 3, "ops", "errors", "issued", "seconds", "ops_per_s", "window"}``."""
    work = Path(tempfile.mkdtemp(prefix="mqbench-pysyncobj-"))
    procs: list[subprocess.Popen] = []
    try:
        addrs = [f"127.0.0.1:{p}" for p in free_ports(3)]
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
        queues: list[queue.Queue] = []
        for i, addr in enumerate(addrs):
            peers = ",".join(a for a in addrs if a != addr)
            argv = [sys.executable, "-m", "bench.anchors", "pysyncobj-node",
                    "--self", addr, "--peers", peers]
            proc = _start(argv, work / f"node{i}.log", cwd=REPO_ROOT, env=env, text=True,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            procs.append(proc)
            queues.append(queue.Queue())
            _line_reader(proc, queues[-1])
        deadline = time.monotonic() + PYSYNCOBJ_READY_TIMEOUT_S + 5.0
        ready = [_next_json(q, deadline, "ready") for q in queues]
        driver = next((i for i, r in enumerate(ready) if r["is_leader"]), 0)
        cmd = {"cmd": "run", "seconds": seconds, "max_ops": max_ops, "window": window}
        procs[driver].stdin.write(json.dumps(cmd) + "\n")
        procs[driver].stdin.flush()
        result = _next_json(queues[driver], time.monotonic() + seconds + 30.0, "result")
        result.pop("event")
        return {"nodes": 3, "client_on_leader": ready[driver]["is_leader"], **result}
    finally:
        for p in procs:
            if p.stdin is not None and not p.stdin.closed:
                try:
                    p.stdin.close()  # EOF asks the node to exit cleanly
                except OSError:
                    pass
        _stop(procs)
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# all anchors

ANCHOR_NAMES = ("disk", "loopback", "nats_r1_async", "nats_r1_sync", "nats_r3_async", "nats_r3_sync",
                "pysyncobj")


def _anchor_plan(quick: bool, dir: str) -> dict:
    """name -> zero-argument callable; quick mode shrinks sizes and durations, not methods."""
    secs = 2.0 if quick else 5.0
    msgs = 20_000 if quick else 100_000

    def nats(replicas: int, mode: str):
        return lambda: nats_anchor(replicas, mode, seconds=secs, max_msgs=msgs)

    return {
        "disk": lambda: disk_anchors(dir, size_mib=64 if quick else 256,
                                     fsync_seconds=1.0 if quick else 2.0,
                                     write_seconds=1.0 if quick else 2.0),
        "loopback": lambda: loopback_anchor(seconds=1.0 if quick else 2.0),
        "nats_r1_async": nats(1, "async"),
        "nats_r1_sync": nats(1, "sync"),
        "nats_r3_async": nats(3, "async"),
        "nats_r3_sync": nats(3, "sync"),
        "pysyncobj": lambda: pysyncobj_anchor(seconds=secs),
    }


def select_anchors(only: Iterable[str] | None) -> list[str]:
    """Anchor names picked by --only: "anchors" means all; "nats" all four NATS runs."""
    if only is None:
        return list(ANCHOR_NAMES)
    wanted = set(only)
    if "anchors" in wanted:
        return list(ANCHOR_NAMES)
    return [n for n in ANCHOR_NAMES if n in wanted or n.split("_")[0] in wanted]


def run_anchors(quick: bool = False, only: Iterable[str] | None = None,
                dir: str | None = None) -> dict:
    """`{name: result}` for the selected anchors; a failing anchor is `{"error": "..."}` and
    the others still run. Each result also carries `"elapsed_s"`."""
    plan = _anchor_plan(quick, dir or tempfile.gettempdir())
    results: dict[str, dict] = {}
    for name in select_anchors(only):
        start = time.monotonic()
        try:
            results[name] = plan[name]()
        except Exception as exc:  # one anchor failing must not lose the others
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        results[name]["elapsed_s"] = round(time.monotonic() - start, 2)
        # Which machine the anchor ran on: new page-cache pages cost ten times more once the
        # VM's host has taken its free memory back (bench_store.page_cache_probe).
        results[name]["page_cache_probe_after"] = page_cache_probe(dir or tempfile.gettempdir())
        print(f"bench: anchor {name} done in {results[name]['elapsed_s']} s", file=sys.stderr)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["pysyncobj-node"]:
        return _pysyncobj_node_main(argv[1:])
    if argv[:1] == ["loopback-echo"]:
        return _loopback_echo_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m bench.anchors")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default=None, help="comma-separated anchor names")
    args = parser.parse_args(argv)
    only = args.only.split(",") if args.only else None
    print(json.dumps(run_anchors(args.quick, only), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
