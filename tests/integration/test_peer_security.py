"""Peer authentication and TLS end to end: real node and controller processes on loopback,
and classic HA in process.

Goal: a node without the cluster secret is refused and no frame from it reaches the Raft
core (its vote changes no term); nodes with the secret elect and replicate; classic
master/slave replicate with the secret (and over mutual TLS) and refuse a wrong one; with
trustme certificates a TLS group works, a client without the CA fails, and a peer holding a
certificate from another CA is refused; the controller refuses unsigned requests and a
broker with the secret registers through it; no remote call changes the config.
Method: `python -m node` / `python -m ha` processes on free ports in tmp dirs, stdlib
HTTPS with an SSLContext, raw sockets playing the stranger; every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import time
import urllib.error
import urllib.request

import msgpack
import pytest
import trustme

from dledger import codec
from dledger.messages import RequestVote
from dledger.transport import HANDSHAKE_MAGIC, PROTOCOL_VERSION, frame
from ha.ha_log import MASTER, SLAVE, HALog, HALogConfig
from ha.replication import HATimings
from mqstore import localcluster as lc
from mqstore.client.stream import StreamConnection
from node import peer_auth, tls
from node.local_log import ASYNC_FLUSH, LocalLogConfig
from node.peer_auth import PeerSecurity
from node.replicated_log import PutStatus
from node.store.fileio import FileSystem
from node.store.message import MessageDraft

SECRET = "cluster-secret-for-tests-0123456789"
WRONG = "some-other-secret-0123456789abcdef"
GROUP = "broker-a"


# --- helpers -------------------------------------------------------------------------------------------
def https(port: int, method: str, path: str, doc=None, ctx: ssl.SSLContext | None = None, timeout: float = 3.0):
    scheme = "https" if ctx is not None else "http"
    data = json.dumps(doc).encode() if doc is not None else None
    req = urllib.request.Request(f"{scheme}://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
            raw = r.read()
            return r.status, json.loads(raw) if r.headers.get_content_type() == "application/json" else raw
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw


def wait(pred, timeout: float = 30.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            v = pred()
        except (OSError, ValueError):
            v = None
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out: {what}")


def health(port: int, ctx=None) -> dict | None:
    try:
        status, doc = https(port, "GET", "/health", ctx=ctx, timeout=1.0)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


class Group:
    """A 3-node DLedger group as processes; `extra[node_id]` adds broker.conf lines per node."""

    def __init__(self, root: str, extra: dict[str, list[str]]):
        ids = ["n0", "n1", "n2"]
        ports = lc.free_ports(9)
        self.api = dict(zip(ids, ports[:3]))
        self.raft = dict(zip(ids, ports[3:6]))
        self.stream = dict(zip(ids, ports[6:]))
        self.procs: dict[str, lc.NodeProc] = {}
        for n in ids:
            lines = lc.node_lines(self.api[n], os.path.join(root, n, "store"),
                                  [*lc.SMALL_GEOMETRY, "maxMessageSize=65536", f"streamListenPort={self.stream[n]}",
                                   *extra.get(n, [])])
            lines += lc.dledger_lines(n, GROUP, self.raft, self.api)
            conf = lc.write_conf(os.path.join(root, n, "broker.conf"), lines)
            self.procs[n] = lc.NodeProc(conf, self.api[n], os.path.join(root, n, "node.log"), n)

    def start(self) -> "Group":
        for p in self.procs.values():
            p.launch()
        return self

    def stop(self) -> None:
        for p in self.procs.values():
            p.stop()

    def leader(self, ids, ctx=None, timeout=30.0) -> str:
        return wait(lambda: next((n for n in ids if (health(self.api[n], ctx) or {}).get("role") == "LEADER"), None),
                    timeout, "a leader")


def write_secret(tmp_path, name: str, value: str) -> str:
    p = tmp_path / name
    p.write_text(value + "\n")
    os.chmod(p, 0o600)
    return str(p)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The cluster CA with one node certificate (127.0.0.1, localhost) and an unrelated CA's cert."""
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(str(d / "node.pem"))
    other.cert_pem.write_to_path(str(d / "other-ca.pem"))
    other.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(str(d / "other.pem"))
    return {k: str(d / f"{k}.pem") for k in ("ca", "node", "other-ca", "other")}


def tls_lines(pki) -> list[str]:
    return ["tlsEnable=true", f"tlsCertFile={pki['node']}", f"tlsKeyFile={pki['node']}", f"tlsCaFile={pki['ca']}"]


def raw_vote_bytes(term: int) -> bytes:
    return (frame(msgpack.packb([HANDSHAKE_MAGIC, PROTOCOL_VERSION, GROUP, "n1"]))
            + frame(codec.encode(RequestVote(term=term, candidate_id="n1", last_index=10**6, last_term=term - 1,
                                             pre_vote=False))))


# --- DLedger: secret, wrong secret, raw frames ----------------------------------------------------------
def test_dledger_group_with_secret_refuses_a_node_with_the_wrong_one(tmp_path):
    right = write_secret(tmp_path, "secret", SECRET)
    g = Group(str(tmp_path), {"n0": [f"clusterSecretFile={right}"], "n1": [f"clusterSecretFile={right}"],
                              "n2": [f"clusterSecret={WRONG}"]})
    try:
        g.start()
        leader = g.leader(["n0", "n1"])
        port = g.api[leader]
        assert https(port, "POST", "/topics", {"topic": "T", "queues": 1})[0] == 200
        status, doc = https(port, "POST", "/topics/T/messages", {"messages": [{"body": f"m{i}"} for i in range(20)]})
        assert status == 200, doc
        follower = "n1" if leader == "n0" else "n0"
        target = health(port)["committed_offset"]
        # /health may time out (1 s) on a loaded machine: None means "ask again", not a failure.
        wait(lambda: (health(g.api[follower]) or {}).get("committed_offset", -1) >= target, 15,
             "follower replicates")
        time.sleep(1.0)
        h2 = health(g.api["n2"])
        assert h2["committed_offset"] == 0 and h2.get("role") != "LEADER"

        # A raw connection that skips the handshake and sends a valid hello and vote changes no term.
        term_before = health(port)["term"]
        with socket.create_connection(("127.0.0.1", g.raft[leader]), timeout=3) as s:
            s.sendall(raw_vote_bytes(term_before + 1000))
            got = b""
            while chunk := s.recv(4096):
                got += chunk
        assert got[2:7] == b"MQPA1"           # the challenge, then the listener closed
        time.sleep(0.5)
        assert health(port)["term"] == term_before and health(port)["role"] == "LEADER"

        _, metrics = https(port, "GET", "/metrics")
        line = next(ln for ln in metrics.decode().splitlines()
                    if ln.startswith('rocketmq_peer_auth_failures_total{listener="raft"}'))
        assert float(line.split()[-1]) >= 2   # n2's attempts and the raw socket
    finally:
        g.stop()


# --- DLedger over mutual TLS ------------------------------------------------------------------------------
def test_tls_group_works_and_strangers_are_refused(tmp_path, pki):
    g = Group(str(tmp_path), {n: [*tls_lines(pki), f"clusterSecret={SECRET}"] for n in ("n0", "n1", "n2")})
    ctx = tls.client_context(pki["ca"])
    try:
        g.start()
        leader = g.leader(["n0", "n1", "n2"], ctx)
        port = g.api[leader]
        assert https(port, "POST", "/topics", {"topic": "T", "queues": 1}, ctx)[0] == 200
        status, doc = https(port, "POST", "/topics/T/messages", {"messages": [{"body": "over tls"}]}, ctx)
        assert status == 200, doc
        target = health(port, ctx)["committed_offset"]
        for n in g.api:
            wait(lambda n=n: (health(g.api[n], ctx) or {}).get("committed_offset", -1) >= target, 15,
                 f"{n} replicates")

        # A client without the CA cannot talk to the API (nor can plain http).
        with pytest.raises(urllib.error.URLError) as e:
            https(port, "GET", "/health", ctx=ssl.create_default_context())
        assert isinstance(e.value.reason, ssl.SSLCertVerificationError)
        with pytest.raises((OSError, ValueError)):
            https(port, "GET", "/health")

        # A peer with a certificate from the cluster CA gets the challenge; one from another CA gets nothing.
        def first_bytes(cert: str, ca: str) -> bytes:
            c = tls.client_context(ca, cert, cert)
            with socket.create_connection(("127.0.0.1", g.raft[leader]), timeout=3) as raw:
                with c.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                    try:
                        s.sendall(raw_vote_bytes(10**6))
                        return s.recv(64)
                    except (ssl.SSLError, ConnectionError):
                        return b""
        assert first_bytes(pki["node"], pki["ca"])[2:7] == b"MQPA1"
        assert first_bytes(pki["other"], pki["ca"]) == b""
        with pytest.raises(ssl.SSLCertVerificationError):   # nor do we trust a listener of another CA
            first_bytes(pki["node"], pki["other-ca"])
        assert health(port, ctx)["term"] < 10**6

        # The admin CLI and the SDK speak https with the CA file (--tls-ca / MQSTORE_TLS_CA).
        import contextlib
        import io
        from mqstore import cli
        out = io.StringIO()
        assert cli.main(["topicList", "-n", f"127.0.0.1:{port}", "--tls-ca", pki["ca"]], out=out) == 0
        assert "T" in out.getvalue()
        with contextlib.redirect_stderr(io.StringIO()):
            assert cli.main(["topicList", "-n", f"127.0.0.1:{port}"], out=io.StringIO()) == 1
        cli.set_tls_ca(None)

        from mqstore.client.transport import BrokerGroup, Transport

        async def sdk(ca):
            t = Transport(3.0, tls_ca=ca)
            await t.start()
            try:
                return await t.call(BrokerGroup(GROUP, [f"127.0.0.1:{port}"]), "GET", "/topics")
            finally:
                await t.close()
        assert "T" in json.dumps(asyncio.run(sdk(pki["ca"])))
        from mqstore.client.errors import MQConnectError
        with pytest.raises(MQConnectError):
            asyncio.run(sdk(pki["other-ca"]))

        # Sends go on the produce stream, in TLS with the same CA; a client of another CA is refused.
        async def stream_send(ca):
            t = Transport(3.0, tls_ca=ca)
            await t.start()
            try:
                doc = await t.call(BrokerGroup(GROUP, [f"127.0.0.1:{port}"]), "POST", "/topics/T/messages",
                                   {"messages": [{"body": b"over the tls stream"}]}, stream_topic="T")
                return doc, len(t._streams)
            finally:
                await t.close()
        doc, streams = asyncio.run(stream_send(pki["ca"]))
        assert doc["results"][0]["status"] == "SEND_OK" and streams == 1
        with pytest.raises(ssl.SSLCertVerificationError):
            asyncio.run(StreamConnection.open("127.0.0.1", g.stream[leader], ssl_context=tls.client_context(pki["other-ca"])))
        with pytest.raises((OSError, asyncio.TimeoutError)):    # plain TCP on the TLS stream port
            asyncio.run(StreamConnection.open("127.0.0.1", g.stream[leader], timeout_s=2.0))

        # No remote call changes the config: there is no write route, and the secret is never shown.
        assert https(port, "POST", "/config", {"storePathRootDir": "/tmp/evil"}, ctx)[0] in (404, 405)
        assert https(port, "PUT", "/config", {"storePathRootDir": "/tmp/evil"}, ctx)[0] in (404, 405)
        status, doc = https(port, "GET", "/config", ctx=ctx)
        assert status == 200 and doc["config"]["clusterSecret"] == "<redacted>" and SECRET not in json.dumps(doc)
        assert doc["config"]["storePathRootDir"] != "/tmp/evil"
    finally:
        g.stop()


def test_no_api_route_writes_config():
    """The node's routes: none of them accepts a write to /config (RocketMQ's updateBrokerConfig
    let a remote caller set paths and commands, CVE-2023-33246)."""
    from node.api import ROUTES
    writes = [(m, p) for m, p, _ in ROUTES if m not in ("GET", "HEAD") and "config" in p.lower()]
    assert writes == []


# --- controller ------------------------------------------------------------------------------------------
def test_controller_refuses_unsigned_requests_and_a_broker_with_the_secret_registers(tmp_path, pki):
    api, raft, node_api, ha = lc.free_ports(4)
    secret_file = write_secret(tmp_path, "secret", SECRET)
    argv = lc.controller_argv(api, raft, str(tmp_path / "ctl")) + [
        "--cluster-secret-file", secret_file, "--tls-cert", pki["node"], "--tls-key", pki["node"]]
    ctl = lc.Proc(argv, str(tmp_path / "ctl.log"), "controller").start()
    ctx = tls.client_context(pki["ca"])
    node = None
    try:
        wait(lambda: health(api, ctx), 20, "controller /health (open, over TLS)")
        status, doc = https(api, "GET", "/groups", ctx=ctx)
        assert status == 401 and doc["error"] == "UNAUTHENTICATED"
        status, doc = https(api, "POST", "/topics", {"topic": "X", "queues": 1}, ctx)
        assert status == 401
        # A correctly signed request passes.
        hdrs = peer_auth.sign_request(SECRET.encode(), "ops", "GET", "/groups")
        req = urllib.request.Request(f"https://127.0.0.1:{api}/groups", headers=hdrs)
        with urllib.request.urlopen(req, timeout=3, context=ctx) as r:
            assert r.status == 200
        # ... once: the same headers again are a replay.
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=3, context=ctx)
        assert e.value.code == 401

        # Route lookups stay open (clients hold no cluster secret): an unknown topic is a 404, not a 401.
        assert https(api, "GET", "/routes/NoSuchTopic", ctx=ctx)[0] == 404
        # The admin CLI signs with MQSTORE_CLUSTER_SECRET_FILE.
        from mqstore import cli
        os.environ["MQSTORE_CLUSTER_SECRET_FILE"] = secret_file
        try:
            cli.set_tls_ca(pki["ca"])
            assert "groups" in cli.call(f"127.0.0.1:{api}", "GET", "/groups")
        finally:
            del os.environ["MQSTORE_CLUSTER_SECRET_FILE"]
            cli.set_tls_ca(None)
        with pytest.raises(cli.CliError, match="UNAUTHENTICATED.*set MQSTORE_CLUSTER_SECRET_FILE"):
            cli.set_tls_ca(pki["ca"])
            try:
                cli.call(f"127.0.0.1:{api}", "GET", "/groups")
            finally:
                cli.set_tls_ca(None)

        # A broker with the secret and TLS heartbeats the controller and is made master.
        lines = lc.node_lines(node_api, str(tmp_path / "b0"), [*lc.SMALL_GEOMETRY, "maxMessageSize=65536",
                                                               *tls_lines(pki), f"clusterSecretFile={secret_file}"])
        lines += lc.classic_lines(0, "SYNC_MASTER", ha, controller=f"127.0.0.1:{api}")
        conf = lc.write_conf(str(tmp_path / "b0.conf"), lines)
        node = lc.NodeProc(conf, node_api, str(tmp_path / "b0.log"), "b0").launch()
        wait(lambda: (health(node_api, ctx) or {}).get("role") == "MASTER", 30, "broker elected master")
        _, metrics = https(api, "GET", "/metrics", ctx=ctx)
        line = next(ln for ln in metrics.decode().splitlines()
                    if ln.startswith('rocketmq_peer_auth_failures_total{listener="controller"}'))
        assert float(line.split()[-1]) >= 3
    finally:
        if node is not None:
            node.stop()
        ctl.stop()


def test_controller_refuses_to_start_with_a_short_secret(tmp_path):
    api, raft = lc.free_ports(2)
    bad = write_secret(tmp_path, "short", "abc")
    p = lc.Proc(lc.controller_argv(api, raft, str(tmp_path / "ctl")) + ["--cluster-secret-file", bad],
                str(tmp_path / "ctl.log"), "controller").start()
    try:
        wait(lambda: p.returncode is not None, 20, "controller exits")
        assert p.returncode == 2 and "at least 16 bytes" in p.tail()
    finally:
        p.stop()


# --- classic HA in process --------------------------------------------------------------------------------
SEG = 64 * 1024
FAST = HATimings(heartbeat_interval_ms=200, housekeeping_ms=2000, slave_ack_timeout_ms=1500)


def _msg(i: int) -> MessageDraft:
    return MessageDraft("T", 0, b"%06d" % i + b"x" * 94, {"TAGS": "a"}).seal()


def _logs(root, master_sec: PeerSecurity, slave_sec: PeerSecurity) -> tuple[HALog, callable]:
    lcfg = LocalLogConfig(segment_size_bytes=SEG, flush_disk_type=ASYNC_FLUSH, refuse_check_interval_ms=0)
    master = HALog(FileSystem(), str(root / "m"), lcfg, HALogConfig(
        broker_id=0, initial_role=MASTER, sync_master=False, ha_listen_host="127.0.0.1", ha_listen_port=0,
        self_api_address="127.0.0.1:1", timings=FAST, security=master_sec))

    def slave() -> HALog:
        return HALog(FileSystem(), str(root / "s"), lcfg, HALogConfig(
            broker_id=1, initial_role=SLAVE, sync_master=True, ha_master_address=f"127.0.0.1:{master.ha_port}",
            master_api_address="127.0.0.1:1", ha_listen_host="127.0.0.1", ha_listen_port=0, timings=FAST,
            security=slave_sec))
    return master, slave


async def _until(pred, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        if pred():
            return True
        await asyncio.sleep(0.02)
    return False


@pytest.mark.parametrize("use_tls", [False, True])
def test_classic_master_slave_replicate_with_the_secret(tmp_path, pki, use_tls):
    srv = tls.server_context(pki["node"], pki["node"], pki["ca"]) if use_tls else None
    cli = tls.client_context(pki["ca"], pki["node"], pki["node"]) if use_tls else None
    sec = PeerSecurity(SECRET.encode(), srv, cli)

    async def main():
        master, make_slave = _logs(tmp_path, sec, sec)
        await master.start()
        res = await master.append([_msg(i) for i in range(20)])
        assert all(r.status is PutStatus.SEND_OK for r in res)
        slave = make_slave()
        await slave.start()
        try:
            assert await _until(lambda: slave.committed_position == master.committed_position > 0)
        finally:
            await slave.stop()
            await master.stop()
    asyncio.run(main())


def test_classic_slave_with_the_wrong_secret_gets_nothing(tmp_path):
    async def main():
        master, make_slave = _logs(tmp_path, PeerSecurity(SECRET.encode()), PeerSecurity(WRONG.encode()))
        await master.start()
        await master.append([_msg(i) for i in range(5)])
        slave = make_slave()
        await slave.start()
        try:
            assert await _until(lambda: master.service.auth_failures >= 1)
            await asyncio.sleep(0.5)
            assert slave.commitlog.max_offset == 0 and not slave.client.connected
            assert "PeerAuthError" in slave.client.last_error
        finally:
            await slave.stop()
            await master.stop()
    asyncio.run(main())


def test_classic_slave_from_another_ca_is_refused(tmp_path, pki):
    srv = tls.server_context(pki["node"], pki["node"], pki["ca"])
    stranger = tls.client_context(pki["ca"], pki["other"], pki["other"])

    async def main():
        master, make_slave = _logs(tmp_path, PeerSecurity(None, srv, None), PeerSecurity(None, None, stranger))
        await master.start()
        await master.append([_msg(0)])
        slave = make_slave()
        await slave.start()
        try:
            await asyncio.sleep(1.5)
            assert slave.commitlog.max_offset == 0 and slave.client.sessions == 0
        finally:
            await slave.stop()
            await master.stop()
    asyncio.run(main())


# --- controller-to-controller (pysyncobj password) ---------------------------------------------------------
def test_controllers_need_the_same_password_to_form_a_group(tmp_path):
    """Two controllers (quorum 2 of 2): with the same password they elect a leader; with
    different passwords neither can hear the other, so no leader is ever elected."""
    from ha.controller import ControllerStateMachine

    def start(passwords: list[str], sub: str) -> list[ControllerStateMachine]:
        addrs = [f"127.0.0.1:{p}" for p in lc.free_ports(2)]
        return [ControllerStateMachine(a, [b for b in addrs if b != a], str(tmp_path / sub / str(i)), password=pw)
                for i, (a, pw) in enumerate(zip(addrs, passwords))]

    def any_leader(sms) -> bool:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            if any(s.is_leader() and s.isReady() for s in sms):
                return True
            time.sleep(0.1)
        return False

    good = start([SECRET, SECRET], "same")
    try:
        assert any_leader(good)
    finally:
        for s in good:
            s.destroy()
    bad = start([SECRET, WRONG], "different")
    try:
        assert not any_leader(bad)
    finally:
        for s in bad:
            s.destroy()
