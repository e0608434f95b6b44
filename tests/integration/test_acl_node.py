"""A real node process with aclEnable=true: signatures and permissions end to end.

Method: write an ACL file with an admin, a producer (PUB|SUB on one topic) and a reader
(SUB only), start `python -m node` on a free loopback port, create the topic with the CLI
as admin, then check: /health stays open; unsigned requests get 401; the producer's signed
send and pull work, through raw HTTP and the SDK transport; a replay of the producer's
send gets 401; the reader's send gets 403 and the topic's offsets do not move; an edit of
the ACL file takes effect without a restart; aclEnable without a usable file does not start.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

from mqstore import cli
from node.acl import sign_headers
from tests.integration.test_node_process import ROOT, NodeProcess, free_port, write_conf

TOPIC = "orders"
ACL = {"accounts": [
    {"accessKey": "admin-key", "secretKey": "admin-secret", "admin": True},
    {"accessKey": "producer1", "secretKey": "prod-secret", "topicPerms": [f"{TOPIC}=PUB|SUB"]},
    {"accessKey": "reader01", "secretKey": "read-secret", "topicPerms": [f"{TOPIC}=SUB"]},
]}
KEYS = {a["accessKey"]: a["secretKey"] for a in ACL["accounts"]}


def request(port: int, method: str, path: str, doc=None, ak: str | None = None, headers=None):
    """(status, json, headers sent, body sent). Signed by `ak` unless `headers` are given."""
    body = json.dumps(doc).encode() if doc is not None else b""
    sent = {"Content-Type": "application/json"}
    if headers is not None:
        sent.update(headers)
    elif ak is not None:
        sent.update(sign_headers(ak, KEYS[ak], method, path, None, body, int(time.time() * 1000)))
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body or None, method=method, headers=sent)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read()), sent, body
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), sent, body


def max_offsets(port: int) -> list[int]:
    status, doc, _, _ = request(port, "GET", f"/topics/{TOPIC}", ak="admin-key")
    assert status == 200, doc
    return [q["max_offset"] for q in doc["queues"]]


def test_acl_on_a_real_node(tmp_path):
    acl_path = tmp_path / "acl.json"
    acl_path.write_text(json.dumps(ACL))
    port = free_port()
    conf = write_conf(tmp_path, port, f"aclEnable=true\naclFile={acl_path}\naclReloadIntervalMs=100\n")
    node = NodeProcess(conf, port, str(tmp_path / "node.log"))
    node.start()          # polls /health unsigned: it stays open
    try:
        # the CLI as admin creates the topic; without keys it is refused
        assert cli.main(["updateTopic", "-n", f"127.0.0.1:{port}", "-t", TOPIC, "-r", "2", "-w", "2",
                         "--access-key", "admin-key", "--secret-key", "admin-secret"]) == 0
        assert cli.main(["topicList", "-n", f"127.0.0.1:{port}"]) == 1

        # unsigned: 401 with the error shape, nothing sent
        for method, path, doc in (("GET", "/topics", None), ("GET", "/config", None),
                                  ("POST", f"/topics/{TOPIC}/messages", {"messages": [{"body": "x"}]})):
            status, err, _, _ = request(port, method, path, doc)
            assert status == 401, err
            assert err["error"] == "UNAUTHENTICATED" and err["retriable"] is False and err["message"]
        assert max_offsets(port) == [0, 0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:   # stays open
            assert r.status == 200 and b"# TYPE" in r.read()

        # producer: signed send and pull
        status, doc, sent, body = request(port, "POST", f"/topics/{TOPIC}/messages",
                                          {"messages": [{"body": "hello", "queue_id": 0}]}, ak="producer1")
        assert status == 200 and doc["results"][0]["status"] == "SEND_OK", doc
        status, pulled, _, _ = request(port, "GET", f"/topics/{TOPIC}/queues/0/messages?offset=0&max=8",
                                       ak="producer1")
        assert status == 200 and [m["body"] for m in pulled["messages"]] == ["hello"], pulled
        assert max_offsets(port) == [1, 0]

        # the exact same request again is a replay
        status, err, _, _ = request(port, "POST", f"/topics/{TOPIC}/messages", headers=sent,
                                    doc={"messages": [{"body": "hello", "queue_id": 0}]})
        assert status == 401 and "replayed" in err["message"], err
        assert max_offsets(port) == [1, 0]

        # reader: may pull, may not send or create topics; nothing changes
        status, pulled, _, _ = request(port, "GET", f"/topics/{TOPIC}/queues/0/messages?offset=0", ak="reader01")
        assert status == 200 and len(pulled["messages"]) == 1
        status, err, _, _ = request(port, "POST", f"/topics/{TOPIC}/messages",
                                    {"messages": [{"body": "sneaky", "queue_id": 1}]}, ak="reader01")
        assert status == 403 and err["error"] == "NO_PERMISSION" and err["retriable"] is False, err
        status, err, _, _ = request(port, "POST", "/topics", {"topic": "other", "queues": 1}, ak="reader01")
        assert status == 403, err
        assert max_offsets(port) == [1, 0]
        status, topics, _, _ = request(port, "GET", "/topics", ak="reader01")
        assert [t["topic"] for t in topics["topics"]] == [TOPIC]

        # the SDK transport signs from its options
        asyncio.run(_sdk_send(port))
        assert max_offsets(port) == [1, 1]

        # granting the reader PUB in the file takes effect without a restart
        doc = json.loads(json.dumps(ACL))
        doc["accounts"][2]["topicPerms"] = [f"{TOPIC}=PUB|SUB"]
        acl_path.write_text(json.dumps(doc))
        os.utime(acl_path, ns=(time.time_ns(), time.time_ns() + 50_000_000))
        deadline = time.monotonic() + 10
        while True:
            status, err, _, _ = request(port, "POST", f"/topics/{TOPIC}/messages",
                                        {"messages": [{"body": "now allowed", "queue_id": 1}]}, ak="reader01")
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert status == 200, err
        assert max_offsets(port) == [1, 2]
    finally:
        assert node.terminate() == 0


async def _sdk_send(port: int) -> None:
    from mqstore.client.transport import BrokerGroup, Transport
    t = Transport(5.0, access_key="producer1", secret_key="prod-secret")
    await t.start()
    try:
        doc = await t.call(BrokerGroup("g", [f"127.0.0.1:{port}"]), "POST", f"/topics/{TOPIC}/messages",
                           {"messages": [{"body": b"from the sdk", "queue_id": 1}]})
        assert doc["results"][0]["status"] == "SEND_OK"
    finally:
        await t.close()


def test_acl_enable_with_a_missing_file_exits_2_before_opening_the_store(tmp_path):
    """Regression: the ACL file was first read in the app factory, after the store had opened,
    so a bad aclFile crashed with a traceback and left the store's abort marker behind."""
    port = free_port()
    conf = write_conf(tmp_path, port, f"aclEnable=true\naclFile={tmp_path / 'nope.json'}\n")
    p = subprocess.run([sys.executable, "-m", "node", "--config", conf], cwd=ROOT, capture_output=True,
                       timeout=30, text=True)
    assert p.returncode == 2, p.stderr
    assert "ConfigError: aclFile: cannot read ACL file" in p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "store").exists()
