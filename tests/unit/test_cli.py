"""`mqstore` admin verbs: golden output against a live in-process node app.

Method: the test_broker harness (in-memory log with deterministic store timestamps) served by
aiohttp on a free loopback port in a background thread; `mqstore.cli.main` talks to it over
HTTP exactly as from a shell. TZ is pinned to UTC so timestamps print the same everywhere.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time

import pytest
from aiohttp import web

from mqstore import cli
from node.api import make_app
from tests.integration.test_node_process import free_port
from tests.unit.test_broker import make_broker


@pytest.fixture
def endpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    port = free_port()
    ready, stop = threading.Event(), threading.Event()
    state: dict = {}

    async def serve():
        h = make_broker(str(tmp_path))
        await h.broker.start()
        runner = web.AppRunner(make_app(h.broker))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        state["h"] = h
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.02)
        await runner.cleanup()
        await h.broker.stop()

    t = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    t.start()
    assert ready.wait(10)
    yield f"127.0.0.1:{port}"
    stop.set()
    t.join(10)
    monkeypatch.delenv("TZ")
    time.tzset()


def run_cli(endpoint: str, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = cli.main([*args, "-n", endpoint], out=out)
    return rc, out.getvalue()


def settle(endpoint: str, topic: str, qid: int, want: int) -> None:
    for _ in range(200):
        doc = json.loads(run_cli(endpoint, "topicStatus", "-t", topic, "--json")[1])
        if doc["queues"][qid]["max_offset"] >= want:
            return
        time.sleep(0.01)
    raise AssertionError("not dispatched")


def test_golden_tables(endpoint):
    rc, out = run_cli(endpoint, "updateTopic", "-t", "TopicA", "-r", "2", "-w", "2")
    assert rc == 0 and out == (f"create topic to {endpoint} success.\n"
                               "TopicConfig [topicName=TopicA, readQueueNums=2, writeQueueNums=2, perm=6]\n")
    rc, out = run_cli(endpoint, "send", "-t", "TopicA", "-b", "hello", "--tags", "TagA", "--keys", "K1 K2",
                      "-q", "1")
    offset_id = "7F00000100002A9F00000000000000A6"
    assert out == (f"SendResult [sendStatus=SEND_OK, msgId={offset_id}, offsetMsgId={offset_id}, "
                   "messageQueue=MessageQueue [topic=TopicA, brokerName=broker-a, queueId=1], queueOffset=0]\n")
    settle(endpoint, "TopicA", 1, 1)
    assert run_cli(endpoint, "topicList") == (0, "TopicA\n")
    rc, out = run_cli(endpoint, "topicStatus", "-t", "TopicA")
    assert out == (
        "#Broker Name                      #QID  #Min Offset           #Max Offset             #Last Updated\n"
        "broker-a                          0     0                     0                       \n"
        "broker-a                          1     0                     1                       2023-11-14 22:13:20,166\n")
    rc, out = run_cli(endpoint, "queryMsgByKey", "-t", "TopicA", "-k", "K2")
    assert out == ("#Message ID" + " " * 40 + "#QID" + " " * 34 + "#Offset\n"
                   f"{offset_id}                      1                                        0\n")
    rc, out = run_cli(endpoint, "queryMsgByOffset", "-t", "TopicA", "-q", "1", "-o", "0")
    lines = out.splitlines()
    assert lines[:8] == [f"OffsetID:            {offset_id}", "Topic:               TopicA",
                         "Tags:                [TagA]", "Keys:                [K1 K2]", "Queue ID:            1",
                         "Queue Offset:        0", "CommitLog Offset:    166", "Reconsume Times:     0"]
    assert lines[9] == "Store Timestamp:     2023-11-14 22:13:20,166"
    assert lines[-2].startswith("Message Body Path:") and lines[-1] == "Message Body:        hello"
    rc, by_id = run_cli(endpoint, "queryMsgById", "-i", offset_id)
    assert by_id == out
    rc, out = run_cli(endpoint, "pull", "-t", "TopicA", "-q", "1", "-o", "0")
    assert out == ("status=FOUND next_offset=1 min_offset=0 max_offset=1 messages=1\n"
                   f"0          {offset_id}  tags=TagA  body=hello\n")
    rc, out = run_cli(endpoint, "brokerStatus")
    assert "status                          : UP\n" in out and "role                            : STANDALONE\n" in out


def test_json_flag_and_errors(endpoint, capsys):
    rc, out = run_cli(endpoint, "topicList", "--json")
    assert rc == 0 and json.loads(out) == {"topics": []}
    rc, out = run_cli(endpoint, "topicStatus", "-t", "Nope")
    assert rc == 1 and out == ""
    assert "ERROR: TOPIC_NOT_EXIST: topic 'Nope' does not exist [HTTP 404]" in capsys.readouterr().err
    rc, _ = run_cli("127.0.0.1:1", "topicList")
    assert rc == 1 and "cannot reach the node at 127.0.0.1:1" in capsys.readouterr().err


def test_controller_verb_passes_its_own_flags_through(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["controller", "--help"])
    assert e.value.code == 0
    assert "--data-dir" in capsys.readouterr().out


def _stub(answers: list[tuple[int, dict]]):
    """A JSON server answering each request with the next of `answers` (the last one repeats);
    its address and the paths it was asked."""
    from tests.json_stub import json_server
    asked: list[str] = []

    def answer(path: str) -> tuple[int, dict]:
        asked.append(path)
        return answers.pop(0) if len(answers) > 1 else answers[0]
    srv, addr = json_server(answer)
    return srv, addr, asked


def test_a_not_leader_answer_is_followed_or_waited_out_but_an_unknown_outcome_is_not_repeated(monkeypatch):
    """Regression (CI: the node printed as leader at start-up answered a send with NOT_LEADER
    and no leader, an election under way): the CLI follows a NOT_LEADER answer to the leader
    it names and tries again while none is named, for up to NO_LEADER_WAIT_S; an answer
    saying the outcome is unknown is an error at once (a retry could store a message twice)."""
    ok = (200, {"results": [{"status": "SEND_OK"}]})
    leader_srv, leader, leader_asked = _stub([ok])
    follower_srv, follower, _ = _stub([(421, {"error": "NOT_LEADER", "message": "not the leader",
                                              "leader": leader})])
    electing_srv, electing, electing_asked = _stub([
        (421, {"error": "NOT_LEADER", "message": "this node is not the leader"}),
        (421, {"error": "NOT_LEADER", "message": "this node is not the leader"}), ok])
    unknown_srv, unknown, unknown_asked = _stub([(421, {"error": "NOT_LEADER",
                                                        "message": "leadership lost; the outcome is unknown, retry"})])
    try:
        assert cli.call(follower, "POST", "/topics/T/messages", {"messages": []}) == ok[1]
        assert leader_asked == ["/topics/T/messages"]
        assert cli.call(electing, "POST", "/topics/T/messages", {"messages": []}) == ok[1]
        assert len(electing_asked) == 3
        with pytest.raises(cli.CliError, match="unknown"):
            cli.call(unknown, "POST", "/topics/T/messages", {"messages": []})
        assert len(unknown_asked) == 1
        monkeypatch.setattr(cli, "NO_LEADER_WAIT_S", 0.3)
        never_srv, never, _ = _stub([(421, {"error": "NOT_LEADER", "message": "this node is not the leader"})])
        with pytest.raises(cli.CliError, match="NOT_LEADER"):
            cli.call(never, "GET", "/topics")
        never_srv.shutdown()
    finally:
        for s in (leader_srv, follower_srv, electing_srv, unknown_srv):
            s.shutdown()


def test_query_by_unique_key_finds_the_producers_msg_id_and_query_by_id_falls_back_to_it(endpoint, capsys):
    """mqadmin queryMsgByUniqueKey -i msgId -t T; queryMsgById -i msgId -t T takes an id that is
    no offsetMsgId as a msgId. A message whose KEYS word equals the msgId is not a match."""
    uniq = "0A0000010B1C18B4AAC2627A51B40000"
    assert run_cli(endpoint, "updateTopic", "-t", "TopicU", "-r", "1", "-w", "1")[0] == 0
    doc = {"messages": [{"body": "the one", "queue_id": 0, "properties": {"UNIQ_KEY": uniq}},
                        {"body": "a namesake", "queue_id": 0, "keys": [uniq]}]}
    sent = cli.call(endpoint, "POST", "/topics/TopicU/messages", doc)["results"]
    assert sent[0]["msg_id"] == uniq and sent[1]["msg_id"] != uniq
    settle(endpoint, "TopicU", 0, 2)
    rc, out = run_cli(endpoint, "queryMsgByUniqueKey", "-t", "TopicU", "-i", uniq)
    assert rc == 0 and out.count("OffsetID:") == 1
    assert f"OffsetID:            {sent[0]['offset_msg_id']}\n" in out and out.endswith("Message Body:        the one\n")
    rc, by_id = run_cli(endpoint, "queryMsgById", "-i", uniq, "-t", "TopicU")
    assert rc == 0 and by_id == out
    rc, _ = run_cli(endpoint, "queryMsgById", "-i", uniq)               # no topic: an offsetMsgId only
    assert rc == 1 and "ERROR:" in capsys.readouterr().err
    rc, _ = run_cli(endpoint, "queryMsgByUniqueKey", "-t", "TopicU", "-i", "0A0000010B1C18B4AAC2627A51B4FFFF")
    assert rc == 1 and "no message with msgId 0A0000010B1C18B4AAC2627A51B4FFFF in topic TopicU" in \
        capsys.readouterr().err
