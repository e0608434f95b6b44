"""`mqstore cluster up --mode classic`: three controllers and a master/slave group on loopback.

Method: the real command (`python -m mqstore.cli cluster up --mode classic --detach`) on free
loopback ports. The master it prints is n0 (started first) and the controllers' master; once
it returns the slave is in the SyncStateSet, and the commands it prints work
(updateTopic, send, pull, haStatus with the slave in sync, getSyncStateSet with both brokers,
clusterList with both brokers from either);
a kill -9 of the master makes the controllers elect the slave, which stores a send, and the
message sent before the kill is on it; `cluster down` ends exactly the five processes it
started. With --secure the brokers check the ACL and the controllers the cluster secret, and
the exports it prints are what the CLI needs.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal

import pytest

from mqstore import cli
from mqstore import cluster as mc
from mqstore import localcluster as lc
from tests.integration.cluster_cli import cluster_up


def classic_ports(base: int) -> list[int]:
    """Every port of `cluster up --mode classic --base-port base`: brokers' stream, API and HA
    ports, controllers' API and Raft ports."""
    ctls = mc.plan_controllers("/", base)
    return [base + 10 * i + d for i in range(2) for d in (-2, 0, 1)] + [p for c in ctls for p in (c.api_port, c.raft_port)]


@pytest.fixture
def classic_cluster(tmp_path):
    d = str(tmp_path / "c")
    with cluster_up(d, classic_ports, 5, "--mode", "classic") as out:
        yield d, out


def cli_json(*argv: str) -> dict:
    buf = io.StringIO()
    assert cli.main([*argv, "--json"], out=buf) == 0, buf.getvalue()
    return json.loads(buf.getvalue())


def test_classic_cluster_up_prints_working_commands_and_fails_over(classic_cluster):
    d, out = classic_cluster
    state = json.load(open(os.path.join(d, mc.STATE_FILE)))
    assert state["mode"] == "classic" and len(state["pids"]) == 5 and len(state["apis"]) == 2
    master = re.search(r"master: (127\.0\.0\.1:\d+)", out).group(1)
    assert master == state["apis"][0]                      # n0, started first, is elected
    slave = state["apis"][1]
    ctl = re.search(r"getSyncStateSet -a '([^']+)' -b broker-a", out).group(1)
    assert ctl.split(";") == state["controllers"]

    cli_json("updateTopic", "-n", master, "-t", "TopicTest", "-w", "2")
    sent = cli_json("send", "-n", master, "-t", "TopicTest", "-b", "before-failover")["results"][0]
    assert sent["status"] == "SEND_OK", sent                       # SYNC_MASTER: the slave has it
    pulled = cli_json("pull", "-n", master, "-t", "TopicTest", "-q", str(sent["queue_id"]), "-o", "0")
    assert [m["body"] for m in pulled["messages"]] == ["before-failover"]
    ha = cli_json("haStatus", "-n", master)
    assert ha["master"] and [(c["broker_id"], c["in_sync"]) for c in ha["ha_connection_info"]] == [(1, True)], ha
    sss = cli_json("getSyncStateSet", "-a", ctl, "-b", "broker-a")
    assert sorted(sss["sync_state_set"]) == [0, 1] and sss["master_addr"] == master, sss
    for ep in (master, slave):                     # either broker lists the group (mqadmin clusterList)
        nodes = lc.wait_for(lambda: (lambda d: d["nodes"] if len(d["nodes"]) == 2 else None)(
            cli_json("clusterList", "-n", ep)), 10, f"both brokers listed by {ep}")
        assert [(n["api"], n["reachable"], n["cluster"]["role"]) for n in nodes] == [
            (master, True, "MASTER"), (slave, True, "SLAVE")], nodes

    os.kill(state["pids"][3], signal.SIGKILL)                # controllers c0-c2, then n0, n1
    lc.wait_for(lambda: (lc.health(slave) or {}).get("role") == "MASTER", 20, f"{slave} elected master")
    after = lc.wait_for(lambda: (lambda doc: doc if doc and doc.get("results") else None)(
        lc.http(slave, "POST", "/topics/TopicTest/messages",
                {"messages": [{"body": "after-failover", "queue_id": sent["queue_id"]}]}, timeout=3)[1]),
        15, "a send stored by the new master")
    assert after["results"][0]["status"] in ("SEND_OK", "SLAVE_NOT_AVAILABLE"), after   # its slave is dead
    path = f"/topics/TopicTest/queues/{sent['queue_id']}/messages?offset=0&max=32"
    lc.wait_for(lambda: [m["body"] for m in lc.http(slave, "GET", path)[1]["messages"]]
                == ["before-failover", "after-failover"], 10, "both messages on the new master")
    assert cli_json("getSyncStateSet", "-a", ctl, "-b", "broker-a")["master_addr"] == slave


def test_secure_classic_cluster_signs_everything_and_prints_what_it_takes(tmp_path, monkeypatch):
    """--secure: the brokers check the ACL and the controllers the cluster secret; the printed
    exports are what the CLI needs, unsigned requests are refused, and the controllers'
    SyncStateSet is complete when the command returns (it asked them, signed)."""
    d = str(tmp_path / "s")
    with cluster_up(d, classic_ports, 5, "--mode", "classic", "--secure") as out:
        keys = re.search(r"export MQSTORE_ACCESS_KEY=(\S+) MQSTORE_SECRET_KEY=(\S+)", out)
        secret_file = re.search(r"export MQSTORE_CLUSTER_SECRET_FILE=(\S+)", out).group(1)
        assert keys and secret_file == os.path.join(d, mc.SECRET_FILE) and "Not every slave" not in out, out
        state = json.load(open(os.path.join(d, mc.STATE_FILE)))
        master, ctl = state["apis"][0], ";".join(state["controllers"])
        st, err = lc.http(master, "POST", "/topics", {"topic": "Sneaky", "queues": 1})
        assert st == 401 and err["error"] == "UNAUTHENTICATED", err
        st, err = lc.http(state["controllers"][0], "GET", "/groups/broker-a/sync-state-set")
        assert st == 401, err
        monkeypatch.setenv("MQSTORE_ACCESS_KEY", keys.group(1))
        monkeypatch.setenv("MQSTORE_SECRET_KEY", keys.group(2))
        monkeypatch.setenv("MQSTORE_CLUSTER_SECRET_FILE", secret_file)
        cli_json("updateTopic", "-n", master, "-t", "TopicTest", "-w", "1")
        assert cli_json("send", "-n", master, "-t", "TopicTest", "-b", "signed")["results"][0]["status"] == "SEND_OK"
        assert sorted(cli_json("getSyncStateSet", "-a", ctl, "-b", "broker-a")["sync_state_set"]) == [0, 1]
        assert [n["reachable"] for n in cli_json("clusterList", "-n", master)["nodes"]] == [True, True]
        cli_json("electMaster", "-a", ctl, "-b", "broker-a", "-i", "1")
        lc.wait_for(lambda: (lc.health(state["apis"][1]) or {}).get("role") == "MASTER", 15, "broker 1 master")
        for i in range(2):
            log = open(os.path.join(d, f"n{i}", "node.log")).read() + open(os.path.join(d, f"c{i}", "controller.log")).read()
            assert "without a cluster secret" not in log


def test_async_master_with_one_controller_acks_from_the_master_and_fails_over(tmp_path):
    """--broker-role ASYNC_MASTER --controllers 1: three processes; the brokers' role is
    ASYNC_MASTER (haStatus and the printed banner say so), a send is acked, and a kill -9 of the
    master still makes the one controller elect the slave, which holds the message."""
    d = str(tmp_path / "a")
    with cluster_up(d, classic_ports, 3, "--mode", "classic", "--broker-role", "ASYNC_MASTER",
                    "--controllers", "1") as out:
        state = json.load(open(os.path.join(d, mc.STATE_FILE)))
        assert len(state["pids"]) == 3 and len(state["controllers"]) == 1, state
        assert "ASYNC_MASTER" in out and "1 controller(s)" in out, out
        master, slave = state["apis"]
        for i in range(2):
            assert "brokerRole=ASYNC_MASTER" in open(os.path.join(d, f"n{i}", "broker.conf")).read()
        cli_json("updateTopic", "-n", master, "-t", "TopicTest", "-w", "1")
        sent = cli_json("send", "-n", master, "-t", "TopicTest", "-b", "async")["results"][0]
        assert sent["status"] == "SEND_OK", sent
        path = "/topics/TopicTest/queues/0/messages?offset=0&max=32"
        lc.wait_for(lambda: (lc.health(slave) or {}).get("committed_offset", 0)
                    >= (lc.health(master) or {}).get("committed_offset", 1), 10, "the slave caught up")
        os.kill(state["pids"][1], signal.SIGKILL)                # the controller, then n0, n1
        lc.wait_for(lambda: (lc.health(slave) or {}).get("role") == "MASTER", 20, f"{slave} elected master")
        assert [m["body"] for m in lc.http(slave, "GET", path)[1]["messages"]] == ["async"]
