"""Dashboard routes: the page and its assets are served, and nothing outside them is.

Method: a bare aiohttp app with only the dashboard routes, driven by aiohttp's test
client; reports come from a temp directory named by MQSTORE_REPORTS_DIR.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from node import dashboard


def with_client(fn):
    def run():
        async def go():
            app = web.Application()
            dashboard.add_routes(app)
            async with TestClient(TestServer(app)) as client:
                await fn(client)
        asyncio.run(go())
    return run


@with_client
async def _page_and_assets(client):
    r = await client.get("/dashboard")
    assert r.status == 200 and r.content_type == "text/html" and "id=\"leader\"" in await r.text()
    for name, ctype in (("app.js", "application/javascript"), ("style.css", "text/css")):
        r = await client.get(f"/dashboard/static/{name}")
        assert r.status == 200 and r.content_type == ctype


def test_page_and_assets():
    _page_and_assets()


@with_client
async def _nothing_outside_the_assets(client):
    for path in ("/dashboard/static/..%2F__init__.py", "/dashboard/static/__init__.py",
                 "/dashboard/static/missing.js", "/dashboard/static/.hidden.js"):
        r = await client.get(path)
        assert r.status == 404, path
    r = await client.get("/dashboard/reports/..%2F..%2Fetc%2Fpasswd")
    assert r.status in (400, 404)


def test_nothing_outside_the_assets_is_served():
    _nothing_outside_the_assets()


def test_reports_newest_first_and_bounded(tmp_path, monkeypatch):
    import os
    monkeypatch.setenv("MQSTORE_REPORTS_DIR", str(tmp_path))
    for i in range(dashboard.MAX_REPORTS + 5):
        p = tmp_path / f"drill-{i:03d}.json"
        p.write_text("{}")
        os.utime(p, (1000 + i, 1000 + i))
    listed = dashboard.list_reports()
    assert len(listed) == dashboard.MAX_REPORTS
    assert listed[0]["name"] == f"drill-{dashboard.MAX_REPORTS + 4:03d}.json"

    @with_client
    async def served(client):
        r = await client.get("/dashboard/reports/drill-003.json")
        assert r.status == 200 and await r.json() == {}
        r = await client.get("/dashboard/reports/nope.json")
        assert r.status == 404
    served()


def test_no_reports_dir_lists_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MQSTORE_REPORTS_DIR", str(tmp_path / "absent"))
    assert dashboard.list_reports() == []
