"""A fault-injecting TCP proxy for partition and latency drills (asyncio, loopback or containers).

One `Link` listens on a port and forwards every accepted connection to one target.
Each direction of a link has its own rule, so one-way partitions are possible:

    up    bytes from the connecting client towards the target
    down  bytes from the target back to the client

Rules (per direction):
    pass       forward as they come
    delay      forward after `delay_ms`, in order (a bounded buffer holds them meanwhile)
    blackhole  read and discard: the sender sees a healthy connection, nothing arrives,
               like packets lost in a partition. A connection that lost bytes can never be
               trusted again (its byte stream has a hole), so when the rule is lifted such
               connections are cut, and the peers reconnect, as after a real TCP timeout.
    drop       cut the connection (RST) as soon as a byte flows that way, and cut the open
               ones when the rule is set: the sender sees resets, as from a closed port.

A DLedger group has one Link per ordered pair of nodes (a node only sends on its own
outbound connection to a peer), so "isolate n0" is: every link into and out of n0 set to
blackhole (or drop); a bridge partition leaves one node connected to both sides.

`ProxyHub` runs links on a private event loop in a background thread so blocking code
(tests, drills) can drive it. The CLI runs links in the foreground and takes commands on
a small line-based control port:

    python -m deploy.faultproxy --link n0-n1=127.0.0.1:0:127.0.0.1:40912 \
        --link n1-n0=127.0.0.1:0:127.0.0.1:40911 --control 127.0.0.1:0
    # prints {"links": {"n0-n1": port, ...}, "control": port} on its first line, then:
    printf 'set n0-n1 up blackhole\\n' | nc 127.0.0.1 CONTROL_PORT
    printf 'set * both delay 200\\n'   | nc 127.0.0.1 CONTROL_PORT
    printf 'heal *\\n'                 | nc 127.0.0.1 CONTROL_PORT
    printf 'status\\n'                 | nc 127.0.0.1 CONTROL_PORT

Every control reply is one JSON line: {"ok": true, ...} or {"ok": false, "error": "..."}.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import enum
import fnmatch
import json
import logging
import signal
import sys
import threading
from dataclasses import dataclass

log = logging.getLogger("faultproxy")

UP, DOWN = "up", "down"
DIRECTIONS = (UP, DOWN)
READ_CHUNK_BYTES = 64 * 1024
# Bytes a delayed direction may hold before the proxy stops reading from the sender.
DELAY_BUFFER_MAX_BYTES = 64 * 1024 * 1024
# Longest delay a rule may ask for, ms (a larger one is surely a typo).
DELAY_MAX_MS = 600_000
# Connections one link keeps open at once; more are refused (closed at accept).
MAX_CONNECTIONS_PER_LINK = 1024
CONNECT_TIMEOUT_S = 2.0
CONTROL_LINE_MAX_BYTES = 4096


class FaultProxyError(ValueError):
    """A bad rule, address or command; the message names it."""


class Mode(enum.Enum):
    PASS = "pass"
    DELAY = "delay"
    BLACKHOLE = "blackhole"
    DROP = "drop"


@dataclass(frozen=True)
class Rule:
    mode: Mode = Mode.PASS
    # DELAY only: how long each chunk is held, ms.
    delay_ms: int = 0

    @staticmethod
    def parse(mode: str, delay_ms: int | str | None = None) -> "Rule":
        try:
            m = Mode(str(mode).lower())
        except ValueError:
            raise FaultProxyError(f"unknown mode {mode!r}; use one of {[x.value for x in Mode]}") from None
        if m is not Mode.DELAY:
            if delay_ms not in (None, 0, "0"):
                raise FaultProxyError(f"delay_ms is only for mode delay, got mode {m.value}")
            return Rule(m)
        try:
            d = int(delay_ms) if delay_ms is not None else -1
        except (TypeError, ValueError):
            raise FaultProxyError(f"delay_ms must be an integer, got {delay_ms!r}") from None
        if not 0 <= d <= DELAY_MAX_MS:
            raise FaultProxyError(f"delay needs delay_ms in 0..{DELAY_MAX_MS}, got {delay_ms!r}")
        return Rule(m, d)


PASS = Rule()


def parse_address(text: str, what: str = "address") -> tuple[str, int]:
    host, sep, port = str(text).rpartition(":")
    if not sep or not host:
        raise FaultProxyError(f"{what} must be host:port, got {text!r}")
    try:
        p = int(port)
    except ValueError:
        raise FaultProxyError(f"{what} port must be an integer, got {text!r}") from None
    if not 0 <= p <= 65535:
        raise FaultProxyError(f"{what} port must be 0..65535, got {p}")
    return host, p


class _Pipe:
    """One direction of one connection: read from `reader`, apply the rule, write to `writer`."""

    def __init__(self, conn: "_Conn", direction: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.conn = conn
        self.direction = direction
        self.reader = reader
        self.writer = writer
        self.lost_bytes = 0          # > 0: this byte stream has a hole; the connection must be cut
        self.buffered = 0
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.queued = asyncio.Event()
        self.room = asyncio.Event()
        self.room.set()

    async def pump(self) -> None:
        link = self.conn.link
        loop = asyncio.get_running_loop()
        while True:
            data = await self.reader.read(READ_CHUNK_BYTES)
            if not data:
                break
            rule = link.rules[self.direction]
            if rule.mode is Mode.DROP:
                link.counters[f"{self.direction}_dropped_connections"] += 1
                self.conn.abort()
                return
            if rule.mode is Mode.BLACKHOLE:
                self.lost_bytes += len(data)
                link.counters[f"{self.direction}_discarded_bytes"] += len(data)
                continue
            if self.lost_bytes:
                continue  # the stream already has a hole; nothing after it is forwarded
            due = loop.time() + (rule.delay_ms / 1000 if rule.mode is Mode.DELAY else 0.0)
            while self.buffered + len(data) > DELAY_BUFFER_MAX_BYTES and self.buffered:
                self.room.clear()
                await self.room.wait()
            self.queue.append((due, data))
            self.buffered += len(data)
            self.queued.set()
        self.queue.append((0.0, b""))   # end of stream: half-close the other side after the data
        self.queued.set()

    async def deliver(self) -> None:
        link = self.conn.link
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self.queued.clear()
                await self.queued.wait()
            due, data = self.queue[0]
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self.queue.popleft()
            self.buffered -= len(data)
            self.room.set()
            if not data:
                if self.writer.can_write_eof():
                    self.writer.write_eof()
                return
            self.writer.write(data)
            link.counters[f"{self.direction}_forwarded_bytes"] += len(data)
            await self.writer.drain()


class _Conn:
    def __init__(self, link: "Link", client: tuple, server: tuple):
        self.link = link
        self.client_reader, self.client_writer = client
        self.server_reader, self.server_writer = server
        self.pipes = {UP: _Pipe(self, UP, self.client_reader, self.server_writer),
                      DOWN: _Pipe(self, DOWN, self.server_reader, self.client_writer)}
        self.tasks: list[asyncio.Task] = []
        self.closed = False

    @property
    def lost_bytes(self) -> int:
        return sum(p.lost_bytes for p in self.pipes.values())

    async def run(self) -> None:
        self.tasks = [asyncio.create_task(p.pump()) for p in self.pipes.values()] + \
                     [asyncio.create_task(p.deliver()) for p in self.pipes.values()]
        try:
            await asyncio.gather(*self.tasks)
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self.abort()

    def abort(self) -> None:
        """Cut both sides at once (RST where the OS allows) and stop the pumps."""
        if self.closed:
            return
        self.closed = True
        for w in (self.client_writer, self.server_writer):
            _abort_writer(w)
        current = asyncio.current_task()
        for t in self.tasks:
            if t is not current:
                t.cancel()


def _abort_writer(writer: asyncio.StreamWriter) -> None:
    transport = writer.transport
    if transport is not None and not transport.is_closing():
        transport.abort()


class Link:
    """One listening port forwarding to one target, with a rule per direction."""

    def __init__(self, name: str, target: tuple[str, int], listen: tuple[str, int] = ("127.0.0.1", 0)):
        self.name = name
        self.target = target
        self.listen = listen
        self.rules: dict[str, Rule] = {UP: PASS, DOWN: PASS}
        self.counters: collections.Counter = collections.Counter()
        self._conns: set[_Conn] = set()
        self._server: asyncio.base_events.Server | None = None
        self._handlers: set[asyncio.Task] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, self.listen[0], self.listen[1],
                                                  limit=READ_CHUNK_BYTES * 2)
        return self.port

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            c.abort()
        for t in list(self._handlers):
            t.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def set_rule(self, direction: str, rule: Rule) -> None:
        """Set one direction ("up", "down" or "both"); cuts connections the change would corrupt."""
        dirs = DIRECTIONS if direction == "both" else (direction,)
        for d in dirs:
            if d not in DIRECTIONS:
                raise FaultProxyError(f"direction must be up, down or both, got {direction!r}")
        for d in dirs:
            self.rules[d] = rule
        for c in list(self._conns):
            if rule.mode is Mode.DROP or (c.lost_bytes and rule.mode is not Mode.BLACKHOLE):
                c.abort()

    def heal(self) -> None:
        self.set_rule("both", PASS)

    def status(self) -> dict:
        return {"listen": self.port if self._server else None, "target": f"{self.target[0]}:{self.target[1]}",
                "up": _rule_text(self.rules[UP]), "down": _rule_text(self.rules[DOWN]),
                "connections": len(self._conns), "counters": dict(self.counters)}

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            self.counters["accepted"] += 1
            if len(self._conns) >= MAX_CONNECTIONS_PER_LINK or _refuses(self.rules):
                self.counters["refused"] += 1
                _abort_writer(writer)
                return
            try:
                server = await asyncio.wait_for(asyncio.open_connection(*self.target, limit=READ_CHUNK_BYTES * 2),
                                                CONNECT_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError):
                self.counters["target_unreachable"] += 1
                _abort_writer(writer)
                return
            conn = _Conn(self, (reader, writer), server)
            self._conns.add(conn)
            try:
                await conn.run()
            finally:
                self._conns.discard(conn)
        except asyncio.CancelledError:
            _abort_writer(writer)
        finally:
            self._handlers.discard(task)


def _refuses(rules: dict[str, Rule]) -> bool:
    """A link dropping both ways refuses connections outright (like a closed port)."""
    return rules[UP].mode is Mode.DROP and rules[DOWN].mode is Mode.DROP


def _rule_text(rule: Rule) -> str:
    return f"delay {rule.delay_ms}" if rule.mode is Mode.DELAY else rule.mode.value


class ProxyHub:
    """Links on a private event loop in a daemon thread; every method is thread-safe and blocking."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="faultproxy", daemon=True)
        self._thread.start()
        self.links: dict[str, Link] = {}

    def _call(self, coro, timeout_s: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def _sync(self, fn, *args):
        async def run():
            return fn(*args)
        return self._call(run())

    def add(self, name: str, target: tuple[str, int], listen: tuple[str, int] = ("127.0.0.1", 0)) -> int:
        """Start a link; returns the port it listens on."""
        if name in self.links:
            raise FaultProxyError(f"link {name!r} exists")
        link = Link(name, target, listen)
        port = self._call(link.start())
        self.links[name] = link
        return port

    def select(self, pattern: str) -> list[Link]:
        found = [link for name, link in self.links.items() if fnmatch.fnmatchcase(name, pattern)]
        if not found:
            raise FaultProxyError(f"no link matches {pattern!r}; links: {sorted(self.links)}")
        return found

    def set(self, pattern: str, direction: str, mode: str, delay_ms: int | None = None) -> list[str]:
        rule = Rule.parse(mode, delay_ms)
        links = self.select(pattern)
        for link in links:
            self._sync(link.set_rule, direction, rule)
        return [link.name for link in links]

    def heal(self, pattern: str = "*") -> list[str]:
        links = self.select(pattern)
        for link in links:
            self._sync(link.heal)
        return [link.name for link in links]

    def status(self) -> dict:
        return self._sync(lambda: {name: link.status() for name, link in self.links.items()})

    def close(self) -> None:
        async def stop_all():
            await asyncio.gather(*(link.stop() for link in self.links.values()), return_exceptions=True)
        try:
            self._call(stop_all())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
            if not self._thread.is_alive():
                self._loop.close()


# --- control protocol (CLI) -------------------------------------------------------------------
def run_command(links: dict[str, Link], line: str) -> dict:
    """Apply one control line to `links` (on their loop); returns the reply document."""
    words = line.split()
    if not words:
        raise FaultProxyError("empty command; use set, heal or status")
    verb, args = words[0].lower(), words[1:]
    if verb == "status":
        return {"ok": True, "links": {n: link.status() for n, link in links.items()}}
    if verb not in ("set", "heal"):
        raise FaultProxyError(f"unknown command {verb!r}; use set, heal or status")
    if not args:
        raise FaultProxyError(f"{verb} needs a link name or pattern")
    chosen = [link for n, link in links.items() if fnmatch.fnmatchcase(n, args[0])]
    if not chosen:
        raise FaultProxyError(f"no link matches {args[0]!r}; links: {sorted(links)}")
    if verb == "heal":
        if len(args) != 1:
            raise FaultProxyError("usage: heal PATTERN")
        for link in chosen:
            link.heal()
    else:
        if len(args) not in (3, 4):
            raise FaultProxyError("usage: set PATTERN up|down|both pass|delay|blackhole|drop [delay_ms]")
        rule = Rule.parse(args[2], args[3] if len(args) == 4 else None)
        for link in chosen:
            link.set_rule(args[1], rule)
    return {"ok": True, "links": [link.name for link in chosen]}


async def _control(links: dict[str, Link], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        for _ in range(10_000):  # commands per control connection
            try:
                raw = await reader.readuntil(b"\n")
            except asyncio.LimitOverrunError:
                writer.write(b'{"ok": false, "error": "command line too long"}\n')
                return
            except asyncio.IncompleteReadError as e:
                raw = e.partial
                if not raw.strip():
                    return
            try:
                reply = run_command(links, raw.decode("utf-8", "replace"))
            except FaultProxyError as e:
                reply = {"ok": False, "error": str(e)}
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


def parse_link_spec(spec: str) -> tuple[str, tuple[str, int], tuple[str, int]]:
    """NAME=LISTEN_HOST:LISTEN_PORT:TARGET_HOST:TARGET_PORT"""
    name, sep, rest = spec.partition("=")
    parts = rest.split(":")
    if not sep or not name or len(parts) != 4:
        raise FaultProxyError(f"--link must be NAME=LISTEN_HOST:PORT:TARGET_HOST:PORT, got {spec!r}")
    return (name, parse_address(f"{parts[0]}:{parts[1]}", "listen address"),
            parse_address(f"{parts[2]}:{parts[3]}", "target address"))


async def _serve(specs: list[tuple[str, tuple[str, int], tuple[str, int]]], control: tuple[str, int]) -> int:
    links: dict[str, Link] = {}
    for name, listen, target in specs:
        if name in links:
            raise FaultProxyError(f"link {name!r} given twice")
        links[name] = Link(name, target, listen)
        await links[name].start()
    server = await asyncio.start_server(lambda r, w: _control(links, r, w), control[0], control[1],
                                        limit=CONTROL_LINE_MAX_BYTES)
    print(json.dumps({"links": {n: link.port for n, link in links.items()},
                      "control": server.sockets[0].getsockname()[1]}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()
    await asyncio.gather(*(link.stop() for link in links.values()), return_exceptions=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.faultproxy",
                                     description="Fault-injecting TCP proxy (per-direction pass/delay/blackhole/drop).")
    parser.add_argument("--link", action="append", required=True,
                        help="NAME=LISTEN_HOST:LISTEN_PORT:TARGET_HOST:TARGET_PORT (port 0 = any free port)")
    parser.add_argument("--control", default="127.0.0.1:0", help="control address host:port (default any port)")
    args = parser.parse_args(argv)
    try:
        specs = [parse_link_spec(s) for s in args.link]
        control = parse_address(args.control, "--control")
        return asyncio.run(_serve(specs, control))
    except FaultProxyError as e:
        print(f"faultproxy: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"faultproxy: cannot listen: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
