"""Hard limits on what a client or a peer can make a node hold, and the count of refusals.

Every limit is a broker.conf key (node/config.py) and every refusal is counted in
`rocketmq_limit_rejections_total{limit="..."}`. What each refusal looks like:

| limit label            | key                                  | refusal                                   |
|------------------------|--------------------------------------|-------------------------------------------|
| request_bytes          | maxRequestBytes                      | 413, decided on Content-Length before reading |
| message_size           | maxMessageSize                       | 413 MESSAGE_TOO_LARGE                     |
| batch_messages         | maxBatchMessages                     | 400 LIMIT_EXCEEDED                        |
| properties_count       | maxPropertiesPerMessage              | 400 LIMIT_EXCEEDED                        |
| property_name_bytes    | maxPropertyNameBytes                 | 400 LIMIT_EXCEEDED                        |
| property_value_bytes   | maxPropertyValueBytes                | 400 LIMIT_EXCEEDED                        |
| properties_bytes       | maxPropertiesBytes (<= 32,767)       | 400 LIMIT_EXCEEDED                        |
| keys_count             | maxKeysPerMessage                    | 400 LIMIT_EXCEEDED                        |
| topic_name, group_name | fixed: 127 / 120 chars of [%|a-zA-Z0-9_-] | 400 LIMIT_EXCEEDED (path parameters)  |
| inflight_per_client    | maxInflightRequestsPerClient         | 429 LIMIT_EXCEEDED, retriable; on a produce stream the node stops reading that connection until answers drain |
| long_poll_waiters      | longPollingMaxWaiters                | the pull answers at once (short polling)  |
| raft_connections       | raftMaxInboundConnections            | the connection is closed on accept        |
| ha_connections         | haMaxConnections                     | the connection is closed on accept        |
| topics                 | maxTopics                            | 400 LIMIT_EXCEEDED; nothing is created    |
| consumer_groups        | maxConsumerGroups                    | 400 LIMIT_EXCEEDED (a new group only)     |
| http_connections       | maxHttpConnections                   | the connection is closed on accept        |
| stream_connections     | maxStreamConnections                 | the connection is closed on accept        |
| stream_frame_bytes     | maxRequestBytes (a frame's payload)  | ERROR frame, then the connection closes   |

HTTP/1.1 serves one request at a time per connection, so a connection never has more
than one request in flight; the per-client bound (by remote address) covers clients that
open many connections, and maxHttpConnections all of them together: it counts every
accepted API socket, TLS handshakes in progress included (node/api_site.py). Peer frames
(Raft, HA) check their length before reading the payload (dledger/transport.py read_frame,
ha/protocol.py PushDecoder).

maxTopics and maxConsumerGroups bound what clients create: a topic or a group that
arrives through the replicated log (a follower applying the leader's records) or from the
controller is always applied, so replicas never disagree and never fail on it. A name being
created counts from the check until its record is applied (`reserve`), so concurrent
creations cannot overshoot the cap. A new consumer group is one with neither committed
offsets nor live members: its heartbeat or its first offset commit (or offset reset) is
refused; groups already tracked keep working.

The counters are process-wide (`REJECTIONS`): the Raft and HA listeners have no broker
to hand, and one process runs one node outside tests.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import threading
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Collection, Iterator

from aiohttp import web
from prometheus_client.core import CounterMetricFamily

from node.store import layout as L
from node.store.errors import BadRequest, MessageTooLarge

LIMIT_NAMES = ("request_bytes", "message_size", "batch_messages", "properties_count", "property_name_bytes",
               "property_value_bytes", "properties_bytes", "keys_count", "topic_name", "group_name",
               "inflight_per_client", "long_poll_waiters", "raft_connections", "ha_connections",
               "topics", "consumer_groups", "http_connections", "stream_connections",
               "stream_frame_bytes")
_NAME_RE = re.compile(r"^[%|a-zA-Z0-9_-]+$")


class LimitExceeded(BadRequest):
    """A request exceeds one of the limits above; `limit` is its metric label."""

    code = "LIMIT_EXCEEDED"

    def __init__(self, limit: str, message: str, http_status: int = 400, retriable: bool = False):
        assert limit in LIMIT_NAMES, limit
        super().__init__(message)
        self.limit = limit
        self.http_status = http_status
        self.retriable = retriable


class Rejections:
    """Refusals per limit label (a fixed label set: the series count is bounded)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(LIMIT_NAMES, 0)

    def add(self, limit: str) -> None:
        assert limit in self._counts, limit
        with self._lock:
            self._counts[limit] += 1

    def get(self, limit: str) -> int:
        return self._counts[limit]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


REJECTIONS = Rejections()


class RejectionsCollector:
    """`rocketmq_limit_rejections_total{limit}` for a node's registry (node/metrics.py)."""

    def __init__(self, rejections: Rejections = REJECTIONS):
        self.rejections = rejections

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily("rocketmq_limit_rejections", "Requests, messages and connections refused "
                                  "by a hard limit (node/limits.py)", labels=["limit"])
        for name, n in self.rejections.snapshot().items():
            fam.add_metric([name], n)
        yield fam


@dataclass(frozen=True, slots=True)
class Limits:
    """The limits of one node, read once from its BrokerConfig."""

    max_request_bytes: int = 32 * 1024 * 1024
    max_message_size: int = L.MAX_BODY_BYTES_DEFAULT
    max_batch_messages: int = 1024
    max_properties_per_message: int = 256
    max_property_name_bytes: int = 255
    max_property_value_bytes: int = 16_384
    max_properties_bytes: int = L.MAX_PROPERTIES_BYTES
    max_keys_per_message: int = 64
    max_inflight_requests_per_client: int = 4096
    long_polling_max_waiters: int = 10_000
    max_topics: int = 10_000
    max_consumer_groups: int = 10_000
    max_http_connections: int = 4096

    @classmethod
    def from_config(cls, config: Any) -> "Limits":
        defaults = cls()
        return cls(**{f: getattr(config, f, getattr(defaults, f)) for f in cls.__slots__})


_CURRENT: contextvars.ContextVar[Limits] = contextvars.ContextVar("mqstore_limits", default=Limits())


def current() -> Limits:
    """The limits of the node serving the current request (defaults outside a request)."""
    return _CURRENT.get()


@contextlib.contextmanager
def applied(lim: Limits) -> Iterator[None]:
    """`current()` is `lim` inside the block (a request handled outside the HTTP middleware)."""
    token = _CURRENT.set(lim)
    try:
        yield
    finally:
        _CURRENT.reset(token)


# --- checks the request parsers call ---------------------------------------------------------------
def check_batch(count: int, limits: Limits | None = None) -> None:
    lim = limits or current()
    if count > lim.max_batch_messages:
        raise LimitExceeded("batch_messages", f"{count} messages in one request; the limit (maxBatchMessages) "
                            f"is {lim.max_batch_messages}")


def check_keys(keys: list[str], where: str, limits: Limits | None = None) -> None:
    lim = limits or current()
    if len(keys) > lim.max_keys_per_message:
        raise LimitExceeded("keys_count", f"{where}.keys: {len(keys)} keys; the limit (maxKeysPerMessage) is "
                            f"{lim.max_keys_per_message}")


def check_properties(props: dict[str, str], where: str, limits: Limits | None = None) -> None:
    """Count, name and value lengths and the encoded total (name \\x01 value \\x02 per pair), in bytes."""
    lim = limits or current()
    if len(props) > lim.max_properties_per_message:
        raise LimitExceeded("properties_count", f"{where}.properties: {len(props)} entries; the limit "
                            f"(maxPropertiesPerMessage) is {lim.max_properties_per_message}")
    total = 0
    for k, v in props.items():
        nk, nv = len(k.encode("utf-8")), len(v.encode("utf-8"))
        if nk > lim.max_property_name_bytes:
            raise LimitExceeded("property_name_bytes", f"{where}.properties: a name of {nk} bytes; the limit "
                                f"(maxPropertyNameBytes) is {lim.max_property_name_bytes}")
        if nv > lim.max_property_value_bytes:
            raise LimitExceeded("property_value_bytes", f"{where}.properties[{k[:64]!r}]: {nv} bytes; the limit "
                                f"(maxPropertyValueBytes) is {lim.max_property_value_bytes}")
        total += nk + nv + 2
    if total > lim.max_properties_bytes:
        raise LimitExceeded("properties_bytes", f"{where}.properties: {total} bytes encoded; the limit "
                            f"(maxPropertiesBytes) is {lim.max_properties_bytes}")


def check_path_names(match_info: Any) -> None:
    """Topic and group names in the path, before any handler looks them up."""
    for name, cap, limit in (("topic", L.MAX_TOPIC_CHARS, "topic_name"), ("group", L.MAX_GROUP_CHARS, "group_name")):
        v = match_info.get(name)
        if v is not None and (len(v) > cap or not _NAME_RE.match(v)):
            raise LimitExceeded(limit, f"{name} {v[:140]!r} must be 1..{cap} chars of [%|a-zA-Z0-9_-]")


# --- topics and consumer groups a node holds -----------------------------------------------------------
_CAP_KEYS = {"topics": "maxTopics", "consumer_groups": "maxConsumerGroups"}
_CAP_WHAT = {"topics": "topic", "consumer_groups": "consumer group"}


def check_new_name(limit: str, name: str, known: Collection[str], cap: int,
                   pending: Collection[str] = ()) -> None:
    """Raise LimitExceeded(limit) when `name` is neither known nor pending and `cap` names are
    held already (known ones plus pending ones not yet known). cap 0 = unbounded."""
    if not cap or name in known or name in pending:
        return
    held = len(known) + sum(1 for p in pending if p not in known)
    if held >= cap:
        raise LimitExceeded(limit, f"cannot create {_CAP_WHAT[limit]} {name!r}: this node holds {held}; the "
                            f"limit ({_CAP_KEYS[limit]}) is {cap}")


@contextlib.contextmanager
def reserve(limit: str, name: str, known: Collection[str], pending: set[str], cap: int) -> Iterator[None]:
    """check_new_name, then hold `name` in `pending` for the block (while its record is appended
    and applied), so creations running concurrently count each other."""
    check_new_name(limit, name, known, cap, pending)
    if name in pending or name in known:
        yield
        return
    pending.add(name)
    try:
        yield
    finally:
        pending.discard(name)


# --- per-client in-flight requests ------------------------------------------------------------------
class Inflight:
    """Requests in flight per client address. An entry exists only while that client has a
    request in flight, so the table is bounded by the requests being served."""

    def __init__(self, cap: int):
        assert cap >= 1
        self.cap = cap
        self._by_client: dict[str, int] = {}

    def enter(self, client: str) -> bool:
        n = self._by_client.get(client, 0)
        if n >= self.cap:
            return False
        self._by_client[client] = n + 1
        return True

    def leave(self, client: str) -> None:
        n = self._by_client[client] - 1
        if n:
            self._by_client[client] = n
        else:
            del self._by_client[client]

    def count(self, client: str) -> int:
        return self._by_client.get(client, 0)


# --- inbound peer connections (Raft, HA) --------------------------------------------------------------
class ConnectionGate:
    """At most `cap` accepted connections at once on one listener; `limit` labels refusals."""

    def __init__(self, cap: int, limit: str, rejections: Rejections = REJECTIONS):
        assert cap >= 1
        assert limit in LIMIT_NAMES
        self.cap = cap
        self.limit = limit
        self.rejections = rejections
        self.open = 0

    def try_enter(self) -> bool:
        if self.open >= self.cap:
            self.rejections.add(self.limit)
            return False
        self.open += 1
        return True

    def leave(self) -> None:
        assert self.open > 0
        self.open -= 1


# --- the aiohttp middleware --------------------------------------------------------------------------
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _long_poll_full(request: web.Request, broker: Any) -> bool:
    if request.method != "GET" or "queue_id" not in request.match_info or "wait_ms" not in request.query:
        return False
    if request.query.get("wait_ms") in ("", "0"):
        return False
    waiters = getattr(broker, "_waiters", None)
    return bool(waiters is not None and waiters.full())


def middleware(limits: Limits, broker: Any = None, rejections: Rejections = REJECTIONS):
    """Checks that need no body (Content-Length, path names, in-flight count, long-poll room),
    and the count of every LimitExceeded / MessageTooLarge / 413 the handlers raise.

    Install it inside the error middleware, which renders the exceptions it lets through."""
    inflight = Inflight(limits.max_inflight_requests_per_client)

    @web.middleware
    async def limits_mw(request: web.Request, handler: Handler) -> web.StreamResponse:
        length = request.content_length
        if length is not None and length > limits.max_request_bytes:
            rejections.add("request_bytes")
            raise LimitExceeded("request_bytes", f"request body of {length} bytes; the limit (maxRequestBytes) is "
                                f"{limits.max_request_bytes}", http_status=413)
        client = request.remote or "?"
        if not inflight.enter(client):
            rejections.add("inflight_per_client")
            raise LimitExceeded("inflight_per_client", f"{inflight.cap} requests already in flight from {client} "
                                "(maxInflightRequestsPerClient)", http_status=429, retriable=True)
        token = _CURRENT.set(limits)
        try:
            check_path_names(request.match_info)
            if _long_poll_full(request, broker):
                rejections.add("long_poll_waiters")   # the broker answers at once (short polling)
            return await handler(request)
        except LimitExceeded as e:
            rejections.add(e.limit)
            raise
        except MessageTooLarge:
            rejections.add("message_size")
            raise
        except web.HTTPRequestEntityTooLarge:
            rejections.add("request_bytes")
            raise
        finally:
            _CURRENT.reset(token)
            inflight.leave(client)

    return limits_mw
