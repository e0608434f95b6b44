"""Fuzz the node's whole HTTP app: every route, JSON and msgpack bodies, query strings.

A real standalone broker (LocalLog, small geometry, files in the scratch dir) behind the
real aiohttp app (node/api.py make_app: error and limit middlewares, every handler),
driven over loopback by aiohttp's test client. Input: byte 0 picks the route, byte 1 the
options (bit 0: msgpack body, bit 1: msgpack answer, bit 2: the path names come from the
input instead of the topic "T" / group "G" that exist), the rest is the body (POST) or
the query string (GET/DELETE). Every answer must be a status below 500 with a body in the
asked format: a 5xx is a crash. State (topics, offsets) carries over between inputs, as
on a real node.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse

from fuzz._common import fast_filesystem, scratch_root

TARGET = "rest_app"
MODULES = ("node.api", "node.server")
_state: dict = {}


def _setup() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from node.api import ROUTES, make_app
    from node.config import from_properties
    from node.server import build_broker

    root = scratch_root(TARGET)
    config, _ = from_properties({"storePathRootDir": root, "listenPort": "1", "mappedFileSizeCommitLog": "1048576",
                                 "mapedFileSizeConsumeQueue": "6000", "maxHashSlotNum": "1000",
                                 "maxIndexNum": "4000", "maxMessageSize": "65536", "maxRequestBytes": "1048576",
                                 "longPollingMaxWaitMs": "0", "flushDiskType": "ASYNC_FLUSH"})
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    broker = build_broker(config, fast_filesystem())

    async def start():
        await broker.start()
        client = TestClient(TestServer(make_app(broker)))
        await client.start_server()
        r = await client.post("/topics", json={"topic": "T", "queues": 2})
        assert r.status == 200, await r.text()
        r = await client.post("/topics/T/messages", json={"messages": [{"body": "seed", "keys": ["k"]}]})
        assert r.status == 200, await r.text()
        return client
    client = loop.run_until_complete(start())
    routes = sorted((m, p) for m, p, _h in ROUTES if p not in ("/metrics", "/cluster/nodes"))
    _state.update(loop=loop, client=client, routes=routes, broker=broker)


def _fill(path: str, names: list[str]) -> str:
    """Put path parameters in: known ones, or names taken from the input."""
    values = {"topic": "T", "group": "G", "queue_id": "0", "queue_offset": "0", "client_id": "c1",
              "offset_msg_id": "7F00000100002A9F0000000000000000"}
    out = path
    for i, key in enumerate(values):
        if "{" + key + "}" in out:
            v = names[i % len(names)] if names else values[key]
            out = out.replace("{" + key + "}", urllib.parse.quote(v, safe="") or values[key])
    return out


async def _one(data: bytes) -> None:
    import msgpack
    client, routes = _state["client"], _state["routes"]
    method, path = routes[data[0] % len(routes)] if data else routes[0]
    opts = data[1] if len(data) > 1 else 0
    rest = data[2:]
    names = rest[:64].decode("latin-1").split("/") if opts & 4 else []
    url = _fill(path, names)
    headers = {"Accept": "application/x-msgpack" if opts & 2 else "application/json"}
    if method == "POST":
        headers["Content-Type"] = "application/x-msgpack" if opts & 1 else "application/json"
        r = await client.request(method, url, data=rest, headers=headers)
    else:
        query = rest.decode("latin-1").replace("#", "")
        r = await client.request(method, url + "?" + query if query else url, headers=headers)
    raw = await r.read()
    assert r.status < 500, (r.status, method, url, raw[:500])
    if r.status != 200 or path == "/openapi.json":
        return
    if opts & 2:
        msgpack.unpackb(raw, raw=False, strict_map_key=False)
    else:
        json.loads(raw)


def test_one_input(data: bytes) -> None:
    if not _state:
        _setup()
    _state["loop"].run_until_complete(_one(data))


def main() -> None:
    from fuzz._common import run
    run(TARGET, test_one_input, MODULES)


if __name__ == "__main__":
    main()
