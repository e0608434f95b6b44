"""Request signing and the ACL model: pure code, no IO, no clock, no asyncio.

Signing (RocketMQ ACL 1.0's idea with HMAC-SHA256): a client holding an access key and a
secret key sends four headers,

    X-MQ-AccessKey   the access key
    X-MQ-Timestamp   milliseconds since the epoch, decimal
    X-MQ-Nonce       16..64 chars of [A-Za-z0-9_-], fresh for every request
    X-MQ-Signature   lowercase hex HMAC-SHA256(secret_key, canonical request)

where the canonical request is five lines joined by "\\n":

    METHOD
    path, percent-decoded, then "?" and the query pairs sorted and re-encoded (or no "?")
    timestamp
    nonce
    lowercase hex SHA-256 of the body bytes (of b"" when there is none)

The server rebuilds the same string from what it received, so changing the method, the
path, any query value, the timestamp, the nonce or one body byte breaks the signature.
A timestamp outside the replay window and a nonce already seen inside it are refused.

ACL (RocketMQ's plain_acl.yml shape, written as JSON):

    {"accounts": [{"accessKey": "...", "secretKey": "...", "admin": false,
                   "defaultTopicPerm": "DENY", "defaultGroupPerm": "SUB",
                   "topicPerms": ["orders=PUB|SUB", "audit=SUB"],
                   "groupPerms": ["billing=SUB"]}]}

A permission is DENY, PUB, SUB or PUB|SUB; a topic or group not listed gets the account's
default. Admin accounts may do everything. `%RETRY%<g>` and `%DLQ%<g>` topics are checked
against the group <g>, as RocketMQ does.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import IntFlag
from typing import Any, Iterable, Mapping
from urllib.parse import quote, unquote, parse_qsl

HEADER_ACCESS_KEY = "X-MQ-AccessKey"
HEADER_TIMESTAMP = "X-MQ-Timestamp"
HEADER_NONCE = "X-MQ-Nonce"
HEADER_SIGNATURE = "X-MQ-Signature"
NONCE_RE = re.compile(r"[A-Za-z0-9_-]{16,64}")
KEY_RE = re.compile(r"[A-Za-z0-9_.@:-]{6,128}")    # RocketMQ requires keys of at least 6 chars
MAX_ACL_FILE_BYTES = 4 * 1024 * 1024
MAX_ACCOUNTS = 10_000
MAX_PERMS_PER_ACCOUNT = 10_000
RETRY_PREFIX, DLQ_PREFIX = "%RETRY%", "%DLQ%"


class AuthError(Exception):
    """A request fails authentication (401) or authorisation (403); never retriable."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status = status
        self.code = code


def unauthenticated(message: str) -> AuthError:
    return AuthError(401, "UNAUTHENTICATED", message)


def forbidden(message: str) -> AuthError:
    return AuthError(403, "NO_PERMISSION", message)


class AclFileError(ValueError):
    """The ACL file is unreadable or malformed; the message names the place."""


# --- signing ------------------------------------------------------------------------------------
def canonical_target(path: str, query: Iterable[tuple[str, str]] | str = ()) -> str:
    """Decoded path plus sorted, uniformly re-encoded query: the same string whether it is
    built from a caller's (path, params) or from the raw target the server received."""
    pairs = parse_qsl(query, keep_blank_values=True) if isinstance(query, str) else list(query)
    out = quote(unquote(path), safe="/-_.~%|@:")
    if pairs:
        out += "?" + "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(pairs))
    return out


def canonical_request(method: str, target: str, timestamp: str, nonce: str, body: bytes) -> bytes:
    return "\n".join((method.upper(), target, timestamp, nonce, hashlib.sha256(body).hexdigest())).encode()


def signature(secret_key: str, method: str, target: str, timestamp: str, nonce: str, body: bytes) -> str:
    msg = canonical_request(method, target, timestamp, nonce, body)
    return hmac.new(secret_key.encode(), msg, hashlib.sha256).hexdigest()


def sign_headers(access_key: str, secret_key: str, method: str, path: str,
                 query: Mapping[str, Any] | Iterable[tuple[str, str]] | None, body: bytes | None,
                 now_ms: int, nonce: str | None = None) -> dict[str, str]:
    """The four X-MQ-* headers for one request. `path` may be percent-encoded; `query`
    holds the decoded parameters exactly as they will be sent."""
    path, _, inline = path.partition("?")     # a query written into the path counts too
    pairs = parse_qsl(inline, keep_blank_values=True)
    if isinstance(query, Mapping):
        pairs += [(str(k), str(v)) for k, v in query.items() if v is not None]
    else:
        pairs += list(query or ())
    nonce = nonce or secrets.token_urlsafe(18)
    ts = str(int(now_ms))
    sig = signature(secret_key, method, canonical_target(path, pairs), ts, nonce, body or b"")
    return {HEADER_ACCESS_KEY: access_key, HEADER_TIMESTAMP: ts, HEADER_NONCE: nonce, HEADER_SIGNATURE: sig}


class NonceCache:
    """Nonces seen inside the replay window, bounded by `capacity`.

    When full, the oldest entry is evicted and `floor_ms` rises to its timestamp: a request
    stamped at or below the floor is refused as stale, so an evicted nonce can never be
    replayed. Under a flood the window shrinks; it never lets a replay through."""

    def __init__(self, window_ms: int, capacity: int):
        assert window_ms > 0
        assert capacity > 0
        self.window_ms = window_ms
        self.capacity = capacity
        self.floor_ms = 0
        self._seen: OrderedDict[tuple[str, str], int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, access_key: str, nonce: str, ts_ms: int, now_ms: int) -> None:
        """Raise AuthError(401) if ts is outside the window or the nonce was seen; else remember it."""
        if abs(now_ms - ts_ms) > self.window_ms:
            raise unauthenticated(f"timestamp {ts_ms} is more than {self.window_ms} ms from the node's "
                                  f"clock ({now_ms}); check the client's clock")
        if ts_ms <= self.floor_ms:
            raise unauthenticated("timestamp is older than the node's replay horizon (nonce cache full); "
                                  "send again with a fresh timestamp")
        key = (access_key, nonce)
        if key in self._seen:
            raise unauthenticated("nonce already used (replayed request)")
        horizon = now_ms - self.window_ms
        for _ in range(64):          # drop a few expired entries per call: bounded work
            if not self._seen:
                break
            oldest_key = next(iter(self._seen))
            if self._seen[oldest_key] >= horizon:
                break
            del self._seen[oldest_key]
        while len(self._seen) >= self.capacity:
            _, evicted_ts = self._seen.popitem(last=False)
            self.floor_ms = max(self.floor_ms, evicted_ts)
        self._seen[key] = ts_ms


# --- ACL model ----------------------------------------------------------------------------------
class Perm(IntFlag):
    DENY = 0
    PUB = 1
    SUB = 2


ANY = Perm.PUB | Perm.SUB


def parse_perm(text: Any, where: str) -> Perm:
    if not isinstance(text, str):
        raise AclFileError(f"{where}: permission must be a string, got {type(text).__name__}")
    parts = {p.strip().upper() for p in text.split("|")}
    if parts == {"DENY"}:
        return Perm.DENY
    if not parts or not parts <= {"PUB", "SUB"}:
        raise AclFileError(f"{where}: permission must be DENY, PUB, SUB or PUB|SUB, got {text!r}")
    perm = Perm.DENY
    for p in parts:
        perm |= Perm[p]
    return perm


@dataclass(frozen=True, slots=True)
class Account:
    access_key: str
    secret_key: str
    admin: bool = False
    default_topic_perm: Perm = Perm.DENY
    default_group_perm: Perm = Perm.DENY
    topic_perms: Mapping[str, Perm] = field(default_factory=dict)
    group_perms: Mapping[str, Perm] = field(default_factory=dict)

    def topic_perm(self, topic: str) -> Perm:
        for prefix in (RETRY_PREFIX, DLQ_PREFIX):
            if topic.startswith(prefix):
                return self.group_perm(topic[len(prefix):])
        return self.topic_perms.get(topic, self.default_topic_perm)

    def group_perm(self, group: str) -> Perm:
        return self.group_perms.get(group, self.default_group_perm)


def _perm_table(items: Any, where: str) -> dict[str, Perm]:
    if items is None:
        return {}
    if not isinstance(items, list) or len(items) > MAX_PERMS_PER_ACCOUNT:
        raise AclFileError(f"{where}: must be a list of \"name=PERM\" strings (at most {MAX_PERMS_PER_ACCOUNT})")
    table: dict[str, Perm] = {}
    for i, item in enumerate(items):
        if not isinstance(item, str) or "=" not in item:
            raise AclFileError(f"{where}[{i}]: must be \"name=PERM\", got {item!r}")
        name, _, perm = item.partition("=")
        name = name.strip()
        if not name:
            raise AclFileError(f"{where}[{i}]: empty name in {item!r}")
        table[name] = parse_perm(perm, f"{where}[{i}]")
    return table


def _account(doc: Any, i: int) -> Account:
    where = f"accounts[{i}]"
    if not isinstance(doc, dict):
        raise AclFileError(f"{where}: must be an object")
    ak, sk = doc.get("accessKey"), doc.get("secretKey")
    for name, v in (("accessKey", ak), ("secretKey", sk)):
        if not isinstance(v, str) or not KEY_RE.fullmatch(v):
            raise AclFileError(f"{where}.{name}: must be 6..128 chars of [A-Za-z0-9_.@:-]")
    admin = doc.get("admin", False)
    if not isinstance(admin, bool):
        raise AclFileError(f"{where}.admin: must be true or false")
    return Account(ak, sk, admin,
                   parse_perm(doc.get("defaultTopicPerm", "DENY"), f"{where}.defaultTopicPerm"),
                   parse_perm(doc.get("defaultGroupPerm", "DENY"), f"{where}.defaultGroupPerm"),
                   _perm_table(doc.get("topicPerms"), f"{where}.topicPerms"),
                   _perm_table(doc.get("groupPerms"), f"{where}.groupPerms"))


def parse_acl(text: str | bytes) -> dict[str, Account]:
    """ACL file text -> {access_key: Account}; raises AclFileError naming the bad place."""
    if len(text) > MAX_ACL_FILE_BYTES:
        raise AclFileError(f"ACL file is {len(text)} bytes; the limit is {MAX_ACL_FILE_BYTES}")
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise AclFileError(f"ACL file is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("accounts"), list):
        raise AclFileError("ACL file must be an object with an \"accounts\" list")
    if len(doc["accounts"]) > MAX_ACCOUNTS:
        raise AclFileError(f"ACL file lists {len(doc['accounts'])} accounts; the limit is {MAX_ACCOUNTS}")
    accounts: dict[str, Account] = {}
    for i, item in enumerate(doc["accounts"]):
        acc = _account(item, i)
        if acc.access_key in accounts:
            raise AclFileError(f"accounts[{i}].accessKey: {acc.access_key!r} appears twice")
        accounts[acc.access_key] = acc
    return accounts


def check_headers(headers: Mapping[str, str]) -> tuple[str, str, str, str]:
    """(access key, timestamp, nonce, signature) if all are present and well-formed, else
    AuthError(401). Cheap: the node calls it before reading a request's body."""
    ak, ts, nonce, sig = (headers.get(h) for h in (HEADER_ACCESS_KEY, HEADER_TIMESTAMP, HEADER_NONCE,
                                                    HEADER_SIGNATURE))
    if not (ak and ts and nonce and sig):
        raise unauthenticated(f"missing signature: send {HEADER_ACCESS_KEY}, {HEADER_TIMESTAMP}, "
                              f"{HEADER_NONCE} and {HEADER_SIGNATURE}")
    if not ts.isdigit() or len(ts) > 16:
        raise unauthenticated(f"{HEADER_TIMESTAMP} must be milliseconds since the epoch")
    if not NONCE_RE.fullmatch(nonce):
        raise unauthenticated(f"{HEADER_NONCE} must be 16..64 chars of [A-Za-z0-9_-]")
    return ak, ts, nonce, sig


def verify(accounts: Mapping[str, Account], nonces: NonceCache, method: str, target: str,
           headers: Mapping[str, str], body: bytes, now_ms: int) -> Account:
    """The account that signed this request, or AuthError(401). `target` is canonical_target(...)
    of what was received. The nonce is remembered only once the signature is good."""
    ak, ts, nonce, sig = check_headers(headers)
    account = accounts.get(ak)
    # Compare against a dummy key for unknown access keys so timing does not reveal which exist.
    expected = signature(account.secret_key if account else "\0unknown", method, target, ts, nonce, body)
    if not hmac.compare_digest(expected.encode(), sig.strip().lower().encode()) or account is None:
        raise unauthenticated("signature does not match (wrong key, or the request was altered)")
    nonces.admit(ak, nonce, int(ts), now_ms)
    return account
