"""The admin verbs against a real node process, end to end through the REST endpoints they use.

Method: a standalone node on a free port; run `mqstore.cli.main` in-process against it
and check the node's state changed as the verb says (topic gone and still gone after a
restart, offsets moved to the first message stored at or after a time, progress rows).
"""

from __future__ import annotations

import io
import json
import os
import time

import pytest

from mqstore import cli
from tests.integration.test_node_process import NodeProcess, free_port, http, wait_dispatched, write_conf


@pytest.fixture
def node(tmp_path):
    port = free_port()
    n = NodeProcess(write_conf(tmp_path, port), port, str(tmp_path / "node.log"))
    n.start()
    yield n
    n.kill9()


def run(port: int, *argv: str) -> dict:
    out = io.StringIO()
    assert cli.main([*argv, "-n", f"127.0.0.1:{port}", "--json"], out=out) == 0
    return json.loads(out.getvalue())


def test_reset_offset_by_time_moves_to_the_first_message_at_or_after_it(node):
    p = node.port
    assert http(p, "POST", "/topics", {"topic": "Timed", "queues": 2})[0] == 200
    assert http(p, "POST", "/topics/Timed/messages", {"messages": [{"body": f"a{i}", "queue_id": 0}
                                                                   for i in range(5)]})[0] == 200
    time.sleep(0.05)
    cut = int(time.time() * 1000)
    time.sleep(0.05)
    assert http(p, "POST", "/topics/Timed/messages", {"messages": [{"body": f"b{i}", "queue_id": 0}
                                                                   for i in range(3)]})[0] == 200
    wait_dispatched(p, "Timed", 0, 8)
    doc = run(p, "resetOffsetByTime", "-g", "G", "-t", "Timed", "-s", str(cut))
    assert doc["queues"] == [{"queue_id": 0, "offset": 5}, {"queue_id": 1, "offset": 0}]
    assert http(p, "GET", "/groups/G/offsets?topic=Timed")[1]["offsets"] == [
        {"topic": "Timed", "queue_id": 0, "offset": 5}, {"topic": "Timed", "queue_id": 1, "offset": 0}]
    assert run(p, "resetOffsetByTime", "-g", "G", "-t", "Timed", "-s", "0")["queues"][0]["offset"] == 0
    assert run(p, "resetOffsetByTime", "-g", "G", "-t", "Timed", "-s", "now")["queues"][0]["offset"] == 8

    prog = run(p, "consumerProgress", "-g", "G")
    assert prog["diff_total"] == 0 and prog["queues"][0]["broker_offset"] == 8
    assert run(p, "consumerProgress")["groups"][0]["group"] == "G"
    status, err = http(p, "POST", "/groups/G/offsets/reset?topic=Timed", {})
    assert status == 400 and "timestamp" in err["message"]


def test_delete_topic_stays_deleted_after_restart(node):
    p = node.port
    assert http(p, "POST", "/topics", {"topic": "Doomed", "queues": 1})[0] == 200
    assert http(p, "POST", "/topics", {"topic": "Kept", "queues": 1})[0] == 200
    assert run(p, "deleteTopic", "-t", "Doomed")["deleted"]["topic"] == "Doomed"
    assert [t["topic"] for t in run(p, "topicList")["topics"]] == ["Kept"]
    status, err = http(p, "POST", "/topics/Doomed/messages", {"messages": [{"body": "x"}]})
    assert status == 404 and err["error"] == "TOPIC_NOT_EXIST"
    assert http(p, "DELETE", "/topics/Doomed")[0] == 404
    assert node.terminate() == 0
    node.start()
    assert [t["topic"] for t in run(p, "topicList")["topics"]] == ["Kept"]


def test_cluster_list_route_and_config_of_a_standalone_node(node):
    p = node.port
    assert http(p, "POST", "/topics", {"topic": "Routed", "queues": 3})[0] == 200
    nodes = run(p, "clusterList")
    assert [(n["node_id"], n["reachable"], n["cluster"]["role"]) for n in nodes["nodes"]] == [
        ("broker-a-0", True, "STANDALONE")]
    route = run(p, "topicRoute", "-t", "Routed")
    assert route["queueDatas"][0]["writeQueueNums"] == 3
    assert route["brokerDatas"][0]["brokerAddrs"] == {"0": f"127.0.0.1:{p}"}
    assert run(p, "getBrokerConfig")["config"]["listenPort"] == str(p)


def test_consumer_progress_names_the_live_members_and_their_queues(node):
    p = node.port
    assert http(p, "POST", "/topics", {"topic": "Shared", "queues": 2})[0] == 200
    assert http(p, "POST", "/topics/Shared/messages", {"messages": [{"body": "x", "queue_id": q} for q in (0, 1)]})[0] == 200
    wait_dispatched(p, "Shared", 1, 1)
    run(p, "resetOffsetByTime", "-g", "CG", "-t", "Shared", "-s", "0")     # the group now has offsets
    for cid in ("10.0.0.2@b", "10.0.0.1@a"):
        assert http(p, "POST", "/groups/CG/heartbeat", {"client_id": cid, "topics": ["Shared"]})[0] == 200
    prog = run(p, "consumerProgress", "-g", "CG")
    assert [m["client_id"] for m in prog["members"]] == ["10.0.0.1@a", "10.0.0.2@b"]
    assert [(r["queue_id"], r["client_id"]) for r in prog["queues"]] == [(0, "10.0.0.1@a"), (1, "10.0.0.2@b")]
    row = [g for g in run(p, "consumerProgress")["groups"] if g["group"] == "CG"][0]
    assert len(row["members"]) == 2
    assert http(p, "DELETE", "/groups/CG/members/10.0.0.1@a")[0] == 200
    prog = run(p, "consumerProgress", "-g", "CG")
    assert [r["client_id"] for r in prog["queues"]] == ["10.0.0.2@b", "10.0.0.2@b"]


def test_skip_accumulated_message_and_clone_group_offset(node):
    p = node.port
    assert http(p, "POST", "/topics", {"topic": "Backlog", "queues": 2})[0] == 200
    assert http(p, "POST", "/topics/Backlog/messages", {"messages": [{"body": f"b{i}", "queue_id": i % 2}
                                                                     for i in range(7)]})[0] == 200
    wait_dispatched(p, "Backlog", 0, 4)
    wait_dispatched(p, "Backlog", 1, 3)
    assert http(p, "POST", "/groups/Slow/offsets", {"topic": "Backlog", "queue_id": 0, "offset": 1})[0] == 200
    assert run(p, "consumerProgress", "-g", "Slow")["diff_total"] == 6
    doc = run(p, "skipAccumulatedMessage", "-g", "Slow", "-t", "Backlog")
    assert doc["queues"] == [{"queue_id": 0, "offset": 4}, {"queue_id": 1, "offset": 3}]
    assert run(p, "consumerProgress", "-g", "Slow")["diff_total"] == 0
    run(p, "cloneGroupOffset", "-s", "Slow", "-d", "Copy", "-t", "Backlog")
    assert http(p, "GET", "/groups/Copy/offsets?topic=Backlog")[1]["offsets"] == [
        {"topic": "Backlog", "queue_id": 0, "offset": 4}, {"topic": "Backlog", "queue_id": 1, "offset": 3}]
    status, err = http(p, "POST", "/groups/Slow/offsets/reset?topic=Backlog&timestamp=-2", {})
    assert status == 400 and "timestamp" in err["message"]


def test_print_msg_prints_each_queue_within_a_store_time_range_and_tags(node):
    p = node.port
    assert http(p, "POST", "/topics", {"topic": "Printed", "queues": 2})[0] == 200
    assert http(p, "POST", "/topics/Printed/messages", {"messages": [
        {"body": f"early{i}", "queue_id": 0, "tags": "TagA" if i % 2 else "TagB"} for i in range(4)]})[0] == 200
    wait_dispatched(p, "Printed", 0, 4)
    early = http(p, "GET", "/topics/Printed/queues/0/messages?offset=0&max=4")[1]["messages"]
    time.sleep(0.05)
    assert http(p, "POST", "/topics/Printed/messages", {"messages": [
        {"body": f"late{i}", "queue_id": 0, "tags": "TagA"} for i in range(3)]})[0] == 200
    wait_dispatched(p, "Printed", 0, 7)
    late_ts = http(p, "GET", "/topics/Printed/queues/0/messages/4")[1]["store_timestamp"]
    assert late_ts > early[-1]["store_timestamp"]

    out = io.StringIO()
    assert cli.main(["printMsg", "-n", f"127.0.0.1:{p}", "-t", "Printed"], out=out) == 0
    text = out.getvalue()
    assert [line.split(" BODY: ")[1] for line in text.splitlines() if line.startswith("MSGID: ")] == [
        "early0", "early1", "early2", "early3", "late0", "late1", "late2"]
    assert "minOffset=0, maxOffset=7, MessageQueue [topic=Printed" in text and "minOffset=0, maxOffset=0," in text

    doc = run(p, "printMsg", "-t", "Printed", "-b", str(late_ts))
    assert [m["body"] for m in doc["queues"][0]["messages"]] == ["late0", "late1", "late2"]
    doc = run(p, "printMsg", "-t", "Printed", "-e", str(late_ts), "-s", "TagA")
    assert [m["body"] for m in doc["queues"][0]["messages"]] == ["early1", "early3"]
    out = io.StringIO()
    assert cli.main(["printMsg", "-n", f"127.0.0.1:{p}", "-t", "Printed", "-d", "false", "-b", str(late_ts)],
                    out=out) == 0
    assert out.getvalue().count("BODY: NOT PRINT BODY") == 3

    assert http(p, "GET", f"/topics/Printed/queues/0/offset?timestamp={late_ts}")[1]["offset"] == 4
    assert http(p, "GET", f"/topics/Printed/queues/0/offset?timestamp={late_ts * 2}")[1]["offset"] == 7
    assert http(p, "GET", "/topics/Printed/queues/0/offset?timestamp=0")[1]["offset"] == 0
    assert http(p, "GET", "/topics/Printed/queues/0/offset")[0] == 400
    assert http(p, "GET", "/topics/Printed/queues/9/offset?timestamp=0")[0] == 400
    assert http(p, "GET", "/topics/NoSuchTopic/queues/0/offset?timestamp=0")[0] == 404


def test_stats_all_counts_what_was_sent_and_what_a_group_pulled(node):
    p = node.port
    assert http(p, "POST", "/topics", {"topic": "Counted", "queues": 2})[0] == 200
    assert http(p, "POST", "/topics/Counted/messages", {"messages": [{"body": f"c{i}", "queue_id": 0}
                                                                     for i in range(6)]})[0] == 200
    wait_dispatched(p, "Counted", 0, 6)
    status, got = http(p, "GET", "/topics/Counted/queues/0/messages?offset=0&max=4&group=Readers")
    assert status == 200 and len(got["messages"]) == 4
    assert http(p, "POST", "/groups/Readers/offsets", {"topic": "Counted", "queue_id": 0, "offset": 4})[0] == 200
    doc = run(p, "statsAll", "-t", "Counted")
    assert doc["topics"] == [{"topic": "Counted", "in_tps": doc["topics"][0]["in_tps"], "in_msg_24h": 6, "groups": [
        {"group": "Readers", "accumulation": 2, "out_tps": doc["topics"][0]["groups"][0]["out_tps"],
         "out_msg_24h": 4}]}]
    out = io.StringIO()
    assert cli.main(["statsAll", "-n", f"127.0.0.1:{p}", "-a"], out=out) == 0
    row = [line.split() for line in out.getvalue().splitlines() if line.startswith("Counted")]
    assert row and row[0][:3] == ["Counted", "Readers", "2"] and row[0][-2:] == ["6", "4"]


def test_delete_expired_commitlog_cuts_a_standalone_log_outside_the_delete_hour(tmp_path):
    """deleteWhen is twelve hours off and the disk nearly empty: only the admin's request cuts."""
    port = free_port()
    hour = time.localtime().tm_hour
    n = NodeProcess(write_conf(tmp_path, port, f"mappedFileSizeCommitLog={256 * 1024}\nfileReservedTime=1\n"
                                               f"deleteWhen={(hour + 12) % 24:02d}\n"), port, str(tmp_path / "node.log"))
    n.start()
    try:
        assert http(port, "POST", "/topics", {"topic": "Old", "queues": 1})[0] == 200
        for i in range(0, 1000, 100):
            assert http(port, "POST", "/topics/Old/messages",
                        {"messages": [{"body": f"m{j:04d}" + "x" * 1000, "queue_id": 0} for j in range(i, i + 100)]})[0] == 200
        wait_dispatched(port, "Old", 0, 1000)
        d = tmp_path / "store" / "commitlog"
        files = sorted(os.listdir(d))
        assert len(files) >= 4, files
        aged = time.time() - 2 * 3600
        for f in files[:-1]:
            os.utime(d / f, (aged, aged))
        deadline = time.monotonic() + 5       # only flushed files go: the first periodic flush (500 ms)
        while http(port, "GET", "/cluster")[1]["log"]["flushed_offset"] < int(files[-1]):
            assert time.monotonic() < deadline, "not flushed"
            time.sleep(0.1)
        doc = run(port, "deleteExpiredCommitLog")
        assert doc["nodes"][0]["manual_delete_passes"] == 20 and doc["nodes"][0]["min_offset"] == 0
        deadline = time.monotonic() + 8
        while http(port, "GET", "/topics/Old")[1]["queues"][0]["min_offset"] == 0:
            assert time.monotonic() < deadline, "the expired head was not cut at once"
            time.sleep(0.2)
        while len(os.listdir(d)) >= len(files):    # the reaper's thread removes the files cut
            assert time.monotonic() < deadline, "the expired files were not removed"
            time.sleep(0.1)
        status, doc = http(port, "GET", "/topics/Old/queues/0/messages?offset=999&max=1")
        assert status == 200 and doc["messages"][0]["body"].startswith("m0999")
    finally:
        n.kill9()
