"""The dashboard's fan-out (`GET /cluster/nodes`) on a secured DLedger group.

Method: three `python -m node` processes on free loopback ports with aclEnable=true and a
cluster secret (and, in the second case, tlsEnable=true with trustme certificates). An
admin-signed GET /cluster/nodes on one node must list all three members reachable with
their /cluster documents and roles (one LEADER, two FOLLOWERs): the node reads its peers
over https with the cluster CA and signs each read with the cluster secret. Then the
limits of the peer identity: a cluster-secret signature reads GET /cluster and nothing
else (a POST /topics with it is refused 403 and creates nothing; GET /topics and
GET /cluster/nodes are refused 403), a wrong secret and a replayed request get 401.
In-process: a peer answering 401 is shown unreachable, not "reachable" with the error
document as its state (regression), and an ACL node without a secret logs that once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from aiohttp import web

from node import dashboard, peer_auth, tls
from node.acl import sign_headers
from tests.integration.test_peer_security import SECRET, WRONG, Group, pki, tls_lines, wait  # noqa: F401 - fixture

ACL = {"accounts": [{"accessKey": "admin-key", "secretKey": "admin-secret", "admin": True}]}


def call(port: int, method: str, path: str, headers: dict[str, str], doc=None,
         ctx: ssl.SSLContext | None = None) -> tuple[int, dict]:
    body = json.dumps(doc).encode() if doc is not None else b""
    scheme = "https" if ctx is not None else "http"
    req = urllib.request.Request(f"{scheme}://127.0.0.1:{port}{path}", data=body or None, method=method,
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def admin(method: str, path: str, doc=None) -> dict[str, str]:
    body = json.dumps(doc).encode() if doc is not None else b""
    return sign_headers("admin-key", "admin-secret", method, path, None, body, int(time.time() * 1000))


def peer(method: str, path: str, secret: str = SECRET, doc=None) -> dict[str, str]:
    body = json.dumps(doc).encode() if doc is not None else b""
    return peer_auth.sign_request(secret.encode(), "n9", method, path, body)


@pytest.mark.parametrize("use_tls", [False, True], ids=["acl", "acl+tls"])
def test_cluster_nodes_shows_every_member_under_acl(tmp_path, pki, use_tls):  # noqa: F811
    acl_path = tmp_path / "acl.json"
    acl_path.write_text(json.dumps(ACL))
    extra = ["aclEnable=true", f"aclFile={acl_path}", f"clusterSecret={SECRET}", *(tls_lines(pki) if use_tls else [])]
    g = Group(str(tmp_path), {n: extra for n in ("n0", "n1", "n2")})
    ctx = tls.client_context(pki["ca"]) if use_tls else None
    try:
        g.start()
        leader = g.leader(["n0", "n1", "n2"], ctx)
        follower = next(n for n in ("n0", "n1", "n2") if n != leader)
        port = g.api[follower]

        def all_three():
            status, doc = call(port, "GET", "/cluster/nodes", admin("GET", "/cluster/nodes"), ctx=ctx)
            assert status == 200, doc
            roles = sorted((n["cluster"] or {}).get("role", "?") for n in doc["nodes"])
            leaders = {(n["cluster"] or {}).get("leader") for n in doc["nodes"]}
            # settled: one leader that every member names (an election right after start may
            # still move it, so the leader is read from this document, not from before)
            ok = (all(n["reachable"] for n in doc["nodes"]) and roles == ["FOLLOWER", "FOLLOWER", "LEADER"]
                  and len(leaders) == 1 and None not in leaders)
            return doc if ok else None
        doc = wait(all_three, 20, "all three members reachable with their roles and one leader")
        assert doc["self"] == follower and [n["node_id"] for n in doc["nodes"]] == ["n0", "n1", "n2"]
        leader = next(n["node_id"] for n in doc["nodes"] if n["cluster"]["role"] == "LEADER")
        for n in doc["nodes"]:
            assert n["cluster"]["node_id"] == n["node_id"] and n["cluster"]["leader"] == f"127.0.0.1:{g.api[leader]}"

        # the peer identity reads GET /cluster ...
        status, got = call(port, "GET", "/cluster", peer("GET", "/cluster"), ctx=ctx)
        assert status == 200 and got["node_id"] == follower, got
        # ... and nothing else: a write is refused and changes nothing
        topic = {"topic": "PEERWRITE", "queues": 1}
        lport = g.api[leader]
        status, err = call(lport, "POST", "/topics", peer("POST", "/topics", doc=topic), doc=topic, ctx=ctx)
        assert status == 403 and err["error"] == "NO_PERMISSION", err
        status, topics = call(lport, "GET", "/topics", admin("GET", "/topics"), ctx=ctx)
        assert status == 200 and "PEERWRITE" not in [t["topic"] for t in topics["topics"]], topics
        for path in ("/topics", "/cluster/nodes", "/config"):
            status, err = call(port, "GET", path, peer("GET", path), ctx=ctx)
            assert status == 403, (path, err)
        # a wrong secret, a replay, and no signature at all are refused
        status, err = call(port, "GET", "/cluster", peer("GET", "/cluster", WRONG), ctx=ctx)
        assert status == 401 and err["error"] == "UNAUTHENTICATED", err
        with urllib.request.urlopen(f"{'https' if ctx else 'http'}://127.0.0.1:{port}/metrics", timeout=10,
                                    context=ctx) as r:
            line = next(ln for ln in r.read().decode().splitlines()
                        if ln.startswith('rocketmq_peer_auth_failures_total{listener="api"}'))
        assert float(line.split()[-1]) >= 1, line
        signed = peer("GET", "/cluster")
        assert call(port, "GET", "/cluster", signed, ctx=ctx)[0] == 200
        assert call(port, "GET", "/cluster", signed, ctx=ctx)[0] == 401
        assert call(port, "GET", "/cluster", {}, ctx=ctx)[0] == 401
        # a signature for another path does not carry over
        assert call(port, "GET", "/cluster", peer("GET", "/health"), ctx=ctx)[0] == 401
    finally:
        g.stop()


def test_a_peer_answering_401_is_unreachable_not_its_error_document():
    """Regression: fetch_json returned any JSON body, so a peer refusing the read (401) was
    listed reachable with the error document as its /cluster state."""
    async def main():
        async def refuse(request: web.Request) -> web.Response:
            return web.json_response({"error": "UNAUTHENTICATED", "message": "no"}, status=401)
        app = web.Application()
        app.router.add_get("/cluster", refuse)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await dashboard.gather_nodes({"a": "self", "b": f"127.0.0.1:{port}"},
                                                lambda: {"node_id": "a"}, "a")
        finally:
            await runner.cleanup()
    nodes = asyncio.run(main())
    assert [(n["node_id"], n["reachable"], n["cluster"]) for n in nodes] == [
        ("a", True, {"node_id": "a"}), ("b", False, None)]


def test_peer_client_from_config(pki, caplog):  # noqa: F811
    base = dict(node_id="n0", tls_enable=False, tls_ca_file="", tls_cert_file="", tls_key_file="",
                cluster_secret="", cluster_secret_file="", acl_enable=True)
    with caplog.at_level(logging.WARNING, logger="node.dashboard"):
        c = dashboard.PeerClient.from_config(SimpleNamespace(**base))
    assert c.secret is None and c.scheme == "http" and "X-MQ-Peer-Proof" not in c.headers("GET", "/cluster")
    assert sum("shows only itself" in r.message for r in caplog.records) == 1

    c = dashboard.PeerClient.from_config(SimpleNamespace(**{**base, "cluster_secret": SECRET, "tls_enable": True,
                                                            "tls_ca_file": pki["ca"], "tls_cert_file": pki["node"],
                                                            "tls_key_file": pki["node"]}))
    assert c.scheme == "https" and c.ssl_context is not None
    h = c.headers("GET", "/cluster")
    assert peer_auth.RequestVerifier(SECRET.encode()).verify("GET", "/cluster", h, b"") == "n0"


def test_a_node_without_a_secret_refuses_peer_signatures(tmp_path):
    """aclEnable without clusterSecret: a cluster-secret signature is no credential (401 on
    GET /cluster), and still 403 on a write before anything is read."""
    from node import auth
    acl_path = tmp_path / "acl.json"
    acl_path.write_text(json.dumps(ACL))

    async def main():
        store = auth.AclStore(str(acl_path), 1000)
        mw = auth.make_middleware(store, auth.NonceCache(60_000, 1000), lambda: int(time.time() * 1000), None)
        app = web.Application(middlewares=[mw])
        async def ok(request: web.Request) -> web.Response:
            return web.json_response({"ok": True})
        app.router.add_get("/cluster", ok)
        app.router.add_post("/topics", ok)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await asyncio.to_thread(lambda: (
                call(port, "GET", "/cluster", peer("GET", "/cluster")),
                call(port, "POST", "/topics", peer("POST", "/topics", doc={"topic": "X"}), doc={"topic": "X"}),
                call(port, "GET", "/cluster", admin("GET", "/cluster"))))
        finally:
            await runner.cleanup()
    (s1, e1), (s2, e2), (s3, d3) = asyncio.run(main())
    assert s1 == 401 and "no cluster secret" in e1["message"], e1
    assert s2 == 403 and e2["error"] == "NO_PERMISSION", e2
    assert (s3, d3) == (200, {"ok": True})
