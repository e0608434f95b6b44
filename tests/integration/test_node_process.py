"""A real node process: `python -m node --config FILE` on a free loopback port.

Method: start the process with a temp store, drive it over HTTP (send, pull, offsets,
queries, CLI), SIGTERM it and check a clean stop (exit 0, abort marker gone), restart it
and check everything is still there; a bad config exits 2 with the key named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from mqstore import localcluster as lc
from mqstore.localcluster import ROOT, free_port, http
from mqstore.localcluster import NodeProc as NodeProcess


def write_conf(directory, port: int, extra: str = "") -> str:
    """broker.conf for one small-geometry node in `directory` (store under directory/store)."""
    return lc.write_conf(os.path.join(str(directory), "broker.conf"), lc.node_lines(
        port, os.path.join(str(directory), "store"),
        [*lc.SMALL_GEOMETRY, "maxMessageSize=65536", "maxRequestBytes=4194304", *lc.conf_lines(extra)]))


@pytest.fixture
def node(tmp_path):
    port = free_port()
    n = NodeProcess(write_conf(tmp_path, port, "flushDiskType=SYNC_FLUSH\n"), port, str(tmp_path / "node.log"))
    n.start()
    yield n
    n.kill9()


def wait_dispatched(port: int, topic: str, qid: int, want_max: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, doc = http(port, "GET", f"/topics/{topic}")
        if doc["queues"][qid]["max_offset"] >= want_max:
            return
        time.sleep(0.02)
    raise AssertionError(f"{topic}/{qid} never reached {want_max}")


def test_send_pull_offsets_query_then_sigterm_and_restart(node, tmp_path):
    p = node.port
    assert http(p, "POST", "/topics", {"topic": "Orders", "queues": 2})[0] == 200
    msgs = [{"body": f"order-{i}", "keys": [f"k{i}"], "tags": "paid" if i % 2 else "new", "queue_id": 1}
            for i in range(20)]
    status, doc = http(p, "POST", "/topics/Orders/messages", {"messages": msgs})
    assert status == 200 and [r["queue_offset"] for r in doc["results"]] == list(range(20))
    results = doc["results"]
    wait_dispatched(p, "Orders", 1, 20)
    status, doc = http(p, "GET", "/topics/Orders/queues/1/messages?offset=0&max=50&tags=paid")
    assert doc["status"] == "FOUND" and [m["body"] for m in doc["messages"]] == [f"order-{i}" for i in range(1, 20, 2)]
    assert http(p, "POST", "/groups/G/offsets", {"topic": "Orders", "queue_id": 1, "offset": 12})[0] == 200
    status, doc = http(p, "GET", f"/messages/{results[7]['offset_msg_id']}")
    assert status == 200 and doc["body"] == "order-7"
    status, doc = http(p, "GET", "/topics/Orders/messages?key=k3")
    assert [m["body"] for m in doc["messages"]] == ["order-3"]

    assert node.terminate() == 0, node.tail()
    assert not os.path.exists(tmp_path / "store" / "abort")
    node.start()
    status, doc = http(p, "GET", "/groups/G/offsets?topic=Orders")
    assert doc["offsets"] == [{"topic": "Orders", "queue_id": 1, "offset": 12}]
    status, doc = http(p, "GET", "/topics/Orders/queues/1/messages?offset=0&max=32")
    assert [m["body"] for m in doc["messages"]] == [f"order-{i}" for i in range(20)]
    status, doc = http(p, "GET", f"/messages/{results[19]['offset_msg_id']}")
    assert doc["body"] == "order-19"
    status, doc = http(p, "GET", "/topics/Orders/messages?key=k3")
    assert [m["body"] for m in doc["messages"]] == ["order-3"]
    status, doc = http(p, "POST", "/topics/Orders/messages", {"messages": [{"body": "after", "queue_id": 1}]})
    assert doc["results"][0]["queue_offset"] == 20           # queue offsets resume, not restart


def test_cli_against_a_real_node(node):
    env = {**os.environ, "PYTHONPATH": ROOT}
    ep = f"127.0.0.1:{node.port}"

    def cli(*args):
        r = subprocess.run([sys.executable, "-m", "mqstore.cli", *args, "-n", ep], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=30)
        return r.returncode, r.stdout, r.stderr
    assert cli("updateTopic", "-t", "C", "-w", "2")[0] == 0
    rc, out, _ = cli("send", "-t", "C", "-b", "hi", "-q", "1", "--keys", "kk")
    assert rc == 0 and out.startswith("SendResult [sendStatus=SEND_OK")
    wait_dispatched(node.port, "C", 1, 1)
    rc, out, _ = cli("topicStatus", "-t", "C")
    lines = out.splitlines()
    assert lines[0].split() == ["#Broker", "Name", "#QID", "#Min", "Offset", "#Max", "Offset", "#Last", "Updated"]
    assert lines[2].split()[:4] == ["broker-a", "1", "0", "1"]
    rc, out, _ = cli("queryMsgByOffset", "-t", "C", "-q", "1", "-o", "0")
    assert "Topic:               C" in out and "Message Body:        hi" in out
    rc, out, err = cli("topicStatus", "-t", "Missing")
    assert rc == 1 and "TOPIC_NOT_EXIST" in err
    rc, out, _ = cli("topicList", "--json")
    assert json.loads(out)["topics"][0]["topic"] == "C"


def test_bad_config_exits_2_naming_the_key(tmp_path):
    conf = write_conf(tmp_path, 0)
    r = subprocess.run([sys.executable, "-m", "node", "--config", conf], cwd=ROOT, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and "listenPort: must be 1..65535, got 0" in r.stderr


def test_environment_override(tmp_path):
    port = free_port()
    conf = write_conf(tmp_path, 1)   # the file's port is wrong; the environment fixes it
    node = NodeProcess(conf, port, str(tmp_path / "node.log"), env={"MQSTORE_listenPort": str(port)})
    try:
        node.start(20)          # waits for /health on the overridden port
    finally:
        assert node.terminate(20) == 0, node.tail()
