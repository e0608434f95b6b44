"""Security counters of real processes: a TLS node's API and a TLS controller.

Goal: on a standalone node with tlsEnable=true and maxHttpConnections=4, a plain-HTTP
request to the https port and a client that rejects the node's certificate each raise
rocketmq_tls_handshake_failures_total{listener="api"}; four silent sockets (stuck before
their TLS handshake) fill the connection cap, the fifth is closed at once and counted in
rocketmq_limit_rejections_total{limit="http_connections"}, and once the four go the node
serves again; maxTopics and maxConsumerGroups refuse one topic and one group too many. On a
controller with --tls-cert, a plain request raises
rocketmq_tls_handshake_failures_total{listener="controller"}. Method:
`python -m node` / `python -m ha` processes on free loopback ports, trustme certificates,
stdlib clients (a blocking TLS client sends its alert, as curl does); /metrics read over
https with prometheus_client's parser; every wait has a deadline.
"""

from __future__ import annotations

import socket
import ssl
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mqstore import localcluster as lc
from node import tls
from tests.integration.test_peer_security import https, pki, tls_lines  # noqa: F401 - pki: fixture


def scrape(port: int, ctx: ssl.SSLContext) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", timeout=5, context=ctx) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def tls_failures(port: int, ctx: ssl.SSLContext, listener: str) -> float:
    return scrape(port, ctx)[("rocketmq_tls_handshake_failures_total", (("listener", listener),))]


def rejections(port: int, ctx: ssl.SSLContext, limit: str) -> float:
    return scrape(port, ctx)[("rocketmq_limit_rejections_total", (("limit", limit),))]


def plain_request(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            s.recv(100)
        except OSError:
            pass


def status_of(port: int, ctx: ssl.SSLContext) -> int | None:
    try:
        return https(port, "GET", "/health", ctx=ctx)[0]
    except OSError:
        return None


def closed_at_once(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
        try:
            return s.recv(1) == b""
        except ConnectionError:
            return True
        except socket.timeout:
            return False


def test_tls_node_counts_failed_handshakes_and_caps_connections(tmp_path, pki):
    port = lc.free_port()
    lines = lc.node_lines(port, str(tmp_path / "store"), [*lc.SMALL_GEOMETRY, "maxMessageSize=65536",
                                                          *tls_lines(pki), "maxHttpConnections=4", "maxTopics=1",
                                                          "maxConsumerGroups=1"])
    node = lc.NodeProc(lc.write_conf(str(tmp_path / "n.conf"), lines), port, str(tmp_path / "n.log"), "n").launch()
    ctx = tls.client_context(pki["ca"])
    try:
        lc.wait_for(lambda: status_of(port, ctx) == 200, 30, "node /health over TLS")
        base = tls_failures(port, ctx, "api")

        plain_request(port)
        lc.wait_for(lambda: tls_failures(port, ctx, "api") >= base + 1, 5, "the plain request counted")
        with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED"):
            https(port, "GET", "/health", ctx=tls.client_context(pki["other-ca"]))
        lc.wait_for(lambda: tls_failures(port, ctx, "api") >= base + 2, 5, "the untrusting client counted")
        time.sleep(0.3)
        assert tls_failures(port, ctx, "api") == base + 2, "the successful scrapes are not failures"

        refused = rejections(port, ctx, "http_connections")
        silent = [socket.create_connection(("127.0.0.1", port), timeout=3) for _ in range(4)]
        try:
            time.sleep(0.3)
            assert closed_at_once(port), "the fifth connection is closed at once"
        finally:
            for s in silent:
                s.close()
        lc.wait_for(lambda: status_of(port, ctx) == 200, 5, "served again once they went")
        assert rejections(port, ctx, "http_connections") == refused + 1

        assert https(port, "POST", "/topics", {"topic": "One", "queues": 1}, ctx)[0] == 200
        status, doc = https(port, "POST", "/topics", {"topic": "Two", "queues": 1}, ctx)
        assert status == 400 and doc["error"] == "LIMIT_EXCEEDED" and "maxTopics" in doc["message"]
        assert [t["topic"] for t in https(port, "GET", "/topics", ctx=ctx)[1]["topics"]] == ["One"]
        assert rejections(port, ctx, "topics") == 1

        commit = {"topic": "One", "queue_id": 0, "offset": 0}
        assert https(port, "POST", "/groups/G1/offsets", commit, ctx)[0] == 200
        status, doc = https(port, "POST", "/groups/G2/offsets", commit, ctx)
        assert status == 400 and doc["error"] == "LIMIT_EXCEEDED" and "maxConsumerGroups" in doc["message"]
        assert https(port, "POST", "/groups/G1/offsets", commit, ctx)[0] == 200     # a known group
        assert https(port, "GET", "/groups", ctx=ctx)[1]["groups"] == ["G1"]
        assert rejections(port, ctx, "consumer_groups") == 1
    finally:
        node.stop()


def test_tls_controller_counts_failed_handshakes(tmp_path, pki):
    api, raft = lc.free_ports(2)
    argv = lc.controller_argv(api, raft, str(tmp_path / "ctl")) + ["--tls-cert", pki["node"], "--tls-key", pki["node"]]
    ctl = lc.Proc(argv, str(tmp_path / "ctl.log"), "controller").start()
    ctx = tls.client_context(pki["ca"])
    try:
        lc.wait_for(lambda: status_of(api, ctx) in (200, 503), 20, "controller /health over TLS")
        base = tls_failures(api, ctx, "controller")
        plain_request(api)
        lc.wait_for(lambda: tls_failures(api, ctx, "controller") >= base + 1, 5, "the plain request counted")
        assert tls_failures(api, ctx, "api") == 0
    finally:
        ctl.stop()
