"""Request signing, the ACL model and the auth middleware, without a node process.

Method: sign with node.acl.sign_headers, verify what a server would rebuild, and tamper with
one input at a time (body, path, query, method, timestamp, nonce, key); then run the
middleware in an in-process aiohttp server with counting handlers, driven by the SDK's
Transport and the CLI's `call`, to check open routes, 401/403 shapes and that a refused
request never reaches its handler.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
import yarl
from aiohttp import web
from aiohttp.test_utils import TestServer

from node import acl, auth
from node.acl import (AclFileError, AuthError, NonceCache, Perm, canonical_target, parse_acl, sign_headers,
                      verify)
from node.config import ConfigError, from_properties

NOW = 1_700_000_000_000
ACL_DOC = {"accounts": [
    {"accessKey": "admin-key", "secretKey": "admin-secret", "admin": True},
    {"accessKey": "producer1", "secretKey": "prod-secret", "topicPerms": ["orders=PUB|SUB"],
     "groupPerms": ["billing=PUB|SUB"]},
    {"accessKey": "reader01", "secretKey": "read-secret", "defaultTopicPerm": "DENY",
     "topicPerms": ["orders=SUB", "secret=DENY"], "defaultGroupPerm": "SUB", "groupPerms": ["ops=DENY"]},
]}
ACCOUNTS = parse_acl(json.dumps(ACL_DOC))


def server_verify(method, url: str, headers, body=b"", now=NOW, nonces=None, accounts=ACCOUNTS):
    """What the node does: rebuild the canonical target from the raw URL as it goes on the wire."""
    raw = yarl.URL(url).raw_path_qs
    path, _, query = raw.partition("?")
    return verify(accounts, NonceCache(300_000, 1000) if nonces is None else nonces, method, canonical_target(path, query),
                  headers, body, now)


def signed(method="POST", path="/topics/orders/messages", query=None, body=b'{"messages":[]}',
           ak="producer1", sk="prod-secret", now=NOW):
    return sign_headers(ak, sk, method, path, query, body, now)


def url_of(path, query=None):
    u = yarl.URL("http://127.0.0.1:1" + path)
    return str(u.with_query({k: str(v) for k, v in query.items()}) if query else u)


# --- signing --------------------------------------------------------------------------------------
def test_signed_request_verifies_and_names_its_account():
    h = signed()
    assert server_verify("POST", url_of("/topics/orders/messages"), h, b'{"messages":[]}').access_key == "producer1"


def test_query_and_escaped_path_verify_as_sent_on_the_wire():
    q = {"offset": 0, "max": 32, "tags": "a||b c+d"}
    h = signed("GET", "/topics/%25RETRY%25billing/queues/0/messages", q, None)
    server_verify("GET", url_of("/topics/%25RETRY%25billing/queues/0/messages", q), h)


@pytest.mark.parametrize("change", ["body", "path", "query", "method", "timestamp", "nonce"])
def test_tampered_request_is_refused(change):
    h = signed("POST", "/topics/orders/messages", {"x": "1"}, b"body")
    method, url, body = "POST", url_of("/topics/orders/messages", {"x": "1"}), b"body"
    if change == "body":
        body = b"bodY"
    elif change == "path":
        url = url_of("/topics/other/messages", {"x": "1"})
    elif change == "query":
        url = url_of("/topics/orders/messages", {"x": "2"})
    elif change == "method":
        method = "PUT"
    elif change == "timestamp":
        h = {**h, acl.HEADER_TIMESTAMP: str(NOW + 1)}
    else:
        h = {**h, acl.HEADER_NONCE: "n" * 24}
    with pytest.raises(AuthError) as e:
        server_verify(method, url, h, body)
    assert e.value.status == 401
    assert "signature does not match" in str(e.value)


def test_wrong_secret_and_unknown_access_key_are_refused():
    for ak, sk in (("producer1", "not-the-secret"), ("nobody-key", "prod-secret")):
        with pytest.raises(AuthError) as e:
            server_verify("POST", url_of("/topics/orders/messages"), signed(ak=ak, sk=sk), b'{"messages":[]}')
        assert e.value.status == 401


def test_missing_or_malformed_headers_are_refused():
    h = signed()
    for drop in (acl.HEADER_ACCESS_KEY, acl.HEADER_TIMESTAMP, acl.HEADER_NONCE, acl.HEADER_SIGNATURE):
        with pytest.raises(AuthError, match="missing signature"):
            server_verify("POST", url_of("/topics/orders/messages"), {k: v for k, v in h.items() if k != drop})
    with pytest.raises(AuthError, match="milliseconds"):
        server_verify("POST", url_of("/topics/orders/messages"), {**h, acl.HEADER_TIMESTAMP: "12:00"})
    with pytest.raises(AuthError, match="Nonce"):
        server_verify("POST", url_of("/topics/orders/messages"), {**h, acl.HEADER_NONCE: "short"})


@pytest.mark.parametrize("skew_ms", [300_001, -300_001, 3_600_000])
def test_timestamp_outside_the_replay_window_is_refused(skew_ms):
    h = signed(body=b"", now=NOW + skew_ms)
    with pytest.raises(AuthError, match="clock"):
        server_verify("POST", url_of("/topics/orders/messages"), h, b"", now=NOW)


def test_timestamp_at_the_edge_of_the_window_is_accepted():
    h = signed(body=b"", now=NOW - 300_000)
    server_verify("POST", url_of("/topics/orders/messages"), h, b"", now=NOW)


def test_replayed_nonce_is_refused():
    nonces = NonceCache(300_000, 1000)
    h = signed(body=b"x")
    server_verify("POST", url_of("/topics/orders/messages"), h, b"x", nonces=nonces)
    with pytest.raises(AuthError, match="replayed"):
        server_verify("POST", url_of("/topics/orders/messages"), h, b"x", now=NOW + 1000, nonces=nonces)


def test_bad_signature_does_not_burn_the_nonce():
    nonces = NonceCache(300_000, 1000)
    h = signed(body=b"x")
    with pytest.raises(AuthError):
        server_verify("POST", url_of("/topics/orders/messages"), h, b"forged", nonces=nonces)
    server_verify("POST", url_of("/topics/orders/messages"), h, b"x", nonces=nonces)


def test_nonce_cache_is_bounded_and_an_evicted_nonce_cannot_be_replayed():
    nonces = NonceCache(300_000, 4)
    for i in range(10):
        nonces.admit("k", f"nonce-{i:012d}", NOW + i, NOW + i)
        assert len(nonces) <= 4
    with pytest.raises(AuthError, match="replay horizon"):
        nonces.admit("k", "nonce-000000000000", NOW, NOW + 10)    # evicted: the floor refuses it
    nonces.admit("k", "nonce-fresh-000000", NOW + 11, NOW + 11)   # fresh requests still pass


def test_expired_nonces_are_dropped():
    nonces = NonceCache(1000, 100)
    for i in range(10):
        nonces.admit("k", f"nonce-{i:012d}", NOW, NOW)
    nonces.admit("k", "nonce-later-000000", NOW + 5000, NOW + 5000)
    assert len(nonces) == 1


# --- ACL file and permissions ---------------------------------------------------------------------
@pytest.mark.parametrize("doc, where", [
    ("not json", "not valid JSON"),
    ({"accounts": "x"}, "accounts"),
    ({"accounts": [{"accessKey": "short", "secretKey": "long-enough"}]}, "accounts[0].accessKey"),
    ({"accounts": [{"accessKey": "long-enough", "secretKey": "12345"}]}, "accounts[0].secretKey"),
    ({"accounts": [{"accessKey": "abcdefg", "secretKey": "abcdefg", "topicPerms": ["t=WRITE"]}]},
     "accounts[0].topicPerms[0]"),
    ({"accounts": [{"accessKey": "abcdefg", "secretKey": "abcdefg", "groupPerms": ["noequals"]}]},
     "accounts[0].groupPerms[0]"),
    ({"accounts": [{"accessKey": "abcdefg", "secretKey": "abcdefg", "admin": "yes"}]}, "accounts[0].admin"),
    ({"accounts": [{"accessKey": "abcdefg", "secretKey": "abcdefg"}] * 2}, "appears twice"),
])
def test_malformed_acl_file_is_refused_with_the_place_named(doc, where):
    with pytest.raises(AclFileError, match=where.replace("[", r"\[").replace("]", r"\]")):
        parse_acl(doc if isinstance(doc, str) else json.dumps(doc))


def test_permissions_follow_lists_defaults_and_retry_topics():
    reader = ACCOUNTS["reader01"]
    assert reader.topic_perm("orders") == Perm.SUB
    assert reader.topic_perm("secret") == Perm.DENY
    assert reader.topic_perm("unlisted") == Perm.DENY
    assert reader.topic_perm("%RETRY%billing") == Perm.SUB       # checked as the group billing
    assert reader.topic_perm("%DLQ%ops") == Perm.DENY
    assert ACCOUNTS["producer1"].topic_perm("orders") == Perm.PUB | Perm.SUB


@pytest.mark.parametrize("ak, method, pattern, info, ok", [
    ("producer1", "POST", "/topics/{topic}/messages", {"topic": "orders"}, True),
    ("reader01", "POST", "/topics/{topic}/messages", {"topic": "orders"}, False),
    ("reader01", "GET", "/topics/{topic}/queues/{queue_id}/messages", {"topic": "orders"}, True),
    ("reader01", "GET", "/topics/{topic}/queues/{queue_id}/messages", {"topic": "secret"}, False),
    ("producer1", "POST", "/topics", {}, False),
    ("producer1", "DELETE", "/topics/{topic}", {"topic": "orders"}, False),
    ("producer1", "POST", "/groups/{group}/offsets/reset", {"group": "billing"}, False),
    ("producer1", "GET", "/config", {}, False),
    ("producer1", "POST", "/some/future/route", {}, False),
    ("producer1", "GET", None, {}, False),
    ("reader01", "POST", "/groups/{group}/offsets", {"group": "billing"}, True),
    ("reader01", "POST", "/groups/{group}/offsets", {"group": "ops"}, False),
    ("reader01", "GET", "/topics", {}, True),
    ("admin-key", "POST", "/topics", {}, True),
    ("admin-key", "POST", "/groups/{group}/offsets/reset", {"group": "ops"}, True),
])
def test_authorise(ak, method, pattern, info, ok):
    if ok:
        auth.authorise(ACCOUNTS[ak], method, pattern, info)
    else:
        with pytest.raises(AuthError) as e:
            auth.authorise(ACCOUNTS[ak], method, pattern, info)
        assert e.value.status == 403


def test_a_pull_that_names_its_group_needs_sub_on_the_group_too():
    pull = "/topics/{topic}/queues/{queue_id}/messages"
    auth.authorise(ACCOUNTS["reader01"], "GET", pull, {"topic": "orders"}, None, "billing")
    with pytest.raises(AuthError, match="SUB on group 'ops'"):
        auth.authorise(ACCOUNTS["reader01"], "GET", pull, {"topic": "orders"}, None, "ops")
    with pytest.raises(AuthError, match="topic 'secret'"):
        auth.authorise(ACCOUNTS["reader01"], "GET", pull, {"topic": "secret"}, None, "billing")
    auth.authorise(ACCOUNTS["admin-key"], "GET", pull, {"topic": "secret"}, None, "ops")


def test_transactions_check_the_producer_group():
    auth.authorise(ACCOUNTS["producer1"], "GET", "/transactions/pending", {}, "billing")
    with pytest.raises(AuthError):
        auth.authorise(ACCOUNTS["reader01"], "GET", "/transactions/pending", {}, "billing")   # SUB only
    with pytest.raises(AuthError):
        auth.authorise(ACCOUNTS["producer1"], "POST", "/transactions/end", {}, None)


def test_every_node_route_is_open_ruled_or_admin_only():
    """A route added to the API without a rule is admin-only; the known user routes have rules."""
    from node.api import ROUTES
    patterns = {(m, p) for m, p, _ in ROUTES}
    for key in auth.RULES:
        if not key[1].startswith("/dashboard"):
            assert key in patterns, f"rule for a route that does not exist: {key}"
    assert ("POST", "/topics/{topic}/messages") in auth.RULES
    assert ("POST", "/topics") not in auth.RULES


# --- config ---------------------------------------------------------------------------------------
def test_acl_enable_without_acl_file_is_a_config_error():
    c, _ = from_properties({"aclEnable": "true"})
    with pytest.raises(ConfigError, match="aclFile: must name the ACL file"):
        auth.preflight(c)
    with pytest.raises(ConfigError, match="aclFile"):
        auth.install(web.Application(), c)
    auth.preflight(from_properties({})[0])     # off: nothing to check
    c, _ = from_properties({"aclEnable": "true", "aclFile": "/etc/acl.json", "aclReplayWindowMs": "60000"})
    assert c.acl_replay_window_ms == 60_000
    with pytest.raises(ConfigError, match="aclNonceCacheSize"):
        from_properties({"aclNonceCacheSize": "1"})


def test_unreadable_acl_file_at_start_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="aclFile"):
        auth.AclStore(str(tmp_path / "missing.json"), 1000)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        auth.AclStore(str(bad), 1000)


def test_acl_file_reloads_on_change_and_keeps_the_old_acl_when_broken(tmp_path):
    path = tmp_path / "acl.json"
    path.write_text(json.dumps(ACL_DOC))
    clock = [0.0]
    store = auth.AclStore(str(path), 1000, clock=lambda: clock[0])
    assert store.current()["reader01"].topic_perm("orders") == Perm.SUB
    doc = json.loads(json.dumps(ACL_DOC))
    doc["accounts"][2]["topicPerms"] = ["orders=PUB|SUB"]
    path.write_text(json.dumps(doc))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10_000_000))
    assert store.current()["reader01"].topic_perm("orders") == Perm.SUB    # not yet: interval bounds polling
    clock[0] = 1.5
    assert store.current()["reader01"].topic_perm("orders") == Perm.PUB | Perm.SUB
    path.write_text("{ broken")
    clock[0] = 3.0
    assert store.current()["reader01"].topic_perm("orders") == Perm.PUB | Perm.SUB
    assert store.reloads == 2


# --- middleware, SDK transport and CLI against an in-process server --------------------------------
def _app(tmp_path, calls: list, client_max_size: int = 1024 ** 2):
    path = tmp_path / "acl.json"
    path.write_text(json.dumps(ACL_DOC))
    cfg, _ = from_properties({"aclEnable": "true", "aclFile": str(path)})

    def handler(name):
        async def h(request):
            await request.read()
            calls.append(name)
            return web.json_response({"ok": name, "body_len": len(await request.read())})
        return h
    app = web.Application(client_max_size=client_max_size)
    auth.install(app, cfg)
    for method, route in (("GET", "/health"), ("GET", "/metrics"), ("GET", "/dashboard/static/{name}"),
                          ("POST", "/topics/{topic}/messages"), ("POST", "/topics"), ("GET", "/topics"),
                          ("GET", "/topics/{topic}/queues/{queue_id}/messages")):
        app.router.add_route(method, route, handler(f"{method} {route}"))
    return app


def test_middleware_end_to_end(tmp_path):
    from mqstore import cli
    from mqstore.client.errors import MQBrokerError
    from mqstore.client.transport import BrokerGroup, Transport
    calls: list[str] = []

    async def run():
        server = TestServer(_app(tmp_path, calls), host="127.0.0.1")
        await server.start_server()
        addr = f"127.0.0.1:{server.port}"
        group = BrokerGroup("g", [addr])
        try:
            anon = Transport(2.0, access_key="", secret_key="")
            await anon.start()
            for path in ("/health", "/metrics", "/dashboard/static/app.js"):
                assert (await anon.call(group, "GET", path))["ok"]
            for method, path in (("GET", "/topics"), ("POST", "/topics/orders/messages")):
                with pytest.raises(MQBrokerError) as e:
                    await anon.call(group, method, path, {"messages": [{"body": "x"}]})
                assert e.value.http_status == 401 and e.value.code == "UNAUTHENTICATED" and not e.value.retriable
            await anon.close()
            calls_before = list(calls)

            producer = Transport(2.0, access_key="producer1", secret_key="prod-secret")
            reader = Transport(2.0, access_key="reader01", secret_key="read-secret")
            await producer.start()
            await reader.start()
            doc = await producer.call(group, "POST", "/topics/orders/messages", {"messages": [{"body": "x" * 5000}]})
            assert doc["body_len"] > 5000         # the handler still reads the body the middleware hashed
            await reader.call(group, "GET", "/topics/orders/queues/0/messages", params={"offset": 0, "tags": "a||b"})
            with pytest.raises(MQBrokerError) as e:
                await reader.call(group, "POST", "/topics/orders/messages", {"messages": [{"body": "x"}]})
            assert e.value.http_status == 403 and e.value.code == "NO_PERMISSION"
            with pytest.raises(MQBrokerError) as e:
                await producer.call(group, "POST", "/topics", {"topic": "t2"})
            assert e.value.http_status == 403
            await producer.close()
            await reader.close()
            assert calls == calls_before + ["POST /topics/{topic}/messages",
                                            "GET /topics/{topic}/queues/{queue_id}/messages"]

            # the CLI's helper signs too (blocking urllib: run it off the loop)
            cli.set_credentials("admin-key", "admin-secret")
            try:
                out = await asyncio.to_thread(cli.call, addr, "POST", "/topics", {"topic": "t3"})
                assert out["ok"] == "POST /topics"
                out = await asyncio.to_thread(cli.call, addr, "GET", "/topics/%25RETRY%25g/queues/0/messages?offset=0")
                assert out["ok"]
                cli.set_credentials(None, None)
                with pytest.raises(cli.CliError, match="UNAUTHENTICATED.*HTTP 401"):
                    await asyncio.to_thread(cli.call, addr, "GET", "/topics")
            finally:
                cli.set_credentials(None, None)
        finally:
            await server.close()
    asyncio.run(run())


def test_replayed_http_request_is_refused_and_not_handled(tmp_path):
    import aiohttp
    calls: list[str] = []

    async def run():
        server = TestServer(_app(tmp_path, calls), host="127.0.0.1")
        await server.start_server()
        try:
            body = b'{"messages":[{"body":"x"}]}'
            h = sign_headers("producer1", "prod-secret", "POST", "/topics/orders/messages", None, body,
                             int(time.time() * 1000))
            async with aiohttp.ClientSession() as s:
                url = f"http://127.0.0.1:{server.port}/topics/orders/messages"
                async with s.post(url, data=body, headers=h) as r:
                    assert r.status == 200
                async with s.post(url, data=body, headers=h) as r:
                    assert r.status == 401
                    doc = await r.json()
                    assert doc["error"] == "UNAUTHENTICATED" and doc["retriable"] is False
                    assert "replayed" in doc["message"]
        finally:
            await server.close()
    asyncio.run(run())
    assert calls == ["POST /topics/{topic}/messages"]


def test_cli_and_transport_refuse_half_a_key_pair():
    from mqstore import cli
    from mqstore.client.errors import MQConfigError
    from mqstore.client.transport import Transport
    with pytest.raises(cli.CliError):
        cli.set_credentials("producer1", None)
    with pytest.raises(MQConfigError):
        Transport(1.0, access_key="producer1", secret_key="")


def test_refusal_log_is_rate_limited(caplog):
    """Regression: every refused request wrote a log line, so a flood of unsigned requests
    could fill the disk with log lines."""
    import logging

    class Req:
        method, path, remote = "GET", "/topics", "127.0.0.1"
    clock = [0.0]
    rl = auth.RefusalLog(1.0, clock=lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="node.auth"):
        for _ in range(1000):
            rl.note(Req(), acl.unauthenticated("missing signature"))
        clock[0] = 1.5
        rl.note(Req(), acl.unauthenticated("missing signature"))
    lines = [r.getMessage() for r in caplog.records if r.name == "node.auth"]
    assert len(lines) == 2
    assert "+999 more refused" in lines[1]
    assert rl.total == 1001


def test_unsigned_request_is_refused_before_its_body_is_read(tmp_path):
    """Regression: the middleware buffered the whole body (up to maxRequestBytes) before it
    looked at the headers, so anyone could make the node hold large unsigned bodies."""
    import aiohttp
    calls: list[str] = []

    async def run():
        app = _app(tmp_path, calls, client_max_size=1024)   # a larger body read would be a 413
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{server.port}/topics/orders/messages",
                                  data=b"x" * 100_000) as r:
                    assert r.status == 401
                    assert (await r.json())["error"] == "UNAUTHENTICATED"
        finally:
            await server.close()
    asyncio.run(run())
    assert calls == []
