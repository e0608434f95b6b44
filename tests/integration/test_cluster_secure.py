"""`mqstore cluster up --secure`: the local 3-node DLedger group with ACL and peer authentication.

Method: the real command (`python -m mqstore.cli cluster up --secure --detach`) on free
loopback ports; the keys it prints must be the ones in the `acl.json` it wrote (mode 600),
unsigned requests are refused 401 and change nothing, the printed keys create a topic and
send and pull through the CLI, the Raft group elected a leader through authenticated links
(no node logged running without a secret), and the dashboard fan-out reads all three members
(signed with the cluster secret). `cluster down` ends exactly the processes it started.
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
import time

import pytest

from mqstore import cli
from mqstore import cluster as mc
from mqstore import localcluster as lc
from node.acl import sign_headers
from tests.integration.cluster_cli import cluster_up


def secure_ports(base: int) -> list[int]:
    """Every port of `cluster up --base-port base`: APIs (base + 10 i) and Raft (40911 + i + base - 10911)."""
    return [base + 10 * i for i in range(3)] + [40911 + i + base - 10911 for i in range(3)]


def signed(method: str, url: str, keys: tuple[str, str], doc=None) -> tuple[int, dict]:
    import urllib.error
    import urllib.parse
    import urllib.request
    body = json.dumps(doc).encode() if doc is not None else None
    path = urllib.parse.urlsplit(url).path
    headers = {"Content-Type": "application/json"}
    if keys:
        headers.update(sign_headers(keys[0], keys[1], method, path, None, body, int(time.time() * 1000)))
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, method=method, headers=headers),
                                    timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture
def secure_cluster(tmp_path):
    d = str(tmp_path / "c")
    with cluster_up(d, secure_ports, 3, "--secure") as out:
        yield d, out


def test_secure_cluster_prints_working_keys_and_refuses_unsigned(secure_cluster, monkeypatch):
    d, out = secure_cluster
    m = re.search(r"export MQSTORE_ACCESS_KEY=(\S+) MQSTORE_SECRET_KEY=(\S+)", out)
    assert m, out
    keys = (m.group(1), m.group(2))
    acl = json.load(open(os.path.join(d, mc.ACL_FILE)))
    assert acl["accounts"] == [{"accessKey": keys[0], "secretKey": keys[1], "admin": True}]
    for name in (mc.ACL_FILE, mc.SECRET_FILE):
        assert stat.S_IMODE(os.stat(os.path.join(d, name)).st_mode) == 0o600
    leader = re.search(r"leader: (127\.0\.0\.1:\d+)", out).group(1)
    apis = json.load(open(os.path.join(d, mc.STATE_FILE)))["apis"]
    assert leader in apis

    # unsigned: refused, nothing created
    status, err = signed("POST", f"http://{leader}/topics", (), {"topic": "Sneaky", "queues": 1})
    assert status == 401 and err["error"] == "UNAUTHENTICATED", err
    assert lc.health(leader) is not None                      # the probe stays open
    # the printed keys work through the CLI
    monkeypatch.setenv("MQSTORE_ACCESS_KEY", keys[0])
    monkeypatch.setenv("MQSTORE_SECRET_KEY", keys[1])

    def run(*argv: str) -> dict:
        buf = io.StringIO()
        assert cli.main([*argv, "-n", leader, "--json"], out=buf) == 0
        return json.loads(buf.getvalue())
    run("updateTopic", "-t", "TopicTest", "-w", "2")
    sent = run("send", "-t", "TopicTest", "-b", "hello-secure")["results"][0]
    got = lc.wait_for(lambda: run("pull", "-t", "TopicTest", "-q", str(sent["queue_id"]), "-o", "0")
                      .get("messages"), 15, "the sent message pulled")
    assert [m["body"] for m in got] == ["hello-secure"]
    status, topics = signed("GET", f"http://{leader}/topics", keys)
    assert status == 200 and "Sneaky" not in [t["topic"] for t in topics["topics"]]
    # the fan-out reads every member with the cluster secret
    doc = lc.wait_for(lambda: (lambda st, dd: dd if st == 200 and all(n["reachable"] for n in dd["nodes"])
                               else None)(*signed("GET", f"http://{leader}/cluster/nodes", keys)),
                      15, "all three members reachable")
    assert sorted(n["cluster"]["role"] for n in doc["nodes"]) == ["FOLLOWER", "FOLLOWER", "LEADER"]
    for i in range(3):
        log = open(os.path.join(d, f"n{i}", "node.log")).read()
        assert "without a cluster secret" not in log and "aclEnable=true without" not in log
