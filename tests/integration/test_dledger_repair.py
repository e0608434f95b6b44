"""A bit flipped in an old committed entry is found, refused and repaired from a peer.

Method: a live 3-node DLedger group of real processes on free loopback ports (small
256 KiB data files). Messages are sent, every replica commits them; then one bit is
flipped in the body of an old entry on one replica's disk with os.pwrite:
- follower: stopped (SIGTERM), flipped, restarted: recovery finds the flip (body CRC
  fails, header and chain intact), keeps the entry, marks it, fetches it from a peer
  and writes it back in place; its data file becomes byte-identical to the leader's;
- leader: flipped while it runs, then read: the pull fails with the retriable
  CORRUPT_RECORD (never the wrong bytes), the leader hands leadership over or repairs,
  and ends with the original bytes on disk.
In both, a consumer pulling the whole queue from every replica gets only intact bodies.

The entry travels over the Raft peer channel (FetchEntries / FetchEntriesResponse), never
the client API: in-process groups with a cluster secret show that the repair works there
and that a member with the wrong secret fetches nothing; a process group with
`clusterSecret` and `aclEnable=true` repairs a follower as above, and `/dledger/entries`
is no longer an API route.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import urllib.error
import urllib.request

import pytest

from dledger.core import RaftConfig
from dledger.entry import HEADER_SIZE
from dledger.dledger_log import DLedgerLog
from dledger.entry_store import EntryStore
from dledger.repair import RepairError
from dledger.shell import RaftNode, ShellConfig
from dledger.transport import TransportConfig
from mqstore import localcluster as lc
from node import tls
from node.acl import sign_headers
from node.peer_auth import PeerSecurity
from node.store.fileio import FileSystem
from node.store.message import MessageDraft
from node.store.scrub import CorruptData
from node.store import layout as L
from node.store import message as M
from tests.integration.dledger_group import DLedgerGroup
from tests.integration.test_node_process import http

SEG = 256 * 1024
E_HEADER = HEADER_SIZE
N = 300
EXTRA = f"mappedFileSizeCommitLog={SEG}\nstoreScrubIntervalMs=600000\nstoreScrubRateMb=16\n"


def body(i: int) -> str:
    return f"message-{i:05d}-" + "x" * 1000


def flip(path: str, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0x04]), offset)
    finally:
        os.close(fd)


def data_file(g: DLedgerGroup, node: str, base: int) -> str:
    return os.path.join(os.path.dirname(g.nodes[node].conf), "store", f"dledger-{node}", "data", f"{base:020d}")


def wait(pred, timeout_s: float, what: str, g: DLedgerGroup):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out: {what}\n{g.tails()}")


def health(g: DLedgerGroup, n: str) -> dict:
    try:
        return http(g.api[n], "GET", "/health", timeout=2)[1]
    except OSError:
        return {}


def send_all(g: DLedgerGroup, leader: str) -> list[int]:
    assert http(g.api[leader], "POST", "/topics", {"topic": "R", "queues": 1})[0] == 200
    phys = []
    for i in range(0, N, 50):
        st, doc = http(g.api[leader], "POST", "/topics/R/messages",
                       {"messages": [{"body": body(j), "queue_id": 0} for j in range(i, i + 50)]})
        assert st == 200 and all(r["status"] == "SEND_OK" for r in doc["results"]), doc
        phys += [M.decode_offset_msg_id(r["offset_msg_id"])[2] for r in doc["results"]]
    return phys


def pull_all(g: DLedgerGroup, n: str) -> list[str]:
    """Every body of queue R/0 as served by node n (all must be served, none may be wrong)."""
    out: list[str] = []
    offset = 0
    for _ in range(200):
        st, doc = http(g.api[n], "GET", f"/topics/R/queues/0/messages?offset={offset}&max=32")
        assert st == 200, (n, offset, st, doc)
        if doc["status"] == "NO_NEW_MSG":
            break
        out += [m["body"] for m in doc["messages"]]
        offset = doc["next_offset"]
    return out


def converged(g: DLedgerGroup, count: int) -> bool:
    for n in g.nodes:
        try:
            _, doc = http(g.api[n], "GET", "/topics/R", timeout=2)
        except OSError:
            return False
        if doc.get("queues", [{}])[0].get("max_offset") != count:
            return False
    return True


@pytest.fixture
def group(tmp_path):
    g = DLedgerGroup(tmp_path, extra=EXTRA).start()
    yield g
    g.close()


def test_follower_flip_is_found_at_recovery_and_repaired_in_place_from_a_peer(group):
    g = group
    leader = g.leader()
    phys = send_all(g, leader)
    wait(lambda: converged(g, N), 20, "all replicas dispatch every message", g)
    follower = next(n for n in g.nodes if n != leader)
    victim = 7
    assert phys[victim] < SEG and phys[-1] > SEG, "the victim lies in a sealed file"
    g.nodes[follower].stop()
    path = data_file(g, follower, 0)
    flip(path, phys[victim] + L.MESSAGE_HEADER.size + 20)    # inside the message body
    with open(path, "rb") as f:
        assert f.read() != open(data_file(g, leader, 0), "rb").read()
    g.nodes[follower].launch()
    g.nodes[follower].wait_healthy(30.0, statuses=(200, 503))
    wait(lambda: "repaired" in g.nodes[follower].tail(200_000), 30, "the repair log line", g)
    wait(lambda: health(g, follower).get("corrupt") == [], 30, "the corrupt mark cleared", g)
    log_text = g.nodes[follower].tail(200_000)
    assert "found by recovery" in log_text and "entry body crc mismatch" in log_text
    with open(path, "rb") as f, open(data_file(g, leader, 0), "rb") as lf:
        assert f.read() == lf.read(), "the repaired file is byte-identical to the leader's"
    _, metrics = 0, __import__("urllib.request").request.urlopen(
        f"http://127.0.0.1:{g.api[follower]}/metrics", timeout=5).read().decode()
    assert "rocketmq_store_corrupt_records_total 1.0" in metrics
    assert "rocketmq_store_corrupt_repaired_total 1.0" in metrics
    assert "rocketmq_store_repaired_entries_total 1.0" in metrics
    assert "rocketmq_store_repair_pending_entries 0.0" in metrics
    assert "rocketmq_store_repair_failures_total" in metrics
    wait(lambda: converged(g, N), 20, "all replicas dispatch every message", g)
    for n in g.nodes:
        assert pull_all(g, n) == [body(i) for i in range(N)], f"{n} served a wrong or missing body"


def test_corrupt_leader_refuses_the_range_then_repairs_it(group):
    g = group
    leader = g.leader()
    phys = send_all(g, leader)
    wait(lambda: converged(g, N), 20, "all replicas dispatch every message", g)
    victim = 11
    path = data_file(g, leader, 0)
    with open(path, "rb") as f:
        original = f.read()
    flip(path, phys[victim] + L.MESSAGE_HEADER.size + 5)
    st, doc = http(g.api[leader], "GET", f"/topics/R/queues/0/messages?offset={victim}&max=1")
    assert st == 503 and doc["error"] == "CORRUPT_RECORD" and doc["retriable"] is True, (st, doc)
    # The whole-queue pull from the damaged node is served up to the damage, never past it wrongly.
    st, doc = http(g.api[leader], "GET", "/topics/R/queues/0/messages?offset=0&max=32")
    if st == 200:
        bodies = [m["body"] for m in doc["messages"]]
        assert bodies == [body(i) for i in range(len(bodies))] and len(bodies) <= 32
    wait(lambda: health(g, leader).get("corrupt") == [], 30, "the leader repaired its range", g)
    with open(path, "rb") as f:
        assert f.read() == original, "the repaired leader file holds the original bytes"
    new_leader = g.leader()
    text = g.nodes[leader].tail(400_000)
    assert "found by read" in text and "repaired" in text
    assert new_leader != leader or "leadership handed" in text or "repaired" in text
    for n in g.nodes:
        assert pull_all(g, n) == [body(i) for i in range(N)], f"{n} served a wrong or missing body"


def test_running_follower_flip_nobody_reads_is_found_by_the_scrubber_and_repaired(tmp_path):
    g = DLedgerGroup(tmp_path, extra=EXTRA.replace("storeScrubIntervalMs=600000", "storeScrubIntervalMs=300")).start()
    try:
        leader = g.leader()
        phys = send_all(g, leader)
        wait(lambda: converged(g, N), 20, "all replicas dispatch every message", g)
        follower = next(n for n in g.nodes if n != leader)
        path = data_file(g, follower, 0)
        with open(data_file(g, leader, 0), "rb") as f:
            leader_bytes = f.read()
        flip(path, phys[3] + L.MESSAGE_HEADER.size + 50)
        wait(lambda: "found by scrub" in g.nodes[follower].tail(400_000), 30, "the scrubber finds the flip", g)
        wait(lambda: health(g, follower).get("corrupt") == [], 30, "the corrupt mark cleared", g)
        with open(path, "rb") as f:
            assert f.read() == leader_bytes
        for n in g.nodes:
            assert pull_all(g, n) == [body(i) for i in range(N)], f"{n} served a wrong or missing body"
    finally:
        g.close()


# --- in process: the Raft peer channel with a cluster secret -------------------------------------------
RIGHT = b"repair-test-cluster-secret-0123456789"
WRONG = b"not-the-cluster-secret-0123456789abc"
IDS = ("n0", "n1", "n2")


def inprocess_group(root, secrets: dict[str, bytes], tls_files: dict | None = None) -> dict[str, DLedgerLog]:
    ports = lc.free_ports(len(IDS))
    peers = {n: ("127.0.0.1", p) for n, p in zip(IDS, ports)}
    apis = {n: f"127.0.0.1:{20000 + k}" for k, n in enumerate(IDS)}
    logs = {}
    for k, n in enumerate(IDS):
        store = EntryStore(FileSystem(), str(root), n, data_segment_size=64 * 1024, index_segment_size=32 * 256)
        ssl_ctx = (None, None)
        if tls_files is not None:
            ssl_ctx = (tls.server_context(tls_files["node"], tls_files["node"], tls_files["ca"]),
                       tls.client_context(tls_files["ca"], tls_files["node"], tls_files["node"]))
        node = RaftNode(n, "g", peers, store, RaftConfig(), ShellConfig(tick_ms=20),
                        TransportConfig(security=PeerSecurity(secrets[n], *ssl_ctx)), rng=random.Random(k))
        logs[n] = DLedgerLog(node, apis, store_port=10911, append_timeout_s=5)
    return logs


async def until(pred, timeout_s: float, what: str):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, f"timed out: {what}"
        await asyncio.sleep(0.02)


async def writable(logs: dict[str, DLedgerLog], among) -> DLedgerLog:
    await until(lambda: any(logs[n].is_writable for n in among), 10, "a leader")
    return next(logs[n] for n in among if logs[n].is_writable)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    import trustme
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(str(d / "node.pem"))
    return {"ca": str(d / "ca.pem"), "node": str(d / "node.pem")}


@pytest.mark.parametrize("with_tls", [False, True], ids=["secret", "secret+tls"])
def test_repair_over_the_raft_channel_with_a_cluster_secret(tmp_path, pki, with_tls):
    async def go():
        logs = inprocess_group(tmp_path, {n: RIGHT for n in IDS}, pki if with_tls else None)
        for lg in logs.values():
            await lg.start()
        try:
            leader = await writable(logs, IDS)
            for b in range(5):
                res = await leader.append([MessageDraft("T", 0, f"m{b}-{k}".encode() * 40, {}).seal()
                                           for k in range(10)])
                assert all(r.status.name == "SEND_OK" for r in res)
            last = leader.commit_index
            await until(lambda: all(lg.commit_index >= last for lg in logs.values()), 10, "all commit")
            follower = next(lg for lg in logs.values() if lg is not leader)
            rec = follower.store.entry_at(7)
            original = leader.store.data.read(rec.pos, rec.size)
            seg = follower.store.data.segment_for(rec.pos)
            fd = os.open(seg.path, os.O_RDWR)
            try:
                at = rec.pos - seg.base + rec.size - 10
                os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x10]), at)
            finally:
                os.close(fd)
            with pytest.raises(CorruptData):
                follower.read(rec.pos + E_HEADER, rec.size - E_HEADER)
            await until(lambda: not follower.corruption, 10, "the follower repaired the entry")
            assert follower.store.data.read(rec.pos, rec.size) == original
            assert follower.read(rec.pos + E_HEADER, rec.size - E_HEADER) == original[E_HEADER:]
            served = sum(lg.repairer.metrics["serve_entries_answers"] for lg in logs.values() if lg is not follower)
            assert served >= 1 and follower.repairer.repaired == 1
            assert all(lg.node.transport.metrics["auth_failures"] == 0 for lg in logs.values())
            assert all((lg.node.transport._security.server_ssl is not None) == with_tls for lg in logs.values())
        finally:
            for lg in logs.values():
                await lg.stop()
    asyncio.run(go())


def test_a_member_with_the_wrong_secret_cannot_fetch_entries(tmp_path):
    async def go():
        logs = inprocess_group(tmp_path, {"n0": RIGHT, "n1": RIGHT, "n2": WRONG})
        for lg in logs.values():
            lg.repairer.fetch_timeout_s = 1.0
            await lg.start()
        try:
            leader = await writable(logs, ("n0", "n1"))
            other = logs["n1" if leader is logs["n0"] else "n0"]
            res = await leader.append([MessageDraft("T", 0, b"secret data" * 20, {}).seal()])
            assert res[0].status.name == "SEND_OK"
            await until(lambda: other.commit_index >= leader.commit_index, 10, "the right-secret follower commits")
            # Control: a member with the right secret gets the entry.
            raw = await other.repairer.fetch(leader.node.node_id, 1)
            assert raw == leader.store.data.read(leader.store.entry_at(1).pos, leader.store.entry_at(1).size)
            served_before = leader.repairer.metrics["serve_entries_answers"]
            stranger = logs["n2"]
            for target in ("n0", "n1"):
                with pytest.raises(RepairError, match="no answer"):
                    await stranger.repairer.fetch(target, 1)
            assert leader.repairer.metrics["serve_entries_answers"] == served_before
            assert other.repairer.metrics["serve_entries_answers"] == 0
            assert leader.node.transport.metrics["auth_failures"] >= 1
            assert stranger.store.last_index() == 0, "nothing replicated to it either"
        finally:
            for lg in logs.values():
                await lg.stop()
    asyncio.run(go())


# --- processes: clusterSecret + aclEnable=true ---------------------------------------------------------
ACL = {"accounts": [{"accessKey": "admin-key", "secretKey": "admin-secret", "admin": True}]}


def signed(port: int, method: str, path: str, doc=None):
    data = json.dumps(doc).encode() if doc is not None else b""
    headers = {"Content-Type": "application/json"}
    headers.update(sign_headers("admin-key", "admin-secret", method, path, None, data, int(time.time() * 1000)))
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data or None, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = e.read()
        return e.code, (json.loads(body) if body.startswith(b"{") else body)


def test_follower_repair_with_cluster_secret_and_acl(tmp_path):
    acl = tmp_path / "acl.json"
    acl.write_text(json.dumps(ACL))
    extra = EXTRA + f"clusterSecret={RIGHT.decode()}\naclEnable=true\naclFile={acl}\n"
    g = DLedgerGroup(tmp_path, extra=extra).start()
    try:
        leader = g.leader()
        assert signed(g.api[leader], "POST", "/topics", {"topic": "R", "queues": 1})[0] == 200
        assert http(g.api[leader], "POST", "/topics", {"topic": "S", "queues": 1})[0] == 401, "ACL is on"
        phys = []
        for i in range(0, N, 50):
            st, doc = signed(g.api[leader], "POST", "/topics/R/messages",
                             {"messages": [{"body": body(j), "queue_id": 0} for j in range(i, i + 50)]})
            assert st == 200, doc
            phys += [M.decode_offset_msg_id(r["offset_msg_id"])[2] for r in doc["results"]]
        dispatched = lambda n: (signed(g.api[n], "GET", "/topics/R")[1].get("queues", [{}])[0]  # noqa: E731
                                .get("max_offset") == N)
        wait(lambda: all(dispatched(n) for n in g.nodes), 20, "all replicas dispatch every message", g)
        for n in g.nodes:   # the raw-entry route is gone from the client API
            assert signed(g.api[n], "GET", "/dledger/entries?index=1&count=1")[0] == 404
        follower = next(n for n in g.nodes if n != leader)
        g.nodes[follower].stop()
        path = data_file(g, follower, 0)
        flip(path, phys[9] + L.MESSAGE_HEADER.size + 20)
        g.nodes[follower].launch()
        g.nodes[follower].wait_healthy(30.0, statuses=(200, 503))
        wait(lambda: "repaired" in g.nodes[follower].tail(200_000), 30, "the repair log line", g)
        wait(lambda: health(g, follower).get("corrupt") == [], 30, "the corrupt mark cleared", g)
        with open(path, "rb") as f, open(data_file(g, leader, 0), "rb") as lf:
            assert f.read() == lf.read(), "the repaired file is byte-identical to the leader's"
        text = g.nodes[follower].tail(400_000)
        assert "found by recovery" in text and "failed: HTTP" not in text
        st, doc = signed(g.api[follower], "GET", "/topics/R/queues/0/messages?offset=9&max=1")
        assert st == 200 and [m["body"] for m in doc["messages"]] == [body(9)], doc
    finally:
        g.close()
