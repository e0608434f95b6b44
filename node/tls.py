"""`ssl.SSLContext`s from config (tlsEnable, tlsCertFile, tlsKeyFile, tlsCaFile).

Peer ports (Raft, HA) use mutual TLS: the listener requires a client certificate signed by
the cluster CA (`CERT_REQUIRED`), and the dialler verifies the listener's certificate and
host name against the same CA. HTTP APIs (node, controller) use server-auth TLS: clients
verify the server; a client certificate is checked when offered, never required
(`CERT_OPTIONAL`), so curl and the SDK work with just the CA file. TLS 1.2 is the floor.
"""

from __future__ import annotations

import os
import ssl

from node.config import ConfigError


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
