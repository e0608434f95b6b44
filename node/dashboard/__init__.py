"""The dashboard: static assets (plain JS, no build step) and the few reads they need.

Served by nodes and controllers at `/dashboard`. The page only calls the API of the
process that served it (same origin), so a node answers for its peers through
`GET /cluster/nodes`, which asks each peer's `/cluster` with a short timeout.
That fan-out follows the node's own security settings (`PeerClient`): with
`tlsEnable=true` it uses https, trusting `tlsCaFile` and presenting the node's certificate;
with a cluster secret (`clusterSecret`/`clusterSecretFile`) each request is signed with it
(node/peer_auth.py `sign_request`), which an `aclEnable=true` peer accepts for GET /cluster
only. An ACL node without a cluster secret cannot read its peers: its dashboard shows only
itself (logged once at start).
Drill and benchmark reports are listed from `$MQSTORE_REPORTS_DIR` (default
`./reports`) when that directory exists.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import ssl
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web

from node import peer_auth

log = logging.getLogger(__name__)

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
REPORTS_ENV = "MQSTORE_REPORTS_DIR"
MAX_REPORTS = 50                    # newest reports listed
MAX_REPORT_BYTES = 1 << 20          # a report larger than this is not served whole
PEER_TIMEOUT_S = 1.0
MAX_PEERS = 16
_REPORT_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_STATIC_TYPES = {".html": "text/html", ".js": "application/javascript", ".css": "text/css"}


def reports_dir() -> str:
    return os.path.abspath(os.environ.get(REPORTS_ENV) or "reports")


def list_reports(directory: str | None = None) -> list[dict[str, Any]]:
    """Newest first: name, size, mtime (s). Empty when the directory does not exist."""
    directory = directory or reports_dir()
    try:
        entries = [e for e in os.scandir(directory) if e.is_file() and _REPORT_NAME.match(e.name)]
    except OSError:
        return []
    entries.sort(key=lambda e: e.stat().st_mtime, reverse=True)
    return [{"name": e.name, "size": e.stat().st_size, "mtime": round(e.stat().st_mtime, 3)}
            for e in entries[:MAX_REPORTS]]


@dataclass(frozen=True)
class PeerClient:
    """How this node calls its peers' /cluster: scheme, TLS context, and the cluster secret
    that signs each request (None = unsigned) under this node's id."""

    self_id: str = ""
    ssl_context: ssl.SSLContext | None = None
    secret: bytes | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_context is not None else "http"

    def headers(self, method: str, path: str) -> dict[str, str]:
        h = {"Accept": "application/json"}
        if self.secret is not None:
            h.update(peer_auth.sign_request(self.secret, self.self_id, method, path))
        return h

    @classmethod
    def from_config(cls, config: Any) -> "PeerClient":
        """From tlsEnable/tlsCaFile/tlsCertFile/tlsKeyFile and clusterSecret(File). Raises
        ConfigError (node.config) on unusable files, as the node's start does."""
        from node import tls
        from node.config import ConfigError
        ctx = None
        if getattr(config, "tls_enable", False):
            ctx = tls.client_context(config.tls_ca_file, config.tls_cert_file, config.tls_key_file)
        try:
            secret = peer_auth.load_secret(getattr(config, "cluster_secret", ""),
                                           getattr(config, "cluster_secret_file", ""))
        except ValueError as e:
            raise ConfigError(f"clusterSecret: {e}") from None
        if getattr(config, "acl_enable", False) and secret is None:
            log.warning("aclEnable=true without clusterSecret/clusterSecretFile: peers refuse this node's "
                        "unsigned /cluster reads, so its dashboard shows only itself (docs/security.md)")
        return cls(getattr(config, "node_id", ""), ctx, secret)


PLAIN = PeerClient()


async def fetch_json(session: aiohttp.ClientSession, url: str,
                     headers: dict[str, str] | None = None) -> dict[str, Any] | None:
    """The JSON map at `url`, or None when it is unreachable or answers anything but 200
    (a 401/403 error document is not the peer's state)."""
    try:
        async with session.get(url, headers=headers or {"Accept": "application/json"}) as r:
            if r.status != 200:
                return None
            doc = await r.json(content_type=None)
            return doc if isinstance(doc, dict) else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError):
        return None


async def gather_nodes(peers: dict[str, str], local: Callable[[], dict[str, Any]],
                       self_id: str, client: PeerClient = PLAIN) -> list[dict[str, Any]]:
    """Each peer's /cluster document (the local one without a round trip), unreachable ones marked."""
    items = sorted(peers.items())[:MAX_PEERS]
    timeout = aiohttp.ClientTimeout(total=PEER_TIMEOUT_S)
    connector = aiohttp.TCPConnector(ssl=client.ssl_context if client.ssl_context is not None else True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async def one(node_id: str, api: str) -> dict[str, Any]:
            if node_id == self_id:
                doc = local()
            else:
                doc = await fetch_json(session, f"{client.scheme}://{api}/cluster", client.headers("GET", "/cluster"))
            return {"node_id": node_id, "api": api, "reachable": doc is not None, "cluster": doc}
        return list(await asyncio.gather(*(one(n, a) for n, a in items)))


# --- handlers ---------------------------------------------------------------------------------
async def page(request: web.Request) -> web.StreamResponse:
    return _static_file("index.html")


async def static(request: web.Request) -> web.StreamResponse:
    return _static_file(request.match_info["name"])


def _static_file(name: str) -> web.StreamResponse:
    ext = os.path.splitext(name)[1]
    if not _REPORT_NAME.match(name) or ext not in _STATIC_TYPES:
        raise web.HTTPNotFound(text=f"no dashboard asset {name!r}")
    path = os.path.join(STATIC_DIR, name)
    if not os.path.isfile(path):
        raise web.HTTPNotFound(text=f"no dashboard asset {name!r}")
    with open(path, "rb") as f:
        body = f.read()
    return web.Response(body=body, content_type=_STATIC_TYPES[ext], headers={"Cache-Control": "no-cache"})


async def reports(request: web.Request) -> web.Response:
    return web.json_response({"dir": reports_dir(), "reports": list_reports()})


async def report(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if not _REPORT_NAME.match(name):
        raise web.HTTPBadRequest(text=f"bad report name {name!r}")
    path = os.path.join(reports_dir(), name)
    if not os.path.isfile(path):
        raise web.HTTPNotFound(text=f"no report {name!r}")
    with open(path, "rb") as f:
        body = f.read(MAX_REPORT_BYTES + 1)
    if len(body) > MAX_REPORT_BYTES:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_REPORT_BYTES, actual_size=len(body))
    return web.Response(body=body, content_type="application/json" if name.endswith(".json") else "text/plain")


PEER_CLIENT_KEY: web.AppKey[PeerClient] = web.AppKey("dashboard_peer_client", PeerClient)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ROUTES: list[tuple[str, str, Handler]] = [
    ("GET", "/dashboard", page),
    ("GET", "/dashboard/static/{name}", static),
    ("GET", "/dashboard/reports", reports),
    ("GET", "/dashboard/reports/{name}", report),
]


def add_routes(app: web.Application) -> None:
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
