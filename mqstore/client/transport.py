"""HTTP + msgpack to broker groups, following NOT_LEADER hints (asyncio, aiohttp).

A broker group is the set of node API addresses that serve the same queues (one node for
standalone, three or five for a DLedger group, master and slaves for classic HA). Requests
go to the node believed to lead; a `{"error": "NOT_LEADER", "leader": "host:port"}` answer
moves the guess to the hint, an unreachable node moves it to the next address, and both
retry within the call's deadline. Every loop is bounded by that deadline and a hop count.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import aiohttp
import msgpack

from mqstore.client.errors import MQBrokerError, MQConfigError, MQConnectError
from mqstore.client.stream import StreamConnection, StreamRefused
from node.acl import sign_headers

log = logging.getLogger(__name__)

MSGPACK = "application/x-msgpack"
MAX_HOPS = 32                   # bound on redirects + address changes within one call
ELECTION_BACKOFF_S = 0.1        # pause when a group has no known leader (election running)
STREAM_RECHECK_S = 30.0         # a node without a usable produce stream is asked again after this
STREAM_CONNECT_TIMEOUT_S = 2.0


@dataclass(slots=True)
class BrokerGroup:
    name: str
    addrs: list[str]
    leader: str | None = None
    _next: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if not self.addrs:
            raise MQConfigError(f"broker group {self.name!r} has no addresses")
        for a in self.addrs:
            host, _, port = a.rpartition(":")
            if not host or not port.isdigit():
                raise MQConfigError(f"broker address {a!r} must be host:port")

    def target(self) -> str:
        return self.leader or self.addrs[self._next % len(self.addrs)]

    def failed(self, addr: str) -> None:
        if self.leader == addr:
            self.leader = None
        self._next = (self.addrs.index(addr) + 1) if addr in self.addrs else self._next + 1

    def redirect(self, hint: str) -> None:
        if hint not in self.addrs:
            self.addrs.append(hint)    # a node we were not told about (e.g. a controller route)
        self.leader = hint


class Transport:
    """`access_key`/`secret_key` sign every request (aclEnable nodes, docs/security.md); both
    default to the environment's MQSTORE_ACCESS_KEY / MQSTORE_SECRET_KEY, and none = unsigned.
    `tls_ca` (default: the environment's MQSTORE_TLS_CA) makes every request https, verifying
    the nodes against that PEM CA file (tlsEnable nodes)."""

    def __init__(self, request_timeout_s: float = 5.0, access_key: str | None = None,
                 secret_key: str | None = None, tls_ca: str | None = None, stream: bool | None = None):
        if request_timeout_s <= 0:
            raise MQConfigError("request_timeout_s must be > 0")
        self.request_timeout_s = request_timeout_s
        self.access_key = access_key if access_key is not None else os.environ.get("MQSTORE_ACCESS_KEY")
        self.secret_key = secret_key if secret_key is not None else os.environ.get("MQSTORE_SECRET_KEY")
        if bool(self.access_key) != bool(self.secret_key):
            raise MQConfigError("give both access_key and secret_key (or MQSTORE_ACCESS_KEY and "
                                "MQSTORE_SECRET_KEY), or neither")
        from node.config import ConfigError
        from node.tls import client_context_from_env
        try:
            self.ssl_context = client_context_from_env(tls_ca)
        except (ConfigError, OSError) as e:
            raise MQConfigError(str(e)) from None
        self.scheme = "https" if self.ssl_context is not None else "http"
        self._session: aiohttp.ClientSession | None = None
        # Sends go on a node's produce stream when its /health names one (MQSTORE_STREAM=0: never).
        self.stream = stream if stream is not None else os.environ.get("MQSTORE_STREAM", "1") != "0"
        self._stream_ports: dict[str, tuple[int | None, float]] = {}   # API address -> (stream port or None, when)
        self._streams: dict[str, StreamConnection] = {}
        self._opening: dict[str, asyncio.Lock] = {}

    async def start(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
                limit=256, ssl=self.ssl_context if self.ssl_context is not None else True))

    async def close(self) -> None:
        for conn in self._streams.values():
            conn.close()
        self._streams.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _stream_to(self, addr: str, timeout_s: float) -> StreamConnection | None:
        """The open produce stream to the node at API address `addr`, opened on first use;
        None when the node has none (asked once, on /health). OSError when it cannot connect."""
        conn = self._streams.get(addr)
        if conn is not None and not conn.closed:
            return conn
        lock = self._opening.setdefault(addr, asyncio.Lock())
        async with lock:
            conn = self._streams.get(addr)
            if conn is not None and not conn.closed:
                return conn
            port, at = self._stream_ports.get(addr, (None, -STREAM_RECHECK_S))
            if port is None and time.monotonic() - at >= STREAM_RECHECK_S:
                health = await self._http(addr, "GET", "/health", None, {}, {"Accept": MSGPACK}, timeout_s)
                port = health[1].get("stream_port")
                port = port if isinstance(port, int) and 0 < port < 65536 else None
                self._stream_ports[addr] = (port, time.monotonic())
            if port is None:
                return None
            host = addr.rpartition(":")[0]
            try:
                conn = await StreamConnection.open(host, port, ssl_context=self.ssl_context,
                                                   access_key=self.access_key, secret_key=self.secret_key,
                                                   timeout_s=min(timeout_s, STREAM_CONNECT_TIMEOUT_S))
            except (OSError, asyncio.TimeoutError) as e:
                # The API answered but its stream port does not (a port mapping that publishes only
                # the API, a firewall): HTTP for this node, and a new look after STREAM_RECHECK_S.
                log.warning("produce stream %s:%s of %s unreachable (%r); sending over HTTP", host, port, addr, e)
                self._stream_ports[addr] = (None, time.monotonic())
                return None
            self._streams[addr] = conn
            return conn

    async def _http(self, addr: str, method: str, path: str, data: bytes | None, query: dict[str, str],
                    headers: dict[str, str], timeout_s: float) -> tuple[int, dict[str, Any]]:
        assert self._session is not None, "transport not started"
        async with self._session.request(method, f"{self.scheme}://{addr}{path}", data=data, params=query,
                                         headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            raw = await resp.read()
            return resp.status, _decode(raw, resp.content_type)

    async def call(self, group: BrokerGroup, method: str, path: str, doc: Any = None,
                   params: dict[str, Any] | None = None, timeout_s: float | None = None,
                   stream_topic: str | None = None) -> dict[str, Any]:
        """One request to the group's leader; retries NOT_LEADER and unreachable nodes until the deadline.
        With `stream_topic` (a send, `doc` its body) it goes on the node's produce stream when there is one."""
        assert self._session is not None, "transport not started"
        budget = self.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        if stream_topic is not None and self.stream:
            async def on_stream(addr: str, left: float) -> tuple[int, dict[str, Any]]:
                conn = await self._stream_to(addr, left)
                if conn is None:
                    raise _NoStream()
                return await conn.send(stream_topic, doc, left)
            try:
                return await _with_redirects(group, budget, deadline, on_stream)
            except _NoStream:
                pass
        data = msgpack.packb(doc, use_bin_type=True) if doc is not None else None
        headers = {"Accept": MSGPACK, "Content-Type": MSGPACK}
        query = {k: str(v) for k, v in (params or {}).items() if v is not None}

        async def over_http(addr: str, left: float) -> tuple[int, dict[str, Any]]:
            signed = headers
            if self.access_key:      # a fresh nonce and timestamp per attempt: a retry is not a replay
                signed = {**headers, **sign_headers(self.access_key, self.secret_key or "", method, path, query,
                                                    data, int(time.time() * 1000))}
            return await self._http(addr, method, path, data, query, signed, left)
        return await _with_redirects(group, budget, deadline, over_http)


async def _with_redirects(group: BrokerGroup, budget: float, deadline: float,
                          attempt: Callable[[str, float], Awaitable[tuple[int, dict[str, Any]]]]) -> dict[str, Any]:
    """`attempt(addr, seconds left)` on the group's leader until an answer below 400: a
    NOT_LEADER answer moves to the hinted leader, an unreachable node to the next address,
    both within the deadline and MAX_HOPS; any other error answer is raised."""
    last: Exception | None = None
    refused = 0                 # consecutive nodes that could not be reached
    for _hop in range(MAX_HOPS):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        addr = group.target()
        try:
            status, body = await attempt(addr, left)
        except StreamRefused as e:
            status, body = e.status, e.doc     # e.g. a HELLO refused: that is the answer
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            last = e
            refused += 1
            if await _unreachable(group, addr, refused, deadline):
                break           # every node of the group is unreachable: fail fast, let the caller retry
            continue
        refused = 0
        if status < 400:
            group.leader = addr
            return body
        last = await _refused(group, addr, status, body, deadline)
    raise _gave_up(group, budget, last)


class _NoStream(Exception):
    """The node has no produce stream: send over HTTP."""


async def _unreachable(group: BrokerGroup, addr: str, refused: int, deadline: float) -> bool:
    """Move past a node that could not be reached; True when every node of the group failed in a row."""
    group.failed(addr)
    if refused >= len(group.addrs):
        return True
    await asyncio.sleep(min(ELECTION_BACKOFF_S, max(0.0, deadline - time.monotonic())))
    return False


async def _refused(group: BrokerGroup, addr: str, status: int, body: dict[str, Any], deadline: float) -> MQBrokerError:
    """An error answer: raised unless it is NOT_LEADER, which moves to the hinted leader (or
    waits out an election) and is returned as the last error seen."""
    err = MQBrokerError(str(body.get("error", "HTTP_ERROR")), str(body.get("message", ""))[:500],
                        bool(body.get("retriable", False)), body.get("leader"), status, addr)
    if err.code != "NOT_LEADER":
        raise err
    if err.leader and err.leader != addr:
        group.redirect(err.leader)
        return err
    group.failed(addr)     # no leader known yet: an election is running
    await asyncio.sleep(min(ELECTION_BACKOFF_S, max(0.0, deadline - time.monotonic())))
    return err


def _gave_up(group: BrokerGroup, budget: float, last: Exception | None) -> MQConnectError:
    if isinstance(last, MQBrokerError):
        return MQConnectError(f"no leader of broker group {group.name!r} answered within {budget:.1f}s: {last}")
    return MQConnectError(f"broker group {group.name!r} ({', '.join(group.addrs)}) unreachable: {last!r}")


def _decode(raw: bytes, ctype: str) -> dict[str, Any]:
    try:
        if ctype == MSGPACK:
            doc = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        else:
            import json
            doc = json.loads(raw.decode("utf-8"))
    except ValueError:
        return {"error": "BAD_RESPONSE", "message": raw[:200].decode("utf-8", "replace")}
    return doc if isinstance(doc, dict) else {"error": "BAD_RESPONSE", "message": repr(doc)[:200]}
