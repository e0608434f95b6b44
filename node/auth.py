"""Authentication and authorisation of the node's HTTP API (aiohttp middleware).

With `aclEnable=true` every request except GET /health, /metrics and the dashboard page and
its static assets must carry a valid signature (node/acl.py) from an account in the ACL
file (`aclFile`), and the account must hold the permission the route needs (RULES below).
A refused request is answered 401 (missing or bad signature, stale timestamp, replayed
nonce) or 403 (no permission) with `{"error", "message", "retriable": false, "leader"}`
before any handler runs, so it changes nothing. Routes not named in RULES need an admin
account: a new route is closed until someone decides otherwise.

Node-to-node reads: a request signed with the cluster secret (node/peer_auth.py
`sign_request`, headers X-MQ-Peer-*) instead of an account is accepted for PEER_READ_ROUTES
only (GET /cluster, which a node's dashboard fan-out reads), as the internal peer identity;
it holds no other right: on any other route, or any method but GET, it is refused 403.
Without a configured cluster secret such requests are refused 401.

The ACL file is re-read when its mtime or size changes, checked at most once per
`aclReloadIntervalMs` by the request that notices; a file that fails to parse is logged
and the previous ACL stays in force.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Awaitable, Callable

import msgpack
from aiohttp import web

from node.acl import (ANY, HEADER_ACCESS_KEY, Account, AclFileError, AuthError, NonceCache, Perm, canonical_target,
                      check_headers, forbidden, parse_acl, unauthenticated, verify)
from node.config import BrokerConfig, ConfigError
from node import peer_auth

log = logging.getLogger(__name__)

MSGPACK = "application/x-msgpack"
OPEN_ROUTES = {("GET", "/health"), ("GET", "/metrics"), ("GET", "/dashboard"), ("GET", "/dashboard/static/{name}")}
# Read-only routes a peer may call with a cluster-secret signature. Never a write.
PEER_READ_ROUTES = {("GET", "/cluster")}
GROUP_QUERY_ROUTES = {("GET", "/topics/{topic}/queues/{queue_id}/messages")}   # `group=` needs SUB on it
PEER_LISTENER = "api"     # rocketmq_peer_auth_failures_total{listener="api"}

# (method, route pattern) -> (resource kind, match_info key or body/query field, permission).
# kind: "topic" / "group" check that permission on the named resource; "any" needs only a
# valid signature; "admin" needs an admin account; "txn" checks PUB on the producer group.
RULES: dict[tuple[str, str], tuple[str, str, Perm]] = {
    ("POST", "/topics/{topic}/messages"): ("topic", "topic", Perm.PUB),
    ("GET", "/topics/{topic}/queues/{queue_id}/messages"): ("topic", "topic", Perm.SUB),
    ("GET", "/topics/{topic}/queues/{queue_id}/messages/{queue_offset}"): ("topic", "topic", Perm.SUB),
    ("GET", "/topics/{topic}/queues/{queue_id}/offset"): ("topic", "topic", Perm.SUB),
    ("GET", "/topics/{topic}/messages"): ("topic", "topic", Perm.SUB),
    ("GET", "/topics/{topic}"): ("topic", "topic", ANY),
    ("GET", "/topics"): ("any", "", ANY),
    ("GET", "/cluster"): ("any", "", ANY),
    ("GET", "/cluster/nodes"): ("any", "", ANY),
    ("GET", "/openapi.json"): ("any", "", ANY),
    ("GET", "/groups"): ("any", "", ANY),
    ("GET", "/dashboard/reports"): ("any", "", ANY),
    ("GET", "/dashboard/reports/{name}"): ("any", "", ANY),
    ("POST", "/groups/{group}/offsets"): ("group", "group", Perm.SUB),
    ("GET", "/groups/{group}/offsets"): ("group", "group", Perm.SUB),
    ("GET", "/groups/{group}/progress"): ("group", "group", Perm.SUB),
    ("POST", "/groups/{group}/heartbeat"): ("group", "group", Perm.SUB),
    ("GET", "/groups/{group}/members"): ("group", "group", Perm.SUB),
    ("DELETE", "/groups/{group}/members/{client_id}"): ("group", "group", Perm.SUB),
    ("POST", "/groups/{group}/retry"): ("group", "group", Perm.SUB),
    ("POST", "/transactions/end"): ("txn", "producer_group", Perm.PUB),
    ("GET", "/transactions/pending"): ("txn", "producer_group", Perm.PUB),
    # Admin: POST /topics, DELETE /topics/{topic}, POST /groups/{group}/offsets/reset,
    # GET /config, GET /stats, POST /commitlog/delete-expired, GET /messages/{offset_msg_id} (its topic is
    # unknown until read), and every route not listed here.
}


class AclStore:
    """The accounts of the ACL file, reloaded when the file changes (mtime poll, bounded)."""

    def __init__(self, path: str, reload_interval_ms: int, clock: Callable[[], float] = time.monotonic):
        self.path = path
        self.reload_interval_s = reload_interval_ms / 1000
        self.clock = clock
        self.accounts: dict[str, Account] = {}
        self._stamp: tuple[int, int] | None = None
        self._next_check = 0.0
        self.reloads = 0
        self._load(strict=True)

    def _read(self) -> tuple[tuple[int, int], dict[str, Account]]:
        try:
            st = os.stat(self.path)
            with open(self.path, "rb") as f:
                text = f.read(MAX_READ)
        except OSError as e:
            raise AclFileError(f"cannot read ACL file {self.path}: {e.strerror}") from None
        return (st.st_mtime_ns, st.st_size), parse_acl(text)

    def _load(self, strict: bool) -> None:
        try:
            stamp, accounts = self._read()
        except AclFileError as e:
            if strict:
                raise ConfigError(f"aclFile: {e}") from None
            log.error("ACL file not reloaded, the previous ACL stays in force: %s", e)
            return
        self._stamp, self.accounts = stamp, accounts
        self.reloads += 1
        log.info("ACL loaded from %s: %d accounts", self.path, len(accounts))

    def current(self) -> dict[str, Account]:
        now = self.clock()
        if now >= self._next_check:
            self._next_check = now + self.reload_interval_s
            try:
                st = os.stat(self.path)
                stamp = (st.st_mtime_ns, st.st_size)
            except OSError as e:
                log.error("ACL file %s not readable, the previous ACL stays in force: %s", self.path, e.strerror)
                stamp = self._stamp
            if stamp != self._stamp:
                self._load(strict=False)
        return self.accounts


MAX_READ = 4 * 1024 * 1024 + 1      # one byte over parse_acl's limit, so it can say "too large"


def _error(request: web.Request, e: AuthError) -> web.Response:
    doc = {"error": e.code, "message": str(e), "retriable": False, "leader": None}
    headers = {"WWW-Authenticate": "MQ-HMAC-SHA256"} if e.status == 401 else None
    if MSGPACK in request.headers.get("Accept", ""):
        return web.Response(body=msgpack.packb(doc, use_bin_type=True), status=e.status, content_type=MSGPACK,
                            headers=headers)
    return web.Response(text=json.dumps(doc, separators=(",", ":")), status=e.status,
                        content_type="application/json", headers=headers)


def _body_field(request: web.Request, raw: bytes, name: str) -> Any:
    """A top-level field of a JSON/msgpack body, or None (the handler reports malformed bodies)."""
    try:
        if request.content_type == MSGPACK:
            doc = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        else:
            doc = json.loads(raw) if raw else None
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return None
    return doc.get(name) if isinstance(doc, dict) else None


def authorise(account: Account, method: str, pattern: str | None, match_info: dict[str, str],
              field_value: Any = None, query_group: str | None = None) -> None:
    """Raise AuthError(403) unless `account` may call `method pattern`; on a pull that names
    its consumer group (`query_group`), SUB on the group too, as RocketMQ checks a pull's."""
    if account.admin:
        return
    if query_group is not None and (method, pattern) in GROUP_QUERY_ROUTES \
            and not account.group_perm(query_group) & Perm.SUB:
        raise forbidden(f"access key {account.access_key!r} lacks SUB on group {query_group!r}")
    rule = RULES.get((method, pattern)) if pattern else None
    if rule is None:
        raise forbidden(f"{method} {pattern or 'this path'} needs an admin account")
    kind, key, perm = rule
    if kind == "any":
        return
    if kind == "txn":
        name = field_value
        if not isinstance(name, str) or not name:
            raise forbidden(f"{key} is required to check the producer group's permission")
        have = account.group_perm(name)
    else:
        name = match_info.get(key, "")
        have = account.topic_perm(name) if kind == "topic" else account.group_perm(name)
    if not have & perm:
        what = "PUB or SUB" if perm == ANY else perm.name
        raise forbidden(f"access key {account.access_key!r} lacks {what} on {'group' if kind != 'topic' else kind} "
                        f"{name!r}")


class RefusalLog:
    """Logs refused requests, at most one line per `interval_s` (with the count of those not
    logged), so a flood of bad requests cannot flood the log."""

    def __init__(self, interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self.clock = clock
        self.total = 0
        self._suppressed = 0
        self._next = 0.0

    def note(self, request: web.Request, e: AuthError) -> None:
        self.total += 1
        now = self.clock()
        if now < self._next:
            self._suppressed += 1
            return
        self._next = now + self.interval_s
        log.warning("refused %s %s from %s: %s %s%s", request.method, request.path, request.remote, e.status, e,
                    f" (+{self._suppressed} more refused, not logged)" if self._suppressed else "")
        self._suppressed = 0


def _peer_signed(request: web.Request) -> bool:
    """Signed with the cluster secret rather than an account (no X-MQ-AccessKey)."""
    return peer_auth.HDR_PROOF in request.headers and HEADER_ACCESS_KEY not in request.headers


async def check_peer(request: web.Request, pattern: str | None, verifier: peer_auth.RequestVerifier | None) -> str:
    """The peer id of a cluster-secret-signed request on a PEER_READ_ROUTES route, else AuthError."""
    if (request.method, pattern) not in PEER_READ_ROUTES:
        raise forbidden(f"a cluster-secret signature allows only "
                        f"{', '.join(f'{m} {p}' for m, p in sorted(PEER_READ_ROUTES))}; "
                        f"{request.method} {pattern or request.path} needs an account's signature")
    if verifier is None:
        raise unauthenticated("this node has no cluster secret: sign with an account from the ACL file")
    raw = await request.read()
    try:
        return verifier.verify(request.method, request.raw_path, request.headers, raw)
    except peer_auth.PeerAuthError as e:
        peer_auth.FAILURES.record(PEER_LISTENER, request.remote, str(e))
        raise unauthenticated(str(e)) from None


def make_middleware(store: AclStore, nonces: NonceCache, wall_clock_ms: Callable[[], int],
                    peer_verifier: peer_auth.RequestVerifier | None = None):
    refusals = RefusalLog()

    @web.middleware
    async def auth(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        resource = request.match_info.route.resource
        pattern = resource.canonical if resource is not None else None
        method = "GET" if request.method == "HEAD" else request.method
        if (method, pattern) in OPEN_ROUTES:
            return await handler(request)
        if _peer_signed(request):
            try:
                await check_peer(request, pattern, peer_verifier)
            except AuthError as e:
                refusals.note(request, e)
                return _error(request, e)
            return await handler(request)
        try:
            check_headers(request.headers)    # refuse unsigned requests before buffering their bodies
        except AuthError as e:
            refusals.note(request, e)
            return _error(request, e)
        raw = await request.read()    # bounded by client_max_size; cached for the handler
        path, _, query = request.raw_path.partition("?")
        try:
            account = verify(store.current(), nonces, request.method, canonical_target(path, query),
                             request.headers, raw, wall_clock_ms())
            field_value = None
            rule = RULES.get((method, pattern or ""))
            if rule is not None and rule[0] == "txn" and not account.admin:
                field_value = request.query.get(rule[1]) if method == "GET" else _body_field(request, raw, rule[1])
            authorise(account, method, pattern, dict(request.match_info), field_value, request.query.get("group"))
        except AuthError as e:
            refusals.note(request, e)
            return _error(request, e)
        return await handler(request)
    return auth


def preflight(config: BrokerConfig) -> None:
    """Raise ConfigError if aclEnable=true and the ACL file cannot be read or parsed."""
    if config.acl_enable:
        if not config.acl_file.strip():
            raise ConfigError("aclFile: must name the ACL file when aclEnable=true")
        AclStore(config.acl_file, config.acl_reload_interval_ms)


def install(app: web.Application, config: BrokerConfig) -> None:
    """Add the middleware when aclEnable=true; raise ConfigError if the ACL file is unusable."""
    if not config.acl_enable:
        return
    preflight(config)
    store = AclStore(config.acl_file, config.acl_reload_interval_ms)
    nonces = NonceCache(config.acl_replay_window_ms, config.acl_nonce_cache_size)
    try:
        secret = peer_auth.load_secret(config.cluster_secret, config.cluster_secret_file)
    except ValueError as e:
        raise ConfigError(f"clusterSecret: {e}") from None
    verifier = peer_auth.RequestVerifier(secret) if secret is not None else None
    app.middlewares.append(make_middleware(store, nonces, lambda: int(time.time() * 1000), verifier))
