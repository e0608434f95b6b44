"""Golden output of the admin verbs: mqadmin's columns, byte for byte.

Method: `mqstore.cli.call` is replaced by a table of canned API answers (the shapes
node/api.py returns), the clock's zone is pinned to UTC, and each verb's stdout is
compared with tests/golden/<case>.txt. Run with MQSTORE_UPDATE_GOLDEN=1 to rewrite
the files after an intended change, then review the diff.
"""

from __future__ import annotations

import io
import json
import os
import time

import pytest

from mqstore import cli

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden")
EP = "127.0.0.1:20911"
T0 = 1_790_000_000_000          # 2026-09-21 14:13:20 UTC

NODES = {"cluster": "DefaultCluster", "group": "broker-a", "self": "n1", "nodes": [
    {"node_id": "n0", "api": "127.0.0.1:20901", "reachable": False, "cluster": None},
    {"node_id": "n1", "api": "127.0.0.1:20911", "reachable": True, "cluster": {
        "role": "FOLLOWER", "in_tps": 0.0, "out_tps": 12.5, "put_wait_ms": 0, "earliest_store_timestamp": None,
        "log": {"term": 3, "commit_index": 41}}},
    {"node_id": "n2", "api": "127.0.0.1:20921", "reachable": True, "cluster": {
        "role": "LEADER", "in_tps": 1234.5, "out_tps": 99.25, "put_wait_ms": 7,
        "earliest_store_timestamp": T0 - 5 * 3_600_000 - 1_800_000, "log": {"term": 3, "commit_index": 41,
                                                                     "disk_usage_ratio": 0.4321}}}]}
TOPIC = {"topic": "TopicTest", "read_queue_nums": 2, "write_queue_nums": 2, "perm": 6, "queues": [
    {"queue_id": 0, "min_offset": 0, "max_offset": 120, "last_updated": T0 + 5},
    {"queue_id": 1, "min_offset": 10, "max_offset": 10, "last_updated": 0}]}
PROGRESS = {"group": "please_rename_unique_group_name", "broker_name": "broker-a", "consume_tps": 3.5,
            "diff_total": 27, "queues": [
                {"topic": "TopicTest", "queue_id": 0, "broker_offset": 120, "consumer_offset": 93, "diff": 27,
                 "last_timestamp": T0},
                {"topic": "TopicTest", "queue_id": 1, "broker_offset": 10, "consumer_offset": 10, "diff": 0,
                 "last_timestamp": 0}]}
MESSAGE = {"msg_id": "7F00000100004E1F0000000000001A2B", "offset_msg_id": "7F00000100004E1F0000000000001A2B",
           "topic": "TopicTest", "queue_id": 0, "queue_offset": 17, "commitlog_offset": 6699, "tags": "TagA",
           "keys": ["order-1", "user-9"], "properties": {"KEYS": "order-1 user-9", "TAGS": "TagA"},
           "born_timestamp": T0 - 1500, "store_timestamp": T0, "born_host": "127.0.0.1:50000",
           "store_host": "127.0.0.1:20911", "reconsume_times": 0, "body_crc": 1, "body": "hello"}
UNIQ_MESSAGE = {**MESSAGE, "msg_id": "0A0000010B1C18B4AAC2627A51B40000",
                "properties": {**MESSAGE["properties"], "UNIQ_KEY": "0A0000010B1C18B4AAC2627A51B40000"}}
ANSWERS = {
    ("GET", "/cluster/nodes"): NODES,
    ("GET", "/cluster"): {"cluster": "DefaultCluster", "group": "broker-a", "role": "LEADER"},
    ("GET", "/health"): {"status": "UP", "mode": "dledger", "role": "LEADER", "group": "broker-a",
                         "node_id": "n2", "term": 3, "leader": "127.0.0.1:20921", "committed_offset": 9000},
    ("GET", "/topics"): {"topics": [{"topic": "TopicTest", "read_queue_nums": 2, "write_queue_nums": 2, "perm": 6},
                                    {"topic": "Orders", "read_queue_nums": 8, "write_queue_nums": 8, "perm": 6}]},
    ("GET", "/topics/TopicTest"): TOPIC,
    ("POST", "/topics"): {"topic": "TopicTest", "read_queue_nums": 4, "write_queue_nums": 4, "perm": 6},
    ("DELETE", "/topics/TopicTest"): {"deleted": {"topic": "TopicTest", "read_queue_nums": 2,
                                                  "write_queue_nums": 2, "perm": 6}},
    ("GET", "/groups"): {"groups": ["please_rename_unique_group_name"]},
    ("GET", "/groups/please_rename_unique_group_name/progress"): PROGRESS,
    ("GET", "/groups/please_rename_unique_group_name/members"): {
        "group": "please_rename_unique_group_name", "members": [
            {"client_id": "192.168.0.8@5151#2", "topics": ["TopicTest"], "expires_in_ms": 14000,
             "addr": "192.168.0.8:51034", "language": "PYTHON", "version": "0.1.0",
             "subscriptions": {"TopicTest": "TagA || TagB"}, "consume_type": "CONSUME_PASSIVELY",
             "message_model": "CLUSTERING", "consume_from_where": "CONSUME_FROM_LAST_OFFSET"},
            {"client_id": "192.168.0.7@4242#1", "topics": ["TopicTest"], "expires_in_ms": 9000},
            {"client_id": "192.168.0.9@6161#3", "topics": ["Orders", "%RETRY%please_rename_unique_group_name"],
             "expires_in_ms": 12000, "addr": "192.168.0.9:40022", "language": "PYTHON", "version": "0.1.0",
             "subscriptions": {"Orders": "*", "%RETRY%please_rename_unique_group_name": "*"},
             "consume_type": "CONSUME_PASSIVELY", "message_model": "CLUSTERING",
             "consume_from_where": "CONSUME_FROM_LAST_OFFSET"}]},
    ("POST", f"/groups/please_rename_unique_group_name/offsets/reset?topic=TopicTest&timestamp={T0}"): {
        "group": "please_rename_unique_group_name", "topic": "TopicTest", "timestamp": T0,
        "broker_name": "broker-a", "queues": [{"queue_id": 0, "offset": 93}, {"queue_id": 1, "offset": 10}]},
    ("POST", "/groups/please_rename_unique_group_name/offsets/reset?topic=TopicTest&timestamp=-1"): {
        "group": "please_rename_unique_group_name", "topic": "TopicTest", "timestamp": -1,
        "broker_name": "broker-a", "queues": [{"queue_id": 0, "offset": 120}, {"queue_id": 1, "offset": 10}]},
    ("GET", "/groups/please_rename_unique_group_name/offsets?topic=TopicTest"): {
        "group": "please_rename_unique_group_name", "offsets": [
            {"topic": "TopicTest", "queue_id": 0, "offset": 93}, {"topic": "TopicTest", "queue_id": 1, "offset": 10}]},
    ("POST", "/groups/new_group/offsets"): {"group": "new_group", "topic": "TopicTest", "queue_id": 0, "offset": 93,
                                            "status": "SEND_OK"},
    ("GET", "/config"): {"broker_name": "broker-a", "api": EP, "config": {
        "brokerClusterName": "DefaultCluster", "brokerName": "broker-a", "listenPort": "20911",
        "flushDiskType": "ASYNC_FLUSH", "enableDLegerCommitLog": "true"}},
    ("GET", "/messages/7F00000100004E1F0000000000001A2B"): MESSAGE,
    ("GET", "/topics/TopicTest/queues/0/messages/17"): MESSAGE,
    ("GET", "/topics/TopicTest/messages?key=order-1&max=32"): {"messages": [MESSAGE]},
    ("GET", f"/topics/TopicTest/messages?key={UNIQ_MESSAGE['msg_id']}&max=32"): {"messages": [UNIQ_MESSAGE]},
    ("GET", f"/topics/TopicTest/queues/0/offset?timestamp={T0 - 60_000}"): {"offset": 17},
    ("GET", f"/topics/TopicTest/queues/0/offset?timestamp={T0}"): {"offset": 19},
    ("GET", f"/topics/TopicTest/queues/1/offset?timestamp={T0 - 60_000}"): {"offset": 10},
    ("GET", f"/topics/TopicTest/queues/1/offset?timestamp={T0}"): {"offset": 10},
    ("GET", "/topics/TopicTest/queues/0/messages?offset=17&max=32&tags=%2A"): {
        "status": "FOUND", "next_offset": 20, "min_offset": 0, "max_offset": 120, "messages": [
            MESSAGE, {**UNIQ_MESSAGE, "queue_offset": 18, "commitlog_offset": 7000, "body": "world"},
            {**MESSAGE, "queue_offset": 19, "commitlog_offset": 7300}]},
}

CASES = {
    "clusterList": ["clusterList"],
    "topicList": ["topicList"],
    "topicStatus": ["topicStatus", "-t", "TopicTest"],
    "topicRoute": ["topicRoute", "-t", "TopicTest"],
    "updateTopic": ["updateTopic", "-t", "TopicTest", "-r", "4", "-w", "4"],
    "deleteTopic": ["deleteTopic", "-t", "TopicTest"],
    "consumerProgress_all": ["consumerProgress"],
    "consumerProgress_group": ["consumerProgress", "-g", "please_rename_unique_group_name"],
    "resetOffsetByTime": ["resetOffsetByTime", "-g", "please_rename_unique_group_name", "-t", "TopicTest",
                          "-s", str(T0)],
    "getBrokerConfig": ["getBrokerConfig"],
    "skipAccumulatedMessage": ["skipAccumulatedMessage", "-g", "please_rename_unique_group_name", "-t", "TopicTest"],
    "cloneGroupOffset": ["cloneGroupOffset", "-s", "please_rename_unique_group_name", "-d", "new_group",
                         "-t", "TopicTest"],
    "queryMsgById": ["queryMsgById", "-i", "7F00000100004E1F0000000000001A2B"],
    "queryMsgByOffset": ["queryMsgByOffset", "-t", "TopicTest", "-q", "0", "-o", "17"],
    "queryMsgByKey": ["queryMsgByKey", "-t", "TopicTest", "-k", "order-1"],
    "queryMsgByUniqueKey": ["queryMsgByUniqueKey", "-t", "TopicTest", "-i", "0A0000010B1C18B4AAC2627A51B40000"],
    "consumerConnection": ["consumerConnection", "-g", "please_rename_unique_group_name"],
    "printMsg": ["printMsg", "-t", "TopicTest", "-b", str(T0 - 60_000), "-e", str(T0)],
    "consumerProgress_group.json": ["consumerProgress", "-g", "please_rename_unique_group_name", "--json"],
}


@pytest.fixture
def canned(monkeypatch, tmp_path):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    calls = []

    def fake_call(endpoint, method, path, doc=None):
        assert endpoint == EP
        calls.append((method, path, doc))
        if (method, path) not in ANSWERS:
            raise AssertionError(f"unexpected request {method} {path}")
        return json.loads(json.dumps(ANSWERS[(method, path)]))

    monkeypatch.setattr(cli, "call", fake_call)
    monkeypatch.setattr(cli, "now_ms", lambda: T0)
    yield calls
    monkeypatch.delenv("TZ")
    time.tzset()


def run(argv: list[str], tmp_path) -> str:
    out = io.StringIO()
    assert cli.main([*argv, "-n", EP], out=out) == 0
    return out.getvalue().replace(str(tmp_path), "<tmp>")


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case, canned, tmp_path):
    text = run(CASES[case], tmp_path)
    path = os.path.join(GOLDEN, case + ("" if case.endswith(".json") else ".txt"))
    if os.environ.get("MQSTORE_UPDATE_GOLDEN") == "1":
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        assert text == f.read(), f"{case}: output differs from {path}"


def test_reset_offset_by_time_accepts_mqadmin_date_form(canned, tmp_path):
    # yyyy-MM-dd#HH:mm:ss:SSS in local time (UTC here) is the same instant as T0 in ms.
    text = run(["resetOffsetByTime", "-g", "please_rename_unique_group_name", "-t", "TopicTest",
                "-s", "2026-09-21#14:13:20:000"], tmp_path)
    assert f"timestamp(long)[{T0}]" in text


def test_reset_offset_by_time_rejects_a_bad_timestamp(canned, tmp_path, capsys):
    assert cli.main(["resetOffsetByTime", "-n", EP, "-g", "g", "-t", "T", "-s", "yesterday"]) == 1
    assert "is not `now`, milliseconds or yyyy-MM-dd#HH:mm:ss:SSS" in capsys.readouterr().err
    assert canned == []      # nothing was sent


def test_cluster_list_puts_the_leader_at_bid_0_and_marks_unreachable(canned, tmp_path):
    lines = run(["clusterList"], tmp_path).splitlines()
    assert lines[1].split()[2:4] == ["0", "127.0.0.1:20921"]
    down = [ln for ln in lines if "UNREACHABLE" in ln]
    assert len(down) == 1 and "127.0.0.1:20901" in down[0]


def test_cluster_list_fills_pcwait_and_hours_from_the_nodes_reports(canned, tmp_path):
    rows = {ln.split()[3]: ln.split() for ln in run(["clusterList"], tmp_path).splitlines()[1:]}
    assert rows["127.0.0.1:20921"][7:9] == ["7", "5.50"]       # leader: 7 ms put wait, 5.5 h of data
    assert rows["127.0.0.1:20911"][7:9] == ["0", "0.00"]       # empty log: no hours yet
    assert rows["127.0.0.1:20901"][7:9] == ["-", "-"]           # unreachable
    older = {"cluster": "c", "group": "g", "nodes": [{"node_id": "a", "api": "h:1", "reachable": True,
                                                     "cluster": {"role": "LEADER", "in_tps": 1.0}}]}
    assert cli.cluster_list_table(older, now=T0).splitlines()[1].split()[7:9] == ["-", "-"]   # a node without them


MEMBERS_PATH = ("GET", "/groups/please_rename_unique_group_name/members")


def test_consumer_progress_without_members_shows_offline_and_no_client(canned, tmp_path, monkeypatch):
    monkeypatch.setitem(ANSWERS, MEMBERS_PATH, {"group": "please_rename_unique_group_name", "members": []})
    row = run(["consumerProgress"], tmp_path).splitlines()[1].split()
    assert row[1:3] == ["0", "OFFLINE"]
    rows = run(["consumerProgress", "-g", "please_rename_unique_group_name"], tmp_path).splitlines()[1:3]
    assert [r.split()[5] for r in rows] == ["N/A", "N/A"]
    assert ("GET", "/topics/TopicTest", None) not in canned    # no members: nothing to allocate


def test_consumer_progress_when_the_node_cannot_list_members_says_so(canned, tmp_path, monkeypatch, capsys):
    def refuse(endpoint, method, path, doc=None):
        if (method, path) == MEMBERS_PATH:
            raise cli.CliError("NOT_LEADER: this node does not accept writes [HTTP 503]")
        return json.loads(json.dumps(ANSWERS[(method, path)]))

    monkeypatch.setattr(cli, "call", refuse)
    row = run(["consumerProgress"], tmp_path).splitlines()[1].split()
    assert row[1:3] == ["N/A", "N/A"]     # unknown, not a false OFFLINE
    assert "members of group 'please_rename_unique_group_name' unknown: NOT_LEADER" in capsys.readouterr().err
    rows = run(["consumerProgress", "-g", "please_rename_unique_group_name"], tmp_path).splitlines()[1:3]
    assert [r.split()[5] for r in rows] == ["N/A", "N/A"]


def test_allocate_queues_follows_the_clients_averagely_rule():
    doc = {"broker_name": "b", "queues": [{"topic": "T", "queue_id": i} for i in range(5)]
           + [{"topic": "Gone", "queue_id": 3}]}
    members = [{"client_id": "10.0.0.2@b", "topics": ["T", "Gone"]}, {"client_id": "10.0.0.1@a", "topics": ["T"]},
               {"client_id": "10.0.0.3@c", "topics": ["Other"]}]
    owners = cli.allocate_queues(doc, members, {"T": 5})
    # 5 queues over 2 sorted members: the first takes 3, the second 2; the third does not subscribe to T.
    assert [owners[("T", i)] for i in range(5)] == ["10.0.0.1@a"] * 3 + ["10.0.0.2@b"] * 2
    assert owners[("Gone", 3)] == "10.0.0.2@b"    # topic unknown to the node: the queues the offsets name
    assert cli.client_ip("10.0.0.1@a") == "10.0.0.1" and cli.client_ip("no-at-sign") == "no-at-sign"


STATS_LEADER = {"broker_name": "broker-a", "topics": [
    {"topic": "Orders", "in_tps": 0.0, "in_msg_24h": 0, "groups": []},
    {"topic": "TopicTest", "in_tps": 1200.5, "in_msg_24h": 90000, "groups": [
        {"group": "please_rename_unique_group_name", "accumulation": 27, "out_tps": 1100.25, "out_msg_24h": 80000},
        {"group": "idle_group", "accumulation": 130, "out_tps": 0.0, "out_msg_24h": 0}]}]}
STATS_FOLLOWER = {"broker_name": "broker-a", "topics": [
    {"topic": "Orders", "in_tps": 0.0, "in_msg_24h": 0, "groups": []},
    {"topic": "TopicTest", "in_tps": 0.0, "in_msg_24h": 0, "groups": [
        {"group": "please_rename_unique_group_name", "accumulation": 25, "out_tps": 12.5, "out_msg_24h": 700},
        {"group": "idle_group", "accumulation": 130, "out_tps": 0.0, "out_msg_24h": 0}]}]}


@pytest.mark.parametrize("case,extra", [("statsAll", []), ("statsAll_active", ["-a"])])
def test_stats_all_adds_up_every_reachable_member_and_takes_the_leaders_accumulation(case, extra, canned, tmp_path,
                                                                                     monkeypatch, capsys):
    answers = {"127.0.0.1:20911": STATS_FOLLOWER, "127.0.0.1:20921": STATS_LEADER}
    asked = []

    def fake_call(endpoint, method, path, doc=None):
        asked.append(endpoint)
        if (method, path) == ("GET", "/cluster/nodes"):
            return json.loads(json.dumps(NODES))
        assert (method, path) == ("GET", "/stats"), path
        return json.loads(json.dumps(answers[endpoint]))

    monkeypatch.setattr(cli, "call", fake_call)
    text = run(["statsAll", *extra], tmp_path)
    assert asked == [EP, "127.0.0.1:20921", EP], "the leader first; the unreachable member is not asked"
    assert "127.0.0.1:20901 unreachable" in capsys.readouterr().err
    path = os.path.join(GOLDEN, case + ".txt")
    if os.environ.get("MQSTORE_UPDATE_GOLDEN") == "1":
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        assert text == f.read(), f"{case}: output differs from {path}"
