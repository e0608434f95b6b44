"""A node restarts on a disk full to the last block, and serves what it holds; a classic slave
whose disk fills pauses replication and catches up once space returns.

Goal: a standalone node and a (one-node) DLedger node, stopped, their disk then filled to 100 %
by another file, start again: the first write of a start (the abort marker; DLedger's meta)
takes the room of the store's reserve (`diskReserveBytes`), the node comes up and serves
every message it held, and says that it gave the reserve up.
Before, such a node did not start ("cannot start: [Errno 28] No space left on device"), so its
own retention, which frees the disk, never ran.
A classic slave whose disk fills while the master writes stays up (it used to mark its log
fatal, "the node must exit"): the refused pushes are cut away, replication pauses, and once
the disk has room again the slave catches up to a byte-identical log.
Method: real node processes (`python -m node`) whose store is a 64 MiB tmpfs mounted for the
test (tests/integration/small_disk.py), filled with zeros. Needs root for the mount: without it
the test FAILS with the reason (it is not skipped).
"""

from __future__ import annotations

import os

import pytest

from mqstore import localcluster as lc
from mqstore.localcluster import free_ports, http
from tests.integration.small_disk import SmallDisk, require

pytestmark = pytest.mark.slow
TMPFS_MB = 64


@pytest.fixture
def small_disk(tmp_path):
    require()
    disk = SmallDisk(str(tmp_path / "disk"), TMPFS_MB).mount()
    try:
        yield disk
    finally:
        disk.unmount()


def _fill(disk: SmallDisk) -> None:
    """Zeros until the file system refuses the last page (SmallDisk.fill), checked with statvfs."""
    disk.fill()
    st = os.statvfs(disk.path)
    assert st.f_bavail == 0, f"{st.f_bavail} blocks still free"


@pytest.mark.parametrize("mode", ["standalone", "dledger"])
def test_a_node_restarts_on_a_full_disk_and_serves_what_it_held(small_disk, tmp_path, mode):
    api, raft = free_ports(2)
    extra = ["mappedFileSizeCommitLog=4194304", "maxMessageSize=65536", "maxHashSlotNum=1000",
             "maxIndexNum=4000", "autoCreateTopicEnable=true"]
    if mode == "dledger":
        extra += lc.dledger_lines("n0", "g", {"n0": raft}, {"n0": api})
    conf = lc.write_conf(str(tmp_path / "broker.conf"),
                         lc.node_lines(api, os.path.join(small_disk.path, "store"), extra))
    node = lc.NodeProc(conf, api, str(tmp_path / "node1.log")).start()
    try:
        lc.wait_for(lambda: http(api, "GET", "/health")[1].get("role") in ("LEADER", "STANDALONE"),
                    what="node serving")
        st, _ = http(api, "POST", "/topics", {"topic": "T", "queues": 1})
        assert st in (200, 201)
        for i in range(3):
            st, r = http(api, "POST", "/topics/T/messages", {"messages": [{"body": f"m{i}", "queue_id": 0}]})
            assert st == 200 and r["results"][0]["status"] == "SEND_OK", r
    finally:
        node.stop()
    _fill(small_disk)

    node = lc.NodeProc(conf, api, str(tmp_path / "node2.log")).start()
    try:
        # DLedger: elected again, which takes storing a term and vote in the reserve's room.
        lc.wait_for(lambda: http(api, "GET", "/health")[1].get("role") in ("LEADER", "STANDALONE"),
                    what="node serving again")
        st, r = http(api, "GET", "/topics/T/queues/0/messages?offset=0&max=8")
        assert st == 200 and [m["body"] for m in r["messages"]] == ["m0", "m1", "m2"], (st, r)
        log2 = open(tmp_path / "node2.log").read()
        assert "-byte reserve" in log2 and "is given up for it" in log2
    finally:
        node.stop()


def test_a_classic_slave_whose_disk_fills_pauses_and_catches_up(tmp_path):
    from tests.integration.test_ha_processes import TOPIC, Group, _bring_up, _commitlog_bytes
    g = Group(str(tmp_path), "ASYNC_MASTER")
    store1 = os.path.join(g.tmp, "store1")
    require()
    disk = SmallDisk(store1, TMPFS_MB).mount()       # the slave's store: a small disk
    try:
        g.extra_lines = {0: ["mappedFileSizeCommitLog=4194304"], 1: ["mappedFileSizeCommitLog=4194304"]}
        _bring_up(g)
        assert g.send(0, 0) == "SEND_OK"
        lc.wait_for(lambda: g.health(1)["committed_offset"] == g.health(0)["committed_offset"], what="slave in step")
        _fill(disk)
        pid1 = g.procs["b1"].pid
        body = "z" * 60_000
        for i in range(40):                          # 2.4 MB the slave has no room for
            st, r = http(g.api[0], "POST", f"/topics/{TOPIC}/messages",
                         {"messages": [{"body": f"m{1 + i:06d}{body}", "queue_id": 0}]})
            assert st == 200 and r["results"][0]["status"] == "SEND_OK", r
        lc.wait_for(lambda: "slave disk full" in open(os.path.join(g.tmp, "b1.log")).read(), timeout=15,
                    what="the slave refuses the pushes it has no room for")
        assert g.procs["b1"].proc.poll() is None and g.health(1).get("status") == "UP", "the slave stays up"
        assert g.health(1)["committed_offset"] < g.health(0)["committed_offset"]
        disk.free()                                  # space returns
        end = g.health(0)["committed_offset"]
        lc.wait_for(lambda: g.health(1)["committed_offset"] == end, timeout=30, what="slave caught up")
        assert g.procs["b1"].pid == pid1
        assert _commitlog_bytes(os.path.join(g.tmp, "store0"), end) == _commitlog_bytes(store1, end)
        assert "the node must exit" not in open(os.path.join(g.tmp, "b1.log")).read()
    finally:
        g.stop_all()
        disk.unmount()


def test_a_standalone_start_whose_dispatch_catch_up_meets_a_full_disk_holds_writes_until_it_caught_up(
        small_disk, tmp_path):
    """Regression: a standalone or classic node restarted on a full disk whose consume queues
    must be caught up with the log (here: checkpoint, consume queues and index removed) met
    ENOSPC writing a consume-queue unit and did not start. Its queue offsets come from the
    consume queues, so it now starts, serves, and refuses writes (507, retriable, saying why)
    until the dispatcher has caught up; then a write takes the next queue offset, not 0."""
    import shutil
    api, = free_ports(1)
    store = os.path.join(small_disk.path, "store")
    extra = ["mappedFileSizeCommitLog=4194304", "maxMessageSize=65536", "maxHashSlotNum=1000",
             "maxIndexNum=4000", "autoCreateTopicEnable=true", "diskReserveBytes=4096"]   # room for the abort marker only
    conf = lc.write_conf(str(tmp_path / "broker.conf"), lc.node_lines(api, store, extra))
    node = lc.NodeProc(conf, api, str(tmp_path / "node1.log")).start()
    try:
        lc.wait_for(lambda: http(api, "GET", "/health")[1].get("role") == "STANDALONE", what="node serving")
        st, _ = http(api, "POST", "/topics", {"topic": "T", "queues": 1})
        assert st in (200, 201)
        for i in range(3):
            st, r = http(api, "POST", "/topics/T/messages",
                         {"messages": [{"body": f"m{i}", "queue_id": 0, "keys": f"k{i}"}]})
            assert st == 200 and r["results"][0]["queue_offset"] == i, r
    finally:
        node.stop()
    os.remove(os.path.join(store, "checkpoint"))
    shutil.rmtree(os.path.join(store, "consumequeue"))
    shutil.rmtree(os.path.join(store, "index"))
    _fill(small_disk)

    node = lc.NodeProc(conf, api, str(tmp_path / "node2.log")).start()
    try:
        lc.wait_for(lambda: http(api, "GET", "/health")[1].get("status") == "UP", what="node up on the full disk")
        st, r = http(api, "POST", "/topics/T/messages", {"messages": [{"body": "m3", "queue_id": 0}]})
        assert st == 507 and r["error"] == "SERVICE_NOT_AVAILABLE" and r["retriable"], (st, r)
        assert "behind the log" in r["message"], r
        log2 = open(tmp_path / "node2.log").read()
        assert "writes are refused until then" in log2, log2[-2000:]
        small_disk.free()
        lc.wait_for(lambda: http(api, "POST", "/topics/T/messages",
                                 {"messages": [{"body": "m3", "queue_id": 0}]})[0] == 200,
                    timeout=20, what="writes accepted once the dispatcher caught up")
        st, r = http(api, "GET", "/topics/T/queues/0/messages?offset=0&max=8")
        assert st == 200 and [m["body"] for m in r["messages"]] == ["m0", "m1", "m2", "m3"], (st, r)
        assert [m["queue_offset"] for m in r["messages"]] == [0, 1, 2, 3]
    finally:
        node.stop()
