"""Peer authentication: members of one cluster prove they know the cluster secret.

Used on every peer port (Raft `dledger/transport.py`, classic HA `ha/shell.py`) before
any protocol frame is read, and, as signed requests, on the controller's HTTP API.

Handshake (mutual challenge-response; each message one frame: 2-byte big-endian length
plus payload, at most MAX_MESSAGE_BYTES, the whole exchange within a bounded time):

    server -> client   CHALLENGE  b"MQPA1" + nonce_s                       (32 random bytes)
    client -> server   RESPONSE   msgpack [1, role, client_id, nonce_c, proof_c]
    server -> client   ACCEPT     msgpack [1, server_id, proof_s]

    proof_x = HMAC-SHA256(secret, "mqstore-peer-v1" | side | role | nonce_s | nonce_c | id)

where every field after the label is length-prefixed (so no two field lists hash alike),
`side` is "client" or "server" (a proof cannot be reflected back), `role` names the
listener ("raft", "ha", ...; a proof for one protocol is useless on another) and `id` is
the prover's own id. Proofs are compared with `hmac.compare_digest`. The server answers
only after checking the client, so an impostor learns nothing but a random nonce; the
client checks the server's proof before it sends its first protocol frame, so a node
never talks to a peer that does not know the secret either.

`ServerHandshake` / `ClientHandshake` are pure (no sockets, no clock); `accept_peer` and
`connect_peer` are the asyncio glue. Failures are counted per listener in
`rocketmq_peer_auth_failures_total{listener=...}` and logged at most once per second per
listener, with the number of failures not logged.

The controller's HTTP API cannot hold a connection-level exchange per request, so its
callers sign each request instead (`sign_request` / `RequestVerifier`); so do nodes reading
each other's GET /cluster for the dashboard under aclEnable (node/auth.py PEER_READ_ROUTES,
node/dashboard): HMAC over method,
path, a timestamp within a window and a fresh nonce (remembered, bounded, so a captured
request cannot be replayed), and the SHA-256 of the body.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import msgpack

log = logging.getLogger(__name__)

LABEL = b"mqstore-peer-v1"
VERSION = 1
CHALLENGE_MAGIC = b"MQPA1"
NONCE_BYTES = 32
MAX_MESSAGE_BYTES = 1024
MAX_ID_CHARS = 128
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
HANDSHAKE_TIMEOUT_S = 5.0
_LEN = struct.Struct(">H")

# Signed HTTP requests (controller API; node GET /cluster between peers).
HDR_TIME, HDR_NONCE, HDR_ID, HDR_PROOF = ("X-MQ-Peer-Time", "X-MQ-Peer-Nonce", "X-MQ-Peer-Id", "X-MQ-Peer-Proof")
REQUEST_WINDOW_MS = 60_000
NONCE_CACHE_MAX = 100_000


class PeerAuthError(Exception):
    """The peer failed (or broke) the handshake; the connection is closed."""


# --- secrets ---------------------------------------------------------------------------------------
def load_secret(secret: str = "", secret_file: str = "") -> bytes | None:
    """The cluster secret from the literal or the file (not both); None = peer auth off.
    A file's trailing whitespace is dropped. Raises ValueError naming the problem."""
    if secret and secret_file:
        raise ValueError("give clusterSecret or clusterSecretFile, not both")
    if secret_file:
        try:
            with open(secret_file, "rb") as f:
                raw = f.read(MAX_SECRET_BYTES + 1)
        except OSError as e:
            raise ValueError(f"cannot read clusterSecretFile {secret_file}: {e.strerror}") from None
        value = raw.rstrip()
        if not value:
            raise ValueError(f"clusterSecretFile {secret_file} is empty")
    elif secret:
        value = secret.encode("utf-8")
    else:
        return None
    if len(value) < MIN_SECRET_BYTES:
        raise ValueError(f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes, got {len(value)}")
    if len(value) > MAX_SECRET_BYTES:
        raise ValueError(f"the cluster secret must be at most {MAX_SECRET_BYTES} bytes")
    return value


def generate_secret() -> str:
    """A fresh secret for a new cluster (256 bits from the OS CSPRNG)."""
    return secrets.token_urlsafe(32)


def write_private(path: str, text: str) -> None:
    """Write a secret-holding file (cluster secret, ACL file): mode 600 from its creation, through
    a temp file and a rename, so a reader sees the old file or the new one."""
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


# --- proofs ----------------------------------------------------------------------------------------
def _lp(b: bytes) -> bytes:
    return _LEN.pack(len(b)) + b


def proof(secret: bytes, side: str, role: str, nonce_s: bytes, nonce_c: bytes, ident: str) -> bytes:
    msg = LABEL + b"".join(_lp(x) for x in (side.encode(), role.encode(), nonce_s, nonce_c, ident.encode()))
    return hmac.new(secret, msg, hashlib.sha256).digest()


def _check_id(ident: Any) -> str:
    if not isinstance(ident, str) or not 0 < len(ident) <= MAX_ID_CHARS:
        raise PeerAuthError(f"bad peer id {ident!r:.40}")
    return ident


class ServerHandshake:
    """Listener side. `challenge()` -> send; `check_response(msg)` -> (peer id, ACCEPT to send)."""

    def __init__(self, secret: bytes, role: str, self_id: str, nonce: bytes | None = None):
        self.secret = secret
        self.role = role
        self.self_id = self_id
        self.nonce_s = nonce if nonce is not None else os.urandom(NONCE_BYTES)
        assert len(self.nonce_s) == NONCE_BYTES

    def challenge(self) -> bytes:
        return CHALLENGE_MAGIC + self.nonce_s

    def check_response(self, msg: bytes) -> tuple[str, bytes]:
        try:
            obj = msgpack.unpackb(msg, raw=False)
        except (ValueError, msgpack.UnpackException) as e:
            raise PeerAuthError(f"undecodable response: {e}") from None
        if not (isinstance(obj, list) and len(obj) == 5 and obj[0] == VERSION):
            raise PeerAuthError("malformed response")
        _v, role, client_id, nonce_c, proof_c = obj
        if role != self.role:
            raise PeerAuthError(f"peer speaks {role!r:.40}, this listener is {self.role!r}")
        client_id = _check_id(client_id)
        if not (isinstance(nonce_c, bytes) and len(nonce_c) == NONCE_BYTES and nonce_c != self.nonce_s):
            raise PeerAuthError("bad client nonce")
        if not isinstance(proof_c, bytes):
            raise PeerAuthError("malformed proof")
        want = proof(self.secret, "client", self.role, self.nonce_s, nonce_c, client_id)
        if not hmac.compare_digest(want, proof_c):
            raise PeerAuthError(f"wrong proof from {client_id!r} (different cluster secret?)")
        mine = proof(self.secret, "server", self.role, self.nonce_s, nonce_c, self.self_id)
        return client_id, msgpack.packb([VERSION, self.self_id, mine], use_bin_type=True)


class ClientHandshake:
    """Dialling side. `respond(challenge)` -> send; `check_accept(msg)` -> the server's id."""

    def __init__(self, secret: bytes, role: str, self_id: str, expect_server_id: str | None = None,
                 nonce: bytes | None = None):
        self.secret = secret
        self.role = role
        self.self_id = self_id
        self.expect_server_id = expect_server_id
        self.nonce_c = nonce if nonce is not None else os.urandom(NONCE_BYTES)
        self.nonce_s = b""

    def respond(self, challenge: bytes) -> bytes:
        if not (len(challenge) == len(CHALLENGE_MAGIC) + NONCE_BYTES and challenge.startswith(CHALLENGE_MAGIC)):
            raise PeerAuthError("the listener did not send a peer-auth challenge (is peer auth off there?)")
        self.nonce_s = challenge[len(CHALLENGE_MAGIC):]
        p = proof(self.secret, "client", self.role, self.nonce_s, self.nonce_c, self.self_id)
        return msgpack.packb([VERSION, self.role, self.self_id, self.nonce_c, p], use_bin_type=True)

    def check_accept(self, msg: bytes) -> str:
        try:
            obj = msgpack.unpackb(msg, raw=False)
        except (ValueError, msgpack.UnpackException) as e:
            raise PeerAuthError(f"undecodable accept: {e}") from None
        if not (isinstance(obj, list) and len(obj) == 3 and obj[0] == VERSION and isinstance(obj[2], bytes)):
            raise PeerAuthError("malformed accept")
        server_id = _check_id(obj[1])
        if self.expect_server_id is not None and server_id != self.expect_server_id:
            raise PeerAuthError(f"expected {self.expect_server_id!r}, the listener is {server_id!r}")
        want = proof(self.secret, "server", self.role, self.nonce_s, self.nonce_c, server_id)
        if not hmac.compare_digest(want, obj[2]):
            raise PeerAuthError(f"wrong proof from listener {server_id!r} (different cluster secret?)")
        return server_id


# --- failure accounting --------------------------------------------------------------------------------
class FailureLog:
    """Counts failures per listener; logs at most one line per listener per `interval_s`."""

    def __init__(self, interval_s: float = 1.0, what: str = "peer auth failed"):
        self.interval_s = interval_s
        self.what = what                # the log line's opening words
        self.totals: collections.Counter[str] = collections.Counter()
        self._last: dict[str, float] = {}
        self._unlogged: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()   # the controller counts from its HTTP loop and tests from others

    def record(self, listener: str, peer: Any, why: Any, now: float | None = None) -> bool:
        """Count one failure (`peer` None when not known); True when it was logged."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self.totals[listener] += 1
            if now - self._last.get(listener, -1e18) < self.interval_s:
                self._unlogged[listener] += 1
                return False
            self._last[listener] = now
            skipped = self._unlogged.pop(listener, 0)
        log.warning("%s (%s)%s: %s%s", self.what, listener, "" if peer is None else f" with {peer}", why,
                    f" ({skipped} more failures not logged)" if skipped else "")
        return True

    def get(self, listener: str) -> int:
        with self._lock:
            return self.totals[listener]


FAILURES = FailureLog()


class PeerAuthCollector:
    """`rocketmq_peer_auth_failures_total{listener}` for a Prometheus registry."""

    def __init__(self, failures: FailureLog = FAILURES):
        self.failures = failures

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily
        c = CounterMetricFamily("rocketmq_peer_auth_failures", "Peer connections or requests refused by "
                                "peer authentication (wrong or missing cluster secret, bad handshake)",
                                labels=["listener"])
        for listener in ("raft", "ha", "controller", *sorted(set(self.failures.totals) - {"raft", "ha", "controller"})):
            c.add_metric([listener], self.failures.totals.get(listener, 0))
        yield c


# --- what a node brings to its peer ports ------------------------------------------------------------------
@dataclass(frozen=True)
class PeerSecurity:
    """Cluster secret (None = peer auth off) and TLS contexts (None = plain TCP) for peer links."""

    secret: bytes | None = None
    server_ssl: Any = None      # ssl.SSLContext for listeners (mutual TLS)
    client_ssl: Any = None      # ssl.SSLContext for dialling peers

    @property
    def enabled(self) -> bool:
        return self.secret is not None


NO_SECURITY = PeerSecurity()


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def peer_security_from_config(config: Any, listen_hosts: tuple[str, ...] = ()) -> PeerSecurity:
    """A node's PeerSecurity from BrokerConfig keys clusterSecret(File) and tls*. Warns when a peer
    port listens beyond loopback with no secret. Raises ConfigError (node.config) on bad values."""
    from node.config import ConfigError
    from node import tls
    try:
        secret = load_secret(config.cluster_secret, config.cluster_secret_file)
    except ValueError as e:
        raise ConfigError(f"clusterSecret: {e}") from None
    server_ssl = client_ssl = None
    if config.tls_enable:
        server_ssl = tls.server_context(config.tls_cert_file, config.tls_key_file, config.tls_ca_file,
                                        require_client_cert=True)
        client_ssl = tls.client_context(config.tls_ca_file, config.tls_cert_file, config.tls_key_file)
    exposed = [h for h in listen_hosts if not is_loopback(h)]
    if secret is None and exposed:
        log.warning("peer ports listen on %s without a cluster secret: anyone who reaches them can join the "
                    "replication group; set clusterSecretFile (docs/security.md)", ", ".join(sorted(set(exposed))))
    return PeerSecurity(secret, server_ssl, client_ssl)


# --- asyncio glue ------------------------------------------------------------------------------------------
async def _read_msg(reader: asyncio.StreamReader) -> bytes:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_MESSAGE_BYTES:
        raise PeerAuthError(f"handshake message of {n} bytes exceeds {MAX_MESSAGE_BYTES}")
    return await reader.readexactly(n)


def _msg(payload: bytes) -> bytes:
    assert len(payload) <= MAX_MESSAGE_BYTES
    return _LEN.pack(len(payload)) + payload


async def accept_peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes, listener: str,
                      self_id: str, timeout_s: float = HANDSHAKE_TIMEOUT_S,
                      failures: FailureLog = FAILURES) -> str:
    """Run the server side on a fresh connection; the authenticated peer id, or PeerAuthError
    (counted and rate-limit logged; the caller closes the connection). Nothing else is read first."""
    hs = ServerHandshake(secret, listener, self_id)
    peer = writer.get_extra_info("peername")
    try:
        async with asyncio.timeout(timeout_s):
            writer.write(_msg(hs.challenge()))
            await writer.drain()
            client_id, accept = hs.check_response(await _read_msg(reader))
            writer.write(_msg(accept))
            await writer.drain()
            return client_id
    except PeerAuthError as e:
        failures.record(listener, peer, str(e))
        raise
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as e:
        failures.record(listener, peer, f"handshake not completed: {type(e).__name__}")
        raise PeerAuthError(f"handshake not completed: {e!r}") from None


async def connect_peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes, listener: str,
                       self_id: str, expect_server_id: str | None = None,
                       timeout_s: float = HANDSHAKE_TIMEOUT_S) -> str:
    """Run the client side on a fresh connection; the listener's id, or PeerAuthError."""
    hs = ClientHandshake(secret, listener, self_id, expect_server_id)
    try:
        async with asyncio.timeout(timeout_s):
            writer.write(_msg(hs.respond(await _read_msg(reader))))
            await writer.drain()
            return hs.check_accept(await _read_msg(reader))
    except (TimeoutError, asyncio.IncompleteReadError) as e:
        raise PeerAuthError(f"listener closed or stalled the handshake ({type(e).__name__}): "
                            "wrong cluster secret, or peer auth off there?") from None


# --- signed HTTP requests (controller API) -------------------------------------------------------------------
def _request_text(method: str, path: str, ts: str, nonce: str, ident: str, body: bytes) -> bytes:
    return "\n".join((method.upper(), path, ts, nonce, ident, hashlib.sha256(body).hexdigest())).encode()


def sign_request(secret: bytes, ident: str, method: str, path: str, body: bytes = b"",
                 now_ms: int | None = None) -> dict[str, str]:
    ts = str(int(time.time() * 1000) if now_ms is None else now_ms)
    nonce = secrets.token_hex(16)
    mac = hmac.new(secret, LABEL + b"\nhttp\n" + _request_text(method, path, ts, nonce, ident, body),
                   hashlib.sha256).hexdigest()
    return {HDR_TIME: ts, HDR_NONCE: nonce, HDR_ID: ident, HDR_PROOF: mac}


class RequestVerifier:
    """Checks signed requests: proof, timestamp window, nonce not seen (bounded memory: when the
    cache is full the oldest nonces go, and the window shrinks to the oldest one kept)."""

    def __init__(self, secret: bytes, window_ms: int = REQUEST_WINDOW_MS, cache_max: int = NONCE_CACHE_MAX):
        self.secret = secret
        self.window_ms = window_ms
        self.cache_max = cache_max
        self._seen: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._floor_ms = 0   # timestamps at or below this are refused (their nonces were evicted)

    def verify(self, method: str, path: str, headers: Any, body: bytes, now_ms: int | None = None) -> str:
        now = int(time.time() * 1000) if now_ms is None else now_ms
        ts, nonce, ident, mac = (headers.get(h) for h in (HDR_TIME, HDR_NONCE, HDR_ID, HDR_PROOF))
        if not (ts and nonce and ident and mac):
            raise PeerAuthError("request not signed with the cluster secret")
        if not (ts.isdigit() and len(ts) < 20 and 16 <= len(nonce) <= 64 and len(ident) <= MAX_ID_CHARS
                and len(mac) == 64):
            raise PeerAuthError("malformed peer signature headers")
        t = int(ts)
        if abs(now - t) > self.window_ms or t <= self._floor_ms:
            raise PeerAuthError("request timestamp outside the window (clock skew or replay)")
        want = hmac.new(self.secret, LABEL + b"\nhttp\n" + _request_text(method, path, ts, nonce, ident, body),
                        hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, mac):
            raise PeerAuthError(f"wrong request proof from {ident!r:.40} (different cluster secret?)")
        if nonce in self._seen:
            raise PeerAuthError("nonce already used (replay)")
        self._seen[nonce] = t
        while self._seen and (len(self._seen) > self.cache_max or
                              next(iter(self._seen.values())) < now - self.window_ms):
            _, old = self._seen.popitem(last=False)
            if len(self._seen) >= self.cache_max:
                self._floor_ms = max(self._floor_ms, old)
        return ident
