"""Peer authentication (node/peer_auth.py), TLS contexts (node/tls.py) and the config keys.

Method: the pure handshake classes are driven message by message; the asyncio glue and the
Raft transport run over real loopback sockets with raw streams playing the stranger.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from dledger.messages import Heartbeat, RequestVote
from dledger.transport import HANDSHAKE_MAGIC, PROTOCOL_VERSION, Transport, TransportConfig, frame
from dledger import codec
from mqstore.localcluster import free_port
from node import peer_auth
from node.config import ConfigError, from_properties, to_properties
from node.peer_auth import (ClientHandshake, FailureLog, PeerAuthError, PeerSecurity, RequestVerifier,
                            ServerHandshake, load_secret, sign_request)

SECRET = b"s3cret-s3cret-s3cret-0123456789"
OTHER = b"other-other-other-other-0123456"


# --- pure handshake ------------------------------------------------------------------------------------
def run(server: ServerHandshake, client: ClientHandshake) -> tuple[str, str]:
    client_id, accept = server.check_response(client.respond(server.challenge()))
    return client_id, client.check_accept(accept)


def test_same_secret_authenticates_both_sides():
    assert run(ServerHandshake(SECRET, "raft", "n0"), ClientHandshake(SECRET, "raft", "n1", "n0")) == ("n1", "n0")


def test_wrong_secret_is_refused_by_the_server():
    with pytest.raises(PeerAuthError, match="wrong proof"):
        run(ServerHandshake(SECRET, "raft", "n0"), ClientHandshake(OTHER, "raft", "n1"))


def test_server_with_wrong_secret_is_refused_by_the_client():
    server, client = ServerHandshake(OTHER, "raft", "n0"), ClientHandshake(SECRET, "raft", "n1")
    resp = client.respond(server.challenge())
    # A forged server cannot produce the accept either: take a correct one from another nonce pair.
    honest = ServerHandshake(SECRET, "raft", "n0")
    other_client = ClientHandshake(SECRET, "raft", "n1")
    _, accept_for_other_session = honest.check_response(other_client.respond(honest.challenge()))
    with pytest.raises(PeerAuthError, match="wrong proof"):
        client.check_accept(accept_for_other_session)
    with pytest.raises(PeerAuthError):
        server.check_response(resp)


def test_proof_is_bound_to_role_side_and_id():
    server = ServerHandshake(SECRET, "ha", "m")
    with pytest.raises(PeerAuthError, match="listener is 'ha'"):
        server.check_response(ClientHandshake(SECRET, "raft", "n1").respond(server.challenge()))
    # A response whose id was changed after signing fails.
    client = ClientHandshake(SECRET, "ha", "n1")
    obj = msgpack.unpackb(client.respond(server.challenge()), raw=False)
    obj[2] = "n2"
    with pytest.raises(PeerAuthError, match="wrong proof"):
        server.check_response(msgpack.packb(obj, use_bin_type=True))
    # Reflection: the client echoing the server's nonce as its own is refused.
    reflect = ClientHandshake(SECRET, "ha", "n1", nonce=server.nonce_s)
    with pytest.raises(PeerAuthError, match="nonce"):
        server.check_response(reflect.respond(server.challenge()))


def test_client_checks_the_expected_server_id():
    with pytest.raises(PeerAuthError, match="expected 'n2'"):
        run(ServerHandshake(SECRET, "raft", "n0"), ClientHandshake(SECRET, "raft", "n1", "n2"))


@pytest.mark.parametrize("junk", [b"", b"\xc1", msgpack.packb([1, "raft"]),
                                  msgpack.packb([9, "raft", "a", b"x" * 32, b"y"]),
                                  msgpack.packb([1, "raft", "", b"x" * 32, b"y" * 32]),
                                  msgpack.packb([1, "raft", "a", b"short", b"y" * 32])])
def test_malformed_responses_are_refused(junk):
    with pytest.raises(PeerAuthError):
        ServerHandshake(SECRET, "raft", "n0").check_response(junk)


def test_client_refuses_a_listener_that_sends_no_challenge():
    with pytest.raises(PeerAuthError, match="challenge"):
        ClientHandshake(SECRET, "raft", "n1").respond(b"hello")


def test_load_secret(tmp_path):
    assert load_secret() is None
    assert load_secret("x" * 16) == b"x" * 16
    f = tmp_path / "secret"
    f.write_bytes(b"y" * 20 + b"\n")
    assert load_secret(secret_file=str(f)) == b"y" * 20
    with pytest.raises(ValueError, match="at least 16"):
        load_secret("short")
    with pytest.raises(ValueError, match="not both"):
        load_secret("x" * 16, str(f))
    with pytest.raises(ValueError, match="cannot read"):
        load_secret(secret_file=str(tmp_path / "missing"))
    (tmp_path / "empty").write_bytes(b"\n")
    with pytest.raises(ValueError, match="empty"):
        load_secret(secret_file=str(tmp_path / "empty"))


def test_failure_log_is_rate_limited_but_counts_everything(caplog):
    fl = FailureLog(interval_s=1.0)
    logged = [fl.record("raft", "1.2.3.4", "bad", now=100.0 + i * 0.01) for i in range(50)]
    assert logged.count(True) == 1 and fl.totals["raft"] == 50
    assert fl.record("raft", "1.2.3.4", "bad", now=101.5) is True
    assert "49 more failures not logged" in caplog.text


def test_collector_exports_failures_per_listener():
    from prometheus_client import CollectorRegistry, generate_latest
    fl = FailureLog()
    fl.record("ha", "x", "bad", now=0.0)
    reg = CollectorRegistry()
    reg.register(peer_auth.PeerAuthCollector(fl))
    text = generate_latest(reg).decode()
    assert 'rocketmq_peer_auth_failures_total{listener="ha"} 1.0' in text
    assert 'rocketmq_peer_auth_failures_total{listener="raft"} 0.0' in text


# --- signed requests (controller API) -------------------------------------------------------------------
def test_signed_request_verifies_once_and_only_with_the_secret():
    v = RequestVerifier(SECRET, window_ms=60_000)
    h = sign_request(SECRET, "broker-a", "POST", "/brokers/heartbeat", b"{}", now_ms=1_000_000)
    assert v.verify("POST", "/brokers/heartbeat", h, b"{}", now_ms=1_000_500) == "broker-a"
    with pytest.raises(PeerAuthError, match="replay"):
        v.verify("POST", "/brokers/heartbeat", h, b"{}", now_ms=1_000_600)
    h2 = sign_request(SECRET, "broker-a", "POST", "/brokers/heartbeat", b"{}", now_ms=1_000_000)
    with pytest.raises(PeerAuthError, match="wrong request proof"):
        v.verify("POST", "/brokers/heartbeat", h2, b'{"x":1}', now_ms=1_000_500)     # body changed
    with pytest.raises(PeerAuthError, match="wrong request proof"):
        v.verify("POST", "/topics", h2, b"{}", now_ms=1_000_500)                     # path changed
    with pytest.raises(PeerAuthError, match="window"):
        v.verify("POST", "/brokers/heartbeat", h2, b"{}", now_ms=1_000_000 + 61_000)
    with pytest.raises(PeerAuthError, match="wrong request proof"):
        v.verify("POST", "/brokers/heartbeat", sign_request(OTHER, "x", "POST", "/brokers/heartbeat", b"{}",
                                                            now_ms=1_000_000), b"{}", now_ms=1_000_000)
    with pytest.raises(PeerAuthError, match="not signed"):
        v.verify("GET", "/groups", {}, b"", now_ms=1_000_000)


def test_nonce_cache_is_bounded_and_never_lets_a_replay_through():
    v = RequestVerifier(SECRET, window_ms=60_000, cache_max=10)
    signed = [sign_request(SECRET, "b", "GET", "/groups", b"", now_ms=1000 + i) for i in range(30)]
    for h in signed:
        v.verify("GET", "/groups", h, b"", now_ms=2000)
    assert len(v._seen) <= 10
    for h in signed:   # every one of them is refused now: as a seen nonce or below the floor
        with pytest.raises(PeerAuthError):
            v.verify("GET", "/groups", h, b"", now_ms=2000)


# --- config keys ----------------------------------------------------------------------------------------
def test_config_keys_validate_and_secret_is_redacted():
    c, _ = from_properties({"clusterSecret": "x" * 32, "tlsEnable": "false"})
    assert c.cluster_secret == "x" * 32
    props = to_properties(c)
    assert props["clusterSecret"] == "<redacted>" and "x" * 32 not in str(props)
    assert to_properties(from_properties({})[0])["clusterSecret"] == ""
    with pytest.raises(ConfigError, match="clusterSecret: must be 16"):
        from_properties({"clusterSecret": "short"})
    with pytest.raises(ConfigError, match="not both"):
        from_properties({"clusterSecret": "x" * 32, "clusterSecretFile": "/etc/s"})
    with pytest.raises(ConfigError, match="tlsCertFile: required"):
        from_properties({"tlsEnable": "true"})


def test_missing_tls_files_are_config_errors(tmp_path):
    c, _ = from_properties({"tlsEnable": "true", "tlsCertFile": str(tmp_path / "c.pem"),
                            "tlsKeyFile": str(tmp_path / "k.pem"), "tlsCaFile": str(tmp_path / "ca.pem")})
    with pytest.raises(ConfigError, match="tlsCertFile: no such file"):
        peer_auth.peer_security_from_config(c)


def test_warning_when_peers_listen_beyond_loopback_without_a_secret(caplog):
    c, _ = from_properties({})
    peer_auth.peer_security_from_config(c, ("127.0.0.1",))
    assert "without a cluster secret" not in caplog.text
    peer_auth.peer_security_from_config(c, ("0.0.0.0",))
    assert "without a cluster secret" in caplog.text


# --- Raft transport over loopback -------------------------------------------------------------------------
def hello(sender="n1") -> bytes:
    return frame(msgpack.packb([HANDSHAKE_MAGIC, PROTOCOL_VERSION, "g", sender]))


async def until(cond, timeout=5.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.01)


def make(node, port, peers, got, secret):
    return Transport(node, "g", ("127.0.0.1", port), peers, lambda s, m: got.append((s, m)),
                     TransportConfig(security=PeerSecurity(secret), handshake_timeout_ms=1000,
                                     reconnect_backoff_max_ms=100))


def test_raft_frames_without_auth_never_reach_the_core():
    """A raw socket that skips the handshake and sends a valid hello + vote frame delivers nothing."""
    async def main():
        port = free_port()
        got: list = []
        t = make("n0", port, {"n0": ("127.0.0.1", port), "n1": ("127.0.0.1", 1)}, got, SECRET)
        await t.start()
        before = peer_auth.FAILURES.totals["raft"]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        vote = RequestVote(term=99, candidate_id="n1", last_index=10**6, last_term=98, pre_vote=False)
        writer.write(hello() + frame(codec.encode(vote)))
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 3.0)   # the challenge, then close
        assert data[2:7] == b"MQPA1"
        assert got == []
        assert t.metrics["auth_failures"] == 1 and t.metrics["frames_received"] == 0
        assert peer_auth.FAILURES.totals["raft"] == before + 1
        writer.close()
        await t.stop()
    asyncio.run(main())


def test_raft_peers_with_the_secret_talk_and_a_wrong_secret_is_refused():
    async def main():
        p0, p1, p2 = free_port(), free_port(), free_port()
        peers = {"n0": ("127.0.0.1", p0), "n1": ("127.0.0.1", p1), "n2": ("127.0.0.1", p2)}
        g0, g1, g2 = [], [], []
        t0, t1 = make("n0", p0, peers, g0, SECRET), make("n1", p1, peers, g1, SECRET)
        t2 = make("n2", p2, peers, g2, OTHER)
        for t in (t0, t1, t2):
            await t.start()
        t1.send("n0", Heartbeat(3, "n1", 0))
        t2.send("n0", Heartbeat(7, "n2", 0))
        t0.send("n2", Heartbeat(3, "n0", 0))
        await until(lambda: g0 == [("n1", Heartbeat(3, "n1", 0))])
        await until(lambda: t0.metrics["auth_failures"] >= 1 and t2.metrics["auth_failures"] >= 1)
        await asyncio.sleep(0.2)
        assert all(s != "n2" for s, _ in g0) and g2 == []
        for t in (t0, t1, t2):
            await t.stop()
    asyncio.run(main())


def test_secret_on_one_side_only_fails_closed():
    """A dialler with a secret refuses a listener without one (no challenge arrives), and the
    listener without a secret sees a connection that never sends its hello."""
    async def main():
        p0, p1 = free_port(), free_port()
        peers = {"n0": ("127.0.0.1", p0), "n1": ("127.0.0.1", p1)}
        g0, g1 = [], []
        t0 = make("n0", p0, peers, g0, None)
        t1 = make("n1", p1, peers, g1, SECRET)
        await t0.start()
        await t1.start()
        t1.send("n0", Heartbeat(3, "n1", 0))
        await until(lambda: t1.metrics["auth_failures"] >= 1, timeout=6.0)
        assert g0 == []
        await t0.stop()
        await t1.stop()
    asyncio.run(main())
