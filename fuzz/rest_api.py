"""Fuzz the REST request parsing of node/api.py (JSON and msgpack bodies).

Input: byte 0 bit 0 picks the content type (0 JSON, 1 msgpack); the rest is the
request body. It goes through `read_doc`, then every element of `messages` through
`parse_message`, and the whole list through the batch path `parse_messages`, which must
agree with it; plus the query and path integer parsers.
Allowed errors: StoreError subclasses answered with a 4xx (BadRequest and friends).
"""

from __future__ import annotations

TARGET = "rest_api"
MODULES = ("node.api",)


class _Req:
    """The parts of aiohttp's Request that the parsers touch."""

    def __init__(self, content_type: str, raw: bytes, query: dict[str, str], match_info: dict[str, str]):
        self.content_type = content_type
        self._raw = raw
        self.query = query
        self.match_info = match_info
        self.headers: dict[str, str] = {}

    async def read(self) -> bytes:
        return self._raw


def _run(coro):
    """Drive a coroutine that never suspends (the fake read() returns at once)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("coroutine suspended")


def test_one_input(data: bytes) -> None:
    from node import api
    from node.store.errors import StoreError

    opts, raw = (data[0], data[1:]) if data else (0, b"")
    ctype = api.MSGPACK if opts & 1 else api.JSON
    text = raw[:32].decode("latin-1")
    req = _Req(ctype, raw, {"offset": text, "max": text[:8]}, {"queue_id": text})
    try:
        doc = _run(api.read_doc(req))
    except StoreError as e:
        assert e.http_status < 500, e
        doc = None
    for name in ("offset", "max", "absent"):
        try:
            api.query_int(req, name, 0)
        except StoreError as e:
            assert e.http_status < 500, e
    try:
        api.path_int(req, "queue_id")
    except StoreError as e:
        assert e.http_status < 500, e
    if doc is None:
        return
    items = doc.get("messages")
    if not isinstance(items, list):
        return
    items = items[:64]
    one_by_one: list | None = []
    for i, item in enumerate(items):
        try:
            m = api.parse_message(item, i)
        except StoreError as e:
            assert e.http_status < 500, e
            one_by_one = None
            continue
        assert isinstance(m.body, bytes) and m.body
        if one_by_one is not None:
            one_by_one.append(m)
    batch = getattr(api, "parse_messages", None)   # the batch fast path must agree with parse_message
    if batch is not None:
        try:
            together = batch(items)
        except StoreError as e:
            assert e.http_status < 500, e
            together = None
        assert together == one_by_one, "parse_messages and parse_message disagree"


def main() -> None:
    from fuzz._common import run
    run(TARGET, test_one_input, MODULES)


if __name__ == "__main__":
    main()
