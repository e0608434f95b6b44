"""asyncio shells around the pure HA cores: sockets, clocks and the commitlog live here.

    HAService    master: listens on haListenPort; one HAConnection (push loop + report
                 reader) per slave; feeds slave acks to HAServiceCore
    HAClient     slave: connects to the master's HA address, reconciles its log with the
                 master's epochs, appends pushed bytes at exactly their offset, flushes per
                 flushDiskType (via the sink), reports its max offset

Wire (ours on top of RocketMQ's classic stream): right after connect each side sends one
length-prefixed JSON frame (layout.FRAME_LEN + JSON, capped at 64 KiB and checked before
reading): slave hello `{"broker_id", "max_offset"}`, master welcome `{"epochs":
[[epoch, start], ...], "max_offset", "min_offset"}`. This is RocketMQ 5's HANDSHAKE
stage: the slave needs the master's epochs to find the consistent point before it
reports. Then the classic stream: 8-byte reports up, 12-byte-header pushes down.

Security (`PeerSecurity`, node/peer_auth.py): with a cluster secret the master runs the
mutual challenge-response (listener "ha") on every new connection before it reads the
hello, and the slave checks the master's proof before it sends anything; with TLS the
listener requires a client certificate from the cluster CA (mutual TLS).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import socket
import ssl
import time
from typing import Callable, Protocol

from ha.protocol import HAProtocolError, PushDecoder, ReportDecoder, encode_report
from ha.replication import (CloseLink, ConnState, HAClientCore, HAConnectionCore, HAServiceCore, HATimings,
                            PushVerdict, SendPush)
from node import limits, peer_auth, tls
from node.peer_auth import NO_SECURITY, PeerSecurity
from node.store import layout as L
from node.store.cold_reads import read_without_stalling
from node.store.errors import StoreError

log = logging.getLogger(__name__)

HANDSHAKE_MAX_BYTES = 64 * 1024
HANDSHAKE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 3.0
READ_CHUNK_BYTES = 1024 * 1024
PUSH_READ_BYTES = 1024 * 1024   # master: commitlog bytes read at once per push round (then split at the cap)
TICK_S = 0.5          # how often idle loops look at the clock (heartbeats are 5 s, silence 20 s)


def now_ms() -> int:
    return int(time.monotonic() * 1000)


def encode_frame(obj: dict) -> bytes:
    raw = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    assert len(raw) <= HANDSHAKE_MAX_BYTES
    return L.FRAME_LEN.pack(len(raw)) + raw


async def read_frame(reader: asyncio.StreamReader, cap: int = HANDSHAKE_MAX_BYTES) -> dict:
    """One length-prefixed JSON frame; the length is checked against `cap` before the body is read."""
    (n,) = L.FRAME_LEN.unpack(await reader.readexactly(L.FRAME_LEN.size))
    if n > cap:
        raise HAProtocolError(f"handshake frame of {n} bytes exceeds the cap of {cap}")
    try:
        obj = json.loads(await reader.readexactly(n))
    except ValueError as e:
        raise HAProtocolError(f"handshake frame is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise HAProtocolError("handshake frame is not an object")
    return obj


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad address {addr!r}, expected host:port")
    return host, int(port)


class RateMeter:
    """Bytes per second over the last completed one-second window (haStatus TransferSpeed)."""

    WINDOW_MS = 1000

    def __init__(self) -> None:
        self._window_start = -1
        self._count = 0
        self._last_rate = 0.0

    def add(self, n: int, now: int) -> None:
        self._roll(now)
        self._count += n

    def per_second(self, now: int) -> float:
        self._roll(now)
        return self._last_rate

    def _roll(self, now: int) -> None:
        if self._window_start < 0:
            self._window_start = now
            return
        elapsed = now - self._window_start
        if elapsed >= self.WINDOW_MS:
            # A window that ended long ago with nothing since means the rate is 0 now.
            self._last_rate = self._count * 1000 / elapsed if elapsed < 2 * self.WINDOW_MS else 0.0
            self._window_start, self._count = now, 0


# ===================================================================================
# Master side
# ===================================================================================

class MasterSource(Protocol):
    """What the master's HA shell reads from the log."""

    segment_size: int

    def ha_max_offset(self) -> int: ...
    def ha_min_offset(self) -> int: ...
    def ha_read(self, offset: int, size: int) -> bytes: ...
    def ha_epochs(self) -> list[tuple[int, int]]: ...


class HAService:
    """Accepts slaves and pushes the commitlog to each of them."""

    def __init__(self, source: MasterSource, core: HAServiceCore, host: str, port: int,
                 timings: HATimings = HATimings(), on_ack: Callable[[], None] = lambda: None,
                 security: PeerSecurity = NO_SECURITY, self_id: str = "master"):
        self.security = security
        self.self_id = self_id
        self.auth_failures = 0
        self.source = source
        self.core = core
        self.host = host
        self.port = port
        self.t = timings
        self.on_ack = on_ack
        self._server: asyncio.base_events.Server | None = None
        self._conns: dict[int, tuple[asyncio.Event, HAConnectionCore, asyncio.StreamWriter]] = {}
        self._info: dict[int, dict] = {}     # per connection: peer, broker id, where transfer began, rate
        self._tasks: set[asyncio.Task] = set()
        self._ids = itertools.count(1)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self.port, reuse_address=True,
                                                  ssl=tls.count_failures(self.security.server_ssl, "ha"))
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("HA service listening on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for _, core, writer in list(self._conns.values()):
            core.close("master stopping")
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def notify_append(self) -> None:
        """New bytes in the commitlog: wake every push loop."""
        for wake, _, _ in self._conns.values():
            wake.set()

    def status(self) -> list[dict]:
        """One row per slave link (mqadmin haStatus): address, ack offset, diff, rate, in-sync."""
        master_max, now = self.source.ha_max_offset(), now_ms()
        in_sync_ids = self.core.in_sync_broker_ids(master_max, now)
        gap = self.t.max_gap_not_in_sync_bytes
        rows = []
        for cid, (_, core, _) in self._conns.items():
            info = self._info.get(cid, {})
            ack = core.slave_ack_offset
            bid = info.get("broker_id")
            in_sync = (bid in in_sync_ids) if bid is not None else (ack >= 0 and master_max - ack <= gap)
            rows.append({"conn": cid, "state": core.state.value, "addr": info.get("addr", ""), "broker_id": bid,
                         "slave_ack_offset": ack, "next_offset": core.next_offset,
                         "diff": master_max - ack if ack >= 0 else master_max,
                         "transferred_bytes_per_s": info["rate"].per_second(now) if "rate" in info else 0.0,
                         "in_sync": bool(in_sync), "transfer_from_where": info.get("from", -1)})
        return rows

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Every accepted connection counts, also one still in the secret handshake (haMaxConnections).
        if len(self._tasks) >= self.t.max_connections:
            limits.REJECTIONS.add("ha_connections")
            log.warning("HA: refusing slave connection: %d already (haMaxConnections)", len(self._tasks))
            writer.close()
            return
        task = asyncio.get_running_loop().create_task(self._serve(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn_id = next(self._ids)
        peer = writer.get_extra_info("peername")
        reports: asyncio.Task | None = None
        try:
            if self.security.secret is not None:   # before any frame is read
                try:
                    await peer_auth.accept_peer(reader, writer, self.security.secret, "ha", self.self_id)
                except peer_auth.PeerAuthError:
                    self.auth_failures += 1      # counted and logged (rate-limited) by peer_auth
                    return
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):   # not wait_for: it can lose a cancel (3.11)
                hello = await read_frame(reader)
            broker_id = hello.get("broker_id") if isinstance(hello.get("broker_id"), int) else None
            writer.write(encode_frame({"epochs": self.source.ha_epochs(), "max_offset": self.source.ha_max_offset(),
                                       "min_offset": self.source.ha_min_offset()}))
            await writer.drain()
            core = HAConnectionCore(self.source.segment_size, now_ms(), self.t)
            wake = asyncio.Event()
            self._conns[conn_id] = (wake, core, writer)
            addr = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)
            self._info[conn_id] = {"addr": addr, "broker_id": broker_id, "from": -1, "rate": RateMeter()}
            log.info("HA: slave %s (broker %s) connected as conn %d", peer, broker_id, conn_id)
            reports = asyncio.get_running_loop().create_task(self._read_reports(reader, conn_id, broker_id))
            await self._push_loop(writer, core, wake, self._info[conn_id], conn_id)
            # A refused report (a slave ahead of us, or going back) means that slave cannot follow
            # until it truncates: a warning, not a quiet info line.
            (log.warning if core.close_reason.startswith("slave at") or "went back" in core.close_reason
             else log.info)("HA: conn %d to %s closed: %s", conn_id, peer, core.close_reason)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, StoreError) as e:
            log.warning("HA: conn %d to %s failed: %r", conn_id, peer, e)
        except Exception as e:   # noqa: BLE001 - never end a slave's link without a word
            log.error("HA: conn %d to %s failed unexpectedly: %r", conn_id, peer, e, exc_info=True)
        finally:
            if reports is not None:
                reports.cancel()
            self._conns.pop(conn_id, None)
            self._info.pop(conn_id, None)
            self.core.remove(conn_id)
            writer.close()

    async def _read_reports(self, reader: asyncio.StreamReader, conn_id: int, broker_id: int | None) -> None:
        wake, core, _ = self._conns[conn_id]
        dec = ReportDecoder()
        try:
            while core.state is not ConnState.CLOSED:
                data = await reader.read(4096)
                if not data:
                    core.close("slave closed the connection")
                    break
                master_max, t = self.source.ha_max_offset(), now_ms()
                for r in dec.feed(data):
                    core.on_report(r.max_offset, master_max, t)
                    if core.state is ConnState.CLOSED:
                        break
                    self.core.on_report(conn_id, broker_id, r.max_offset, t, master_max)
                self.on_ack()
        except (OSError, StoreError) as e:
            core.close(f"report stream failed: {e!r}")
        except Exception as e:   # noqa: BLE001 - close the link loudly rather than stop reading acks
            log.error("HA: conn %d: report handling failed unexpectedly: %r", conn_id, e, exc_info=True)
            core.close(f"report handling failed: {e!r}")
        finally:
            wake.set()

    async def _push_loop(self, writer: asyncio.StreamWriter, core: HAConnectionCore, wake: asyncio.Event,
                         info: dict, conn_id: int) -> None:
        cap = self.t.max_transfer_bytes
        while core.state is not ConnState.CLOSED:
            master_max = self.source.ha_max_offset()
            act = core.next_action(now_ms(), master_max, self.source.ha_min_offset(), PUSH_READ_BYTES)
            if isinstance(act, CloseLink):
                return
            if isinstance(act, SendPush):
                # One read of up to PUSH_READ_BYTES, written as pushes of at most `cap` bytes each
                # and drained once: the per-push work is a header and a slice.
                # Old bytes (a slave catching up from far back) are read by a worker, not on
                # the loop (node/store/cold_reads.py).
                data = await read_without_stalling(self.source.ha_read, act.offset, act.size) if act.size else b""
                if core.state is ConnState.CLOSED:
                    return
                if act.size and not data:
                    core.close(f"cannot read {act.size} bytes at {act.offset}")
                    return
                view, frames, t = memoryview(data), [], now_ms()
                for pos in range(0, max(1, len(data)), cap):
                    part = view[pos:pos + cap]
                    frames += (L.HA_PUSH_HEADER.pack(act.offset + pos, len(part)), part)
                    core.pushed(act.offset + pos, len(part), t)
                self.core.on_push(conn_id, master_max, t)   # haMaxTimeSlaveNotCatchup sample
                writer.writelines(frames)
                await writer.drain()   # backpressure: at most one read's worth queued past the socket buffer
                if info["from"] < 0:
                    info["from"] = act.offset
                info["rate"].add(len(data), t)
                continue
            wake.clear()
            try:
                async with asyncio.timeout(TICK_S):   # not wait_for: it may swallow a racing cancel
                    await wake.wait()
            except TimeoutError:
                pass


# ===================================================================================
# Slave side
# ===================================================================================

class SlaveSink(Protocol):
    """What the slave's HA shell does to the log."""

    segment_size: int

    def ha_max_offset(self) -> int: ...
    async def ha_reconcile(self, master_epochs: list[tuple[int, int]], master_max: int, master_min: int) -> None: ...
    async def ha_append(self, verdict: PushVerdict, offset: int, data: bytes) -> None: ...
    async def ha_after_batch(self) -> None: ...
    async def ha_settle(self) -> None: ...


class HAClient:
    """Keeps a link to the master; reconnects after any failure (1 s, then up to 5 s apart)."""

    def __init__(self, master_addr: str, sink: SlaveSink, broker_id: int, timings: HATimings = HATimings(),
                 security: PeerSecurity = NO_SECURITY):
        self.security = security
        self.master_addr = master_addr
        self.sink = sink
        self.broker_id = broker_id
        self.t = timings
        self.connected = False
        self.last_error = ""
        self.sessions = 0
        self.last_read_ms = 0         # wall clock (ms) of the last bytes from the master
        self.last_write_ms = 0        # wall clock (ms) of the last report to the master
        self.rate = RateMeter()
        self.master_offset_seen = -1  # the master's max offset as of the handshake or the last push end
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.unexpected_errors = 0    # sessions that ended on an error no handler expected
        self.stalled_sessions = 0     # consecutive sessions that ended without receiving one byte
        self._session_bytes = 0       # bytes received in the current session

    def start(self) -> None:
        assert self._task is None
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"ha-client->{self.master_addr}")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.connected = False

    def status(self) -> dict:
        return {"master_ha_addr": self.master_addr, "connected": self.connected, "sessions": self.sessions,
                "last_error": self.last_error, "max_offset": self.sink.ha_max_offset(),
                "transferred_bytes_per_s": self.rate.per_second(now_ms()),
                "last_read_ms": self.last_read_ms, "last_write_ms": self.last_write_ms,
                "master_offset_seen": self.master_offset_seen, "stalled_sessions": self.stalled_sessions,
                "unexpected_errors": self.unexpected_errors}

    async def _run(self) -> None:
        backoff = 1.0
        while not self._stopping:
            try:
                await self._session()
                backoff = 1.0
            except peer_auth.PeerAuthError as e:
                peer_auth.FAILURES.record("ha_dial", self.master_addr, str(e))
                self.last_error = repr(e)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, StoreError) as e:
                # Link failures (master down, reset, silence) stay quiet here: `_note_no_progress`
                # reports a run of them. Anything else, a local I/O error included (the slave's
                # disk full while it truncates or appends), is said every time.
                if not isinstance(e, (ConnectionError, socket.gaierror, asyncio.TimeoutError,
                                      asyncio.IncompleteReadError)):
                    log.warning("HA client: link to %s dropped: %r", self.master_addr, e)
                self.last_error = repr(e)
            except Exception as e:   # noqa: BLE001 - a bug must not end replication silently
                # Anything else (an assertion, a listener's error) used to end this task without a
                # word, and the slave then replicated nothing until restarted: say it, and retry.
                self.unexpected_errors += 1
                log.error("HA client: session with %s failed unexpectedly: %r (retrying)", self.master_addr, e,
                          exc_info=True)
                self.last_error = repr(e)
            self.connected = False
            self._note_no_progress()
            await asyncio.sleep(backoff)
            backoff = min(5.0, backoff * 2)

    def _note_no_progress(self) -> None:
        """A session that ended before any byte arrived made no progress. Say so loudly (the
        first time, then every 10th), so a slave the master keeps refusing never stalls quietly."""
        if self._session_bytes > 0:
            self.stalled_sessions = 0
            return
        self.stalled_sessions += 1
        if self.stalled_sessions in (1, 3) or self.stalled_sessions % 10 == 0:
            log.warning("HA client: %d session(s) in a row with %s ended before any byte arrived "
                        "(slave max offset %d, last error %s)", self.stalled_sessions, self.master_addr,
                        self.sink.ha_max_offset(), self.last_error or "none")

    async def _session(self) -> None:
        self._session_bytes = 0
        host, port = split_addr(self.master_addr)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(host, port, ssl=self.security.client_ssl)
        except ssl.SSLError as e:     # the master's certificate is not trusted, or it refused ours
            tls.HANDSHAKE_FAILURES.record("ha_dial", f"{host}:{port}", tls.reason(e))
            raise
        try:
            if self.security.secret is not None:
                await peer_auth.connect_peer(reader, writer, self.security.secret, "ha", f"broker-{self.broker_id}")
            writer.write(encode_frame({"broker_id": self.broker_id, "max_offset": self.sink.ha_max_offset()}))
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                welcome = await read_frame(reader)
            epochs = [(int(e), int(s)) for e, s in welcome.get("epochs", [])]
            self.master_offset_seen = max(self.master_offset_seen, int(welcome.get("max_offset", 0)))
            await self.sink.ha_reconcile(epochs, int(welcome.get("max_offset", 0)), int(welcome.get("min_offset", 0)))
            self.sessions += 1
            self.connected = True
            log.info("HA client: connected to %s at offset %d", self.master_addr, self.sink.ha_max_offset())
            await self._transfer(reader, writer)
        finally:
            writer.close()

    async def _transfer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        core = HAClientCore(now_ms(), self.t)
        dec = PushDecoder(self.t.max_transfer_bytes)
        await self._report(writer, core)
        while True:
            try:
                async with asyncio.timeout(TICK_S):   # not wait_for: it may swallow a racing cancel
                    data = await reader.read(READ_CHUNK_BYTES)
            except TimeoutError:
                data = None
            if data == b"":
                raise ConnectionResetError("master closed the HA connection")
            if data:
                self.last_read_ms = int(time.time() * 1000)
                self._session_bytes += len(data)
                self.rate.add(len(data), now_ms())
                await self._apply(core, dec, data)
                await self.sink.ha_after_batch()   # flush per flushDiskType before we report it
                await self.sink.ha_settle()        # framing checked, committed offset moved: then report
            if core.check_silence(now_ms()):
                raise asyncio.TimeoutError(core.close_reason)
            await self._report(writer, core)

    async def _apply(self, core: HAClientCore, dec: PushDecoder, data: bytes) -> None:
        """Check each push in order, and write contiguous pushes of one file in one append."""
        seg = self.sink.segment_size
        run: list[bytes] = []        # in-step pushes not written yet, contiguous from run_off
        run_off = own = self.sink.ha_max_offset()
        for push in dec.feed(data):
            verdict = core.on_push(push.offset, len(push.data), own, now_ms())
            self.master_offset_seen = max(self.master_offset_seen, push.end)
            if verdict is PushVerdict.HEARTBEAT:
                continue
            if verdict is PushVerdict.APPEND and run and push.offset // seg == run_off // seg:
                run.append(push.data)
            else:
                await self._append_run(run_off, run)
                run = []
                if verdict is PushVerdict.DROP:
                    raise HAProtocolError(core.close_reason)
                if verdict is PushVerdict.RESET_AND_APPEND:
                    await self.sink.ha_append(verdict, push.offset, push.data)
                else:
                    run_off, run = push.offset, [push.data]
            own = push.end
        await self._append_run(run_off, run)

    async def _append_run(self, offset: int, run: list[bytes]) -> None:
        if run:
            await self.sink.ha_append(PushVerdict.APPEND, offset, run[0] if len(run) == 1 else b"".join(run))

    async def _report(self, writer: asyncio.StreamWriter, core: HAClientCore) -> None:
        if self._report_now(writer, core):
            await writer.drain()

    def _report_now(self, writer: asyncio.StreamWriter, core: HAClientCore) -> bool:
        """Write a report if one is due (no await: the caller drains). True if one was written."""
        off = core.report_due(self.sink.ha_max_offset(), now_ms())
        if off is None:
            return False
        writer.write(encode_report(off))
        self.last_write_ms = int(time.time() * 1000)
        core.reported(off, now_ms())
        return True
