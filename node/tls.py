"""`ssl.SSLContext`s from config (tlsEnable, tlsCertFile, tlsKeyFile, tlsCaFile).

Peer ports (Raft, HA) use mutual TLS: the listener requires a client certificate signed by
the cluster CA (`CERT_REQUIRED`), and the dialler verifies the listener's certificate and
host name against the same CA. HTTP APIs (node, controller) use server-auth TLS: clients
verify the server; a client certificate is checked when offered, never required
(`CERT_OPTIONAL`), so curl and the SDK work with just the CA file. TLS 1.2 is the floor.

Failed handshakes are counted per listener in `rocketmq_tls_handshake_failures_total{listener}`
(`HANDSHAKE_FAILURES`, process-wide like node/limits.py's REJECTIONS): `count_failures(ctx,
listener)` gives a listener's context an `sslobject_class` (the documented hook of
`SSLContext.wrap_bio`, which asyncio's TLS transport uses for every connection) whose
`do_handshake` counts the TLS error that ends a handshake: a peer that does not trust our
certificate (its alert), one whose certificate we do not trust or that sends none where one
is required, a plain-TCP client on a TLS port, a protocol version below the floor. A client
that connects and closes or stays silent is not a TLS failure and is not counted; nor is one
that rejects our certificate and closes without sending its alert (asyncio clients do so),
which is why the dialling side of peer links counts its own failures too (`raft_dial`,
`ha_dial`: a listener certificate this node does not trust, or a refusal of its own).
"""

from __future__ import annotations

import os
import ssl
from typing import Any, Iterator

from node.config import ConfigError
from node.peer_auth import FailureLog

# The label set of the failure counter: the listeners, and the dialling side of peer links.
LISTENERS = ("api", "stream", "raft", "ha", "controller", "raft_dial", "ha_dial")
# Raised by do_handshake while a handshake is still in progress (asyncio retries on these).
_IN_PROGRESS = (ssl.SSLWantReadError, ssl.SSLWantWriteError, ssl.SSLSyscallError)


def _need_file(key: str, path: str) -> str:
    if not path:
        raise ConfigError(f"{key}: required when tlsEnable=true")
    if not os.path.isfile(path):
        raise ConfigError(f"{key}: no such file {path}")
    return path


def server_context(cert_file: str, key_file: str, ca_file: str = "", require_client_cert: bool = True
                   ) -> ssl.SSLContext:
    """A listener's context. `require_client_cert`: mutual TLS (peer ports); else clients may
    present a certificate (checked against `ca_file` when given) but need not."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(_need_file("tlsCertFile", cert_file), _need_file("tlsKeyFile", key_file))
    except ssl.SSLError as e:
        raise ConfigError(f"tlsCertFile/tlsKeyFile: cannot load {cert_file} / {key_file}: {e}") from None
    if require_client_cert:
        _load_ca(ctx, _need_file("tlsCaFile", ca_file))
        ctx.verify_mode = ssl.CERT_REQUIRED
    elif ca_file:
        _load_ca(ctx, _need_file("tlsCaFile", ca_file))
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def client_context(ca_file: str, cert_file: str = "", key_file: str = "") -> ssl.SSLContext:
    """A dialler's context: verifies the server (certificate and host name) against `ca_file`;
    presents `cert_file` when given (required by peer listeners)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca_file:
        _load_ca(ctx, _need_file("tlsCaFile", ca_file))
    if cert_file or key_file:
        try:
            ctx.load_cert_chain(_need_file("tlsCertFile", cert_file), _need_file("tlsKeyFile", key_file))
        except ssl.SSLError as e:
            raise ConfigError(f"tlsCertFile/tlsKeyFile: cannot load {cert_file} / {key_file}: {e}") from None
    return ctx


def _load_ca(ctx: ssl.SSLContext, ca_file: str) -> None:
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except ssl.SSLError as e:
        raise ConfigError(f"tlsCaFile: cannot load {ca_file}: {e}") from None


def api_server_context(config) -> ssl.SSLContext | None:
    """The node HTTP API's context (server-auth TLS), or None when tlsEnable=false."""
    if not config.tls_enable:
        return None
    return server_context(config.tls_cert_file, config.tls_key_file, config.tls_ca_file, require_client_cert=False)


def client_context_from_env(ca_file: str | None = None) -> ssl.SSLContext | None:
    """For the SDK and CLI: a context trusting `ca_file` or $MQSTORE_TLS_CA; None = plain http."""
    ca = ca_file or os.environ.get("MQSTORE_TLS_CA", "")
    if not ca:
        return None
    if not os.path.isfile(ca):
        raise ConfigError(f"MQSTORE_TLS_CA / --tls-ca: no such file {ca}")
    return client_context(ca)


# --- failed handshakes --------------------------------------------------------------------------
# Counted per listener, one warning per listener a second at most (peer_auth.FailureLog).
HANDSHAKE_FAILURES = FailureLog(what="TLS handshake failed")


def _counting_class(listener: str) -> type[ssl.SSLObject]:
    class CountingSSLObject(ssl.SSLObject):
        """An SSLObject whose failed handshake is counted for its listener."""

        def do_handshake(self) -> None:
            try:
                super().do_handshake()
            except _IN_PROGRESS:
                raise
            except ssl.SSLError as e:   # certificate verification, peer alerts, not TLS at all
                HANDSHAKE_FAILURES.record(listener, None, reason(e))
                raise

    CountingSSLObject.__qualname__ = f"CountingSSLObject[{listener}]"
    return CountingSSLObject


_COUNTING = {name: _counting_class(name) for name in LISTENERS}


def reason(err: BaseException) -> str:
    """The short words of a TLS error (ssl's `reason`, e.g. CERTIFICATE_VERIFY_FAILED)."""
    return getattr(err, "reason", None) or str(err)


def count_failures(ctx: ssl.SSLContext | None, listener: str) -> ssl.SSLContext | None:
    """`ctx`, its failed handshakes counted for `listener` from now on (None stays None).
    A context serves one listener kind: labelling it again relabels it."""
    if ctx is not None:
        ctx.sslobject_class = _COUNTING[listener]
    return ctx


class HandshakeFailuresCollector:
    """`rocketmq_tls_handshake_failures_total{listener}` for a node's or controller's registry."""

    def __init__(self, failures: FailureLog = HANDSHAKE_FAILURES):
        self.failures = failures

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily
        fam = CounterMetricFamily("rocketmq_tls_handshake_failures", "TLS handshakes that failed on a listener "
                                  "(untrusted or missing certificate, peer alert, plain TCP on a TLS port)",
                                  labels=["listener"])
        for name in LISTENERS:
            fam.add_metric([name], self.failures.get(name))
        yield fam
