"""The dashboard: static assets (plain JS, no build step) and the few reads they need.

Served by nodes and controllers at `/dashboard`. The page only calls the API of the
process that served it (same origin), so a node answers for its peers through
`GET /cluster/nodes`, which asks each peer's `/cluster` with a short timeout.
Drill and benchmark reports are listed from `$MQSTORE_REPORTS_DIR` (default
`./reports`) when that directory exists.
"""

from __future__ import annotations

import asyncio
import os
import re
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web

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


async def fetch_json(session: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    try:
        async with session.get(url, headers={"Accept": "application/json"}) as r:
            return await r.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError):
        return None


async def gather_nodes(peers: dict[str, str], local: Callable[[], dict[str, Any]],
                       self_id: str) -> list[dict[str, Any]]:
    """Each peer's /cluster document (the local one without a round trip), unreachable ones marked."""
    items = sorted(peers.items())[:MAX_PEERS]
    timeout = aiohttp.ClientTimeout(total=PEER_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(node_id: str, api: str) -> dict[str, Any]:
            doc = local() if node_id == self_id else await fetch_json(session, f"http://{api}/cluster")
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
