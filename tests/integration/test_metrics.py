"""Prometheus metrics of real node processes after a known workload.

Method: a standalone node (SYNC_FLUSH, so fsyncs happen) gets a topic with 2 queues,
10 + 5 messages of known sizes, a pull of 4 and committed offsets for one group; the
scrape must show exactly those counts, bytes and lags, a non-empty fsync histogram and
the store's size. A 3-node DLedger group is then scraped for term, role, commit/applied
index and leader changes, leader and followers alike. Values are parsed with
prometheus_client's own parser, so a malformed exposition fails too.
"""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.dledger_group import DLedgerGroup
from tests.integration.test_node_process import NodeProcess, free_port, http, wait_dispatched, write_conf


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} not scraped; have {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


@pytest.fixture
def standalone(tmp_path):
    port = free_port()
    n = NodeProcess(write_conf(tmp_path, port, "flushDiskType=SYNC_FLUSH\n"), port, str(tmp_path / "node.log"))
    n.start()
    yield n
    n.kill9()


def test_standalone_scrape_after_known_workload(standalone):
    p = standalone.port
    assert http(p, "POST", "/topics", {"topic": "Metered", "queues": 2})[0] == 200
    q0 = [{"body": "x" * (10 + i), "queue_id": 0} for i in range(10)]        # 10..19 bytes: 145 in all
    q1 = [{"body": "y" * 100, "queue_id": 1} for _ in range(5)]               # 500 bytes
    assert http(p, "POST", "/topics/Metered/messages", {"messages": q0})[0] == 200
    assert http(p, "POST", "/topics/Metered/messages", {"messages": q1})[0] == 200
    wait_dispatched(p, "Metered", 0, 10)
    wait_dispatched(p, "Metered", 1, 5)
    status, doc = http(p, "GET", "/topics/Metered/queues/0/messages?offset=0&max=4")
    assert status == 200 and len(doc["messages"]) == 4
    assert http(p, "POST", "/groups/G1/offsets", {"topic": "Metered", "queue_id": 0, "offset": 4})[0] == 200
    assert http(p, "POST", "/groups/G1/offsets", {"topic": "Metered", "queue_id": 1, "offset": 1})[0] == 200

    s = scrape(p)
    assert value(s, "rocketmq_producer_messages_total", topic="Metered") == 15
    assert value(s, "rocketmq_producer_message_bytes_total", topic="Metered") == 145 + 500
    assert value(s, "rocketmq_consumer_messages_total", topic="Metered") == 4
    assert value(s, "rocketmq_consumer_message_bytes_total", topic="Metered") == 10 + 11 + 12 + 13
    assert value(s, "rocketmq_consumer_lag_messages", topic="Metered", queue="0", group="G1") == 6
    assert value(s, "rocketmq_consumer_lag_messages", topic="Metered", queue="1", group="G1") == 4
    assert value(s, "rocketmq_consumer_offset", topic="Metered", queue="1", group="G1") == 1
    assert value(s, "rocketmq_queue_max_offset", topic="Metered", queue="0") == 10
    assert value(s, "rocketmq_dispatch_behind_bytes", group="broker-a", node="broker-a-0") == 0
    assert value(s, "rocketmq_node_role", role="STANDALONE") == 1
    assert value(s, "rocketmq_fsync_latency_seconds_count") >= 2          # SYNC_FLUSH: one per send at least
    assert value(s, "rocketmq_fsync_latency_seconds_bucket", le="+Inf") == \
        value(s, "rocketmq_fsync_latency_seconds_count")
    assert value(s, "rocketmq_fsync_latency_seconds_sum") > 0
    assert value(s, "rocketmq_store_size_bytes") > 645
    assert 0 < value(s, "rocketmq_store_disk_used_ratio") < 1
    assert not any(k[0].startswith("rocketmq_raft_") for k in s)          # not a Raft node

    # Lag follows the consumer without any per-message gauge update: commit, scrape again.
    assert http(p, "POST", "/groups/G1/offsets", {"topic": "Metered", "queue_id": 0, "offset": 10})[0] == 200
    assert value(scrape(p), "rocketmq_consumer_lag_messages", topic="Metered", queue="0", group="G1") == 0


def test_dledger_group_scrape_shows_raft_state(tmp_path):
    g = DLedgerGroup(tmp_path).start()
    try:
        leader = g.leader()
        lp = g.api[leader]
        assert http(lp, "POST", "/topics", {"topic": "Raft", "queues": 1})[0] == 200
        assert http(lp, "POST", "/topics/Raft/messages", {"messages": [{"body": "m"}] * 7})[0] == 200
        deadline = time.monotonic() + 10
        while True:   # followers learn the commit index with the next push or heartbeat
            samples = {n: scrape(g.api[n]) for n in g.nodes}
            commits = {n: value(s, "rocketmq_raft_commit_index") for n, s in samples.items()}
            applied = {n: value(s, "rocketmq_raft_applied_index") for n, s in samples.items()}
            if len(set(commits.values())) == 1 and applied == commits or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(set(commits.values())) == 1 and applied == commits, (commits, applied)
        # no-op of the term + topic config + one batch of 7 messages: at least 3 entries
        assert commits[leader] >= 3
        terms = {n: value(s, "rocketmq_raft_term") for n, s in samples.items()}
        assert len(set(terms.values())) == 1 and terms[leader] >= 1, terms
        for n, s in samples.items():
            assert value(s, "rocketmq_raft_is_leader") == (1 if n == leader else 0)
            assert value(s, "rocketmq_raft_leader_changes_total") >= 1
            assert value(s, "rocketmq_node_role", role="LEADER") == (1 if n == leader else 0)
        assert value(samples[leader], "rocketmq_producer_messages_total", topic="Raft") == 7
        followers = [n for n in g.nodes if n != leader]
        for f in followers:
            assert value(samples[leader], "rocketmq_raft_peer_match_index", peer=f) == commits[leader]
    finally:
        g.close()


def test_controller_exposes_epoch_and_sync_state_set_and_serves_the_dashboard(tmp_path):
    import subprocess
    import sys

    from tests.integration.test_node_process import ROOT
    api, raft = free_port(), free_port()
    log = open(tmp_path / "controller.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "ha", "--port", str(api), "--raft-port", str(raft),
                             "--data-dir", str(tmp_path / "c0"), "--heartbeat-timeout-ms", "500"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    try:
        body = {"group": "g", "broker_id": 0, "addr": "127.0.0.1:20000", "ha_addr": "127.0.0.1:21000",
                "epoch": 0, "max_offset": 0, "priority": 0, "in_sync": []}
        deadline = time.monotonic() + 20
        s: dict = {}
        while time.monotonic() < deadline:   # beat until the controller has elected broker 0
            try:
                http(api, "POST", "/brokers/heartbeat", body, timeout=1.0)
                s = scrape(api)
            except OSError:
                time.sleep(0.2)
                continue
            if s.get(("rocketmq_controller_master_id", (("group", "g"),))) == 0:
                break
            time.sleep(0.2)
        assert value(s, "rocketmq_controller_is_leader") == 1
        assert value(s, "rocketmq_controller_master_id", group="g") == 0
        assert value(s, "rocketmq_controller_master_epoch", group="g") >= 1
        assert value(s, "rocketmq_controller_sync_state_set_size", group="g") == 1
        with urllib.request.urlopen(f"http://127.0.0.1:{api}/dashboard", timeout=5) as r:
            assert r.status == 200 and b"/dashboard/static/app.js" in r.read()
        with urllib.request.urlopen(f"http://127.0.0.1:{api}/dashboard/static/app.js", timeout=5) as r:
            assert b"renderControllerGroups" in r.read()
    finally:
        proc.kill()
        proc.wait(10)
