"""Failed TLS handshakes are counted per listener: rocketmq_tls_handshake_failures_total{listener}.

Goal: on each kind of listener (the node API, Raft, HA, the controller's API) a plain-TCP
client on the TLS port, a client that does not trust the listener's CA, and a peer whose
certificate comes from another CA each raise that listener's counter by one; a client that
completes the handshake, or connects and leaves without a word, does not. Method: real
listeners on free loopback ports in process (dledger Transport, classic HALog master,
node/api_site.py LimitedSite, an asyncio server labelled "controller"), trustme
certificates, asyncio clients; the server side counts asynchronously, so each check waits
(bounded) for the counter.
"""

from __future__ import annotations

import asyncio
import socket
import ssl

import pytest
from aiohttp import web
from prometheus_client import generate_latest

from node import tls
from node.peer_auth import PeerSecurity
from node.tls import HANDSHAKE_FAILURES
from tests.integration.test_peer_security import pki  # noqa: F401 - fixture


async def counted(listener: str, attempt, n: int = 1) -> None:
    """Run `attempt()` (a coroutine function); the listener's failures must grow by exactly n."""
    before = HANDSHAKE_FAILURES.get(listener)
    await attempt()
    deadline = asyncio.get_running_loop().time() + 3.0
    while HANDSHAKE_FAILURES.get(listener) - before < n and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)     # and not more
    assert HANDSHAKE_FAILURES.get(listener) - before == n, listener


async def plain_tcp(port: int) -> None:
    """An HTTP request in clear text to a TLS port; whatever comes back is not HTTP."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        await asyncio.wait_for(reader.read(100), 3.0)
    except (ConnectionError, asyncio.TimeoutError):
        pass
    writer.close()


def _blocking_tls(port: int, ctx: ssl.SSLContext) -> bool:
    """A blocking client, as curl or openssl would be: it sends its alert when it rejects the
    listener's certificate. True when the handshake completes on both sides."""
    with socket.create_connection(("127.0.0.1", port), timeout=3) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                s.settimeout(0.5)
                try:   # TLS 1.3: the listener's verdict on our certificate arrives as a read
                    if s.recv(1) == b"":
                        return False
                except socket.timeout:
                    pass
                return True
        except (ssl.SSLError, ConnectionError):
            return False


async def tls_client(port: int, ctx: ssl.SSLContext) -> bool:
    return await asyncio.to_thread(_blocking_tls, port, ctx)


async def silent(port: int) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.close()


async def each_failure_once(listener: str, port: int, pki: dict, peer_port: bool) -> None:
    right = tls.client_context(pki["ca"], pki["node"], pki["node"])
    await counted(listener, lambda: plain_tcp(port))

    async def wrong_ca():    # the client refuses our certificate and tells us so
        assert not await tls_client(port, tls.client_context(pki["other-ca"], pki["other"], pki["other"]))
    await counted(listener, wrong_ca)
    if peer_port:   # mutual TLS: a certificate from another CA is refused by the listener
        async def stranger():
            assert not await tls_client(port, tls.client_context(pki["ca"], pki["other"], pki["other"]))
        await counted(listener, stranger)

    async def healthy():
        assert await tls_client(port, right)
    await counted(listener, healthy, 0)
    await counted(listener, lambda: silent(port), 0)


def test_raft_listener_counts_failed_handshakes(pki):
    from dledger.transport import Transport, TransportConfig

    async def go():
        sec = PeerSecurity(None, tls.server_context(pki["node"], pki["node"], pki["ca"]),
                           tls.client_context(pki["ca"], pki["node"], pki["node"]))
        t = Transport("n0", "g", ("127.0.0.1", 0), {"n1": ("127.0.0.1", 1)}, lambda s, m: None,
                      TransportConfig(security=sec, reconnect_backoff_min_ms=1000, reconnect_backoff_max_ms=1000))
        await t.start()
        try:
            await each_failure_once("raft", t.bound_port, pki, peer_port=True)
        finally:
            await t.stop()
    asyncio.run(go())


def test_ha_listener_counts_failed_handshakes(tmp_path, pki):
    from tests.integration.test_ha_loopback import master_log

    async def go():
        sec = PeerSecurity(None, tls.server_context(pki["node"], pki["node"], pki["ca"]), None)
        m = master_log(tmp_path, security=sec)
        await m.start()
        try:
            await each_failure_once("ha", m.ha_port, pki, peer_port=True)
        finally:
            await m.stop()
    asyncio.run(go())


def test_api_listener_counts_failed_handshakes(pki):
    from node.api_site import LimitedSite

    async def go():
        app = web.Application()
        async def ok(request: web.Request) -> web.Response:
            return web.Response(text="ok")
        app.router.add_get("/health", ok)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        ctx = tls.count_failures(tls.server_context(pki["node"], pki["node"], pki["ca"], require_client_cert=False),
                                 "api")
        site = LimitedSite(runner, "127.0.0.1", 0, max_connections=64, ssl_context=ctx)
        await site.start()
        try:
            await each_failure_once("api", site.port, pki, peer_port=False)
            await asyncio.sleep(0.1)
            assert site.open_connections() == 0, "failed handshakes give their slot back"
        finally:
            await runner.cleanup()
    asyncio.run(go())


def test_a_context_labelled_controller_counts_as_controller(pki):
    async def go():
        async def serve(reader, writer):
            writer.close()
        ctx = tls.count_failures(tls.server_context(pki["node"], pki["node"], pki["ca"], require_client_cert=False),
                                 "controller")
        server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=ctx)
        port = server.sockets[0].getsockname()[1]
        try:
            await counted("controller", lambda: plain_tcp(port))
            await counted("api", lambda: plain_tcp(port), 0)
        finally:
            server.close()
            await server.wait_closed()
    asyncio.run(go())


def test_peer_diallers_count_a_listener_they_do_not_trust(pki):
    """The dialling side of Raft and HA: the listener shows a certificate from another CA."""
    from dledger.transport import Transport, TransportConfig
    from ha.shell import HAClient

    class Sink:
        def ha_max_offset(self) -> int:
            return 0

    async def go():
        async def serve(reader, writer):
            writer.close()
        impostor = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=tls.server_context(
            pki["other"], pki["other"], pki["other-ca"], require_client_cert=False))
        port = impostor.sockets[0].getsockname()[1]
        ours = PeerSecurity(None, None, tls.client_context(pki["ca"], pki["node"], pki["node"]))
        t = Transport("n0", "g", ("127.0.0.1", 0), {"n1": ("127.0.0.1", port)}, lambda s, m: None,
                      TransportConfig(security=ours, reconnect_backoff_min_ms=5000, reconnect_backoff_max_ms=5000))
        client = HAClient(f"127.0.0.1:{port}", Sink(), 1, security=ours)
        before = {k: HANDSHAKE_FAILURES.get(k) for k in ("raft_dial", "ha_dial", "raft", "ha")}
        await t.start()
        client.start()
        try:
            deadline = asyncio.get_running_loop().time() + 5.0
            while not all(HANDSHAKE_FAILURES.get(k) > before[k] for k in ("raft_dial", "ha_dial")):
                assert asyncio.get_running_loop().time() < deadline, "no dial failure counted"
                await asyncio.sleep(0.05)
            assert t.metrics["connect_failures"] >= 1 and "SSLCertVerificationError" in client.last_error
            assert all(HANDSHAKE_FAILURES.get(k) == before[k] for k in ("raft", "ha"))
        finally:
            await client.stop()
            await t.stop()
            impostor.close()
            await impostor.wait_closed()
    asyncio.run(go())


def test_the_counter_is_exposed_on_node_and_controller_registries():
    from node.metrics import controller_registry
    from node.tls import HandshakeFailuresCollector

    class FakeSM:
        def snapshot(self):
            return {}

        def is_leader(self):
            return False
    text = generate_latest(controller_registry(FakeSM())).decode()
    for listener in ("api", "raft", "ha", "controller"):
        assert f'rocketmq_tls_handshake_failures_total{{listener="{listener}"}}' in text
    fam = next(HandshakeFailuresCollector().collect())
    assert {s.labels["listener"] for s in fam.samples if s.name.endswith("_total")} == set(tls.LISTENERS)
    assert tls.count_failures(None, "raft") is None
