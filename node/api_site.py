"""The node API's listening socket: at most maxHttpConnections client connections open at once.

aiohttp's TCPSite hands its protocol factory to `loop.create_server`; with TLS the loop runs
the handshake before that protocol sees the connection, so sockets still in the handshake
(a client that connects and sends nothing holds one for the whole handshake timeout) would
be invisible to any count. `LimitedSite` therefore listens in plain TCP and upgrades each
accepted socket itself with `loop.start_tls`. Every accepted socket is counted from accept
to close, in the handshake or serving HTTP: the handshakes this site runs plus aiohttp's
`Server.connections`. One past the cap is closed at once, before any byte is read, and counted
in `rocketmq_limit_rejections_total{limit="http_connections"}`.

A handshake that fails is counted by the context's listener label (node/tls.py,
`rocketmq_tls_handshake_failures_total{listener="api"}`); one that does not finish within
HANDSHAKE_TIMEOUT_S is closed, which frees its slot.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time

from aiohttp import web

from node.limits import REJECTIONS, Rejections
from node.log_throttle import LogThrottle

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0      # a TLS client must finish its handshake within this
REFUSAL_LOG_INTERVAL_S = 1.0    # at most one warning a second about refused connections


class _Accepted(asyncio.Protocol):
    """The protocol of a socket just accepted: the site admits it (hands it to aiohttp) or closes it."""

    __slots__ = ("site",)

    def __init__(self, site: "LimitedSite"):
        self.site = site

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.site._admit(transport)

    def data_received(self, data: bytes) -> None:   # only a refused socket still has this protocol
        pass


class LimitedSite(web.TCPSite):
    """web.TCPSite with a bound on open connections; TLS (when given) is run per connection here."""

    def __init__(self, runner: web.BaseRunner, host: str | None, port: int, *, max_connections: int,
                 ssl_context: ssl.SSLContext | None = None, reuse_address: bool | None = None,
                 rejections: Rejections = REJECTIONS):
        assert max_connections >= 1
        super().__init__(runner, host, port, ssl_context=ssl_context, reuse_address=reuse_address)
        self.max_connections = max_connections
        self.rejections = rejections
        self.refused = 0
        self._handshakes: set[asyncio.Task] = set()
        self._warnings = LogThrottle(REFUSAL_LOG_INTERVAL_S)

    def open_connections(self) -> int:
        """Sockets accepted and not yet closed: in the TLS handshake, or held by aiohttp."""
        server = self._runner.server
        return len(self._handshakes) + (len(server.connections) if server is not None else 0)

    async def start(self) -> None:
        await web.BaseSite.start(self)     # registers the site with the runner
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Accepted(self), self._host, self._port,
                                                backlog=self._backlog, reuse_address=self._reuse_address,
                                                reuse_port=self._reuse_port)
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port

    async def stop(self) -> None:
        for task in list(self._handshakes):
            task.cancel()
        await asyncio.gather(*self._handshakes, return_exceptions=True)
        await super().stop()

    # --- per connection ---------------------------------------------------------------------------
    def _admit(self, transport: asyncio.BaseTransport) -> None:
        server = self._runner.server
        if server is None or self.open_connections() >= self.max_connections:
            self._refuse(transport)
            return
        handler = server()
        if self._ssl_context is None:
            transport.set_protocol(handler)
            handler.connection_made(transport)
            return
        transport.pause_reading()          # no byte reaches _Accepted: start_tls reads the handshake
        task = asyncio.get_running_loop().create_task(self._handshake(transport, handler))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, transport: asyncio.BaseTransport, handler: asyncio.BaseProtocol) -> None:
        loop = asyncio.get_running_loop()
        try:
            tls_transport = await loop.start_tls(transport, handler, self._ssl_context, server_side=True,
                                                 ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError):
            return    # start_tls closed the socket; a TLS failure is counted by node/tls.py
        except asyncio.CancelledError:
            return    # the site is stopping; start_tls closed the socket
        handler.connection_made(tls_transport)

    def _refuse(self, transport: asyncio.BaseTransport) -> None:
        self.rejections.add("http_connections")
        self.refused += 1
        transport.abort()
        skipped = self._warnings.due(time.monotonic())
        if skipped is None:
            return
        log.warning("API: refusing a connection: %d open already (maxHttpConnections)%s", self.max_connections,
                    f" ({skipped} more refusals not logged)" if skipped else "")
