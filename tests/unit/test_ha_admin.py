"""Goal: the HA admin verbs print mqadmin's layouts exactly (haStatus for a master and a slave,
getSyncStateSet, electMaster, getControllerMetaData), and `--json` prints the API document.
Method: golden strings for the pure formatters; the verbs end to end against a stub
controller and a stub node served by aiohttp on free loopback ports; TZ pinned to UTC."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time

import pytest
from aiohttp import web

from mqstore import admin_ha, cli
from tests.integration.test_node_process import free_port

MASTER_RT = {"master": True, "master_addr": "127.0.0.1:10911", "master_commit_log_max_offset": 123456,
             "slave_num": 2, "in_sync_slave_num": 1, "ha_connection_info": [
                 {"addr": "127.0.0.1:50001", "slave_ack_offset": 123456, "diff": 0,
                  "transferred_bytes_per_s": 2048.0, "in_sync": True, "transfer_from_where": 0},
                 {"addr": "127.0.0.1:50002", "slave_ack_offset": 1000, "diff": 122456,
                  "transferred_bytes_per_s": 0.0, "in_sync": False, "transfer_from_where": 0}]}
SLAVE_RT = {"master": False, "master_addr": "127.0.0.1:10911", "max_offset": 4096,
            "transferred_bytes_per_s": 512.0, "last_read_ms": 1_700_000_000_123, "last_write_ms": 0,
            "master_offset_seen": 8192}
VIEW = {"broker_name": "broker-b", "mode": "classic", "master_id": 0, "master_addr": "127.0.0.1:10911",
        "master_ha_addr": "127.0.0.1:10912", "master_epoch": 3, "sync_state_set": [0, 1], "sss_epoch": 5,
        "leader_term": 0, "broker_addrs": {"0": "127.0.0.1:10911", "1": "127.0.0.1:10921", "2": "127.0.0.1:10931"},
        "online": [0, 1]}


@pytest.fixture
def utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.delenv("TZ")
    time.tzset()


def test_ha_status_master_golden():
    assert admin_ha.ha_status_text(MASTER_RT) == (
        "\n#MasterAddr\t127.0.0.1:10911\n#MasterCommitLogMaxOffset\t123456\n#SlaveNum\t2\n#InSyncSlaveNum\t1\n"
        "#SlaveAddr                        #SlaveAckOffset             #Diff #TransferSpeed(KB/s)          #Status"
        " #TransferFromWhere\n"
        "127.0.0.1:50001                   123456                          0             2.00               OK"
        "                0\n"
        "127.0.0.1:50002                   1000                       122456             0.00      Fall Behind"
        "                0\n")


def test_ha_status_slave_golden(utc):
    assert admin_ha.ha_status_text(SLAVE_RT) == (
        "\n#MasterAddr\t127.0.0.1:10911\n#CommitLogMaxOffset\t4096\n#TransferSpeed(KB/s)\t0.50\n"
        "#LastReadTime\t2023-11-14 22:13:20,123\n#LastWriteTime\t\n#MasterFlushOffset\t8192\n")


def test_get_sync_state_set_golden():
    assert admin_ha.sync_state_set_text(VIEW, {0, 1}) == (
        "\n#brokerName\tbroker-b\n#MasterAddr\t127.0.0.1:10911\n#MasterEpoch\t3\n#SyncStateSetEpoch\t5\n"
        "#SyncStateSetNums\t2\n"
        "\n InSyncReplica:\tReplicaIdentity{brokerName='broker-b', brokerId=0, brokerAddress='127.0.0.1:10911'}"
        "\tonline\n"
        "\n InSyncReplica:\tReplicaIdentity{brokerName='broker-b', brokerId=1, brokerAddress='127.0.0.1:10921'}"
        "\tonline\n"
        "\n NotInSyncReplica:\tReplicaIdentity{brokerName='broker-b', brokerId=2, brokerAddress='127.0.0.1:10931'}"
        "\toffline\n")


def test_elect_master_and_metadata_golden():
    doc = {"broker_name": "broker-b", "master_addr": "127.0.0.1:10921", "master_epoch": 4, "sss_epoch": 6}
    assert admin_ha.elect_master_text("c1", doc, {"1": "127.0.0.1:10921", "0": "127.0.0.1:10911"}) == (
        "\n#ClusterName\tc1\n#BrokerName\tbroker-b\n#BrokerMasterAddr\t127.0.0.1:10921\n#MasterEpoch\t4\n"
        "#SyncStateSetEpoch\t6\n\t#Broker\t0\t127.0.0.1:10911\n\t#Broker\t1\t127.0.0.1:10921\n")
    assert admin_ha.controller_metadata_text("g", "127.0.0.1:9878", "127.0.0.1:9876", ["a:1", "b:2"]) == (
        "\n#ControllerGroup\tg\n#ControllerLeaderId\t127.0.0.1:9878\n#ControllerLeaderAddress\t127.0.0.1:9876"
        "\n#Peer:\ta:1\n#Peer:\tb:2\n")


@pytest.fixture
def stub():
    """A stub controller + node on one free port, recording the electMaster request."""
    port = free_port()
    seen: dict = {}
    ready, stop = threading.Event(), threading.Event()

    async def groups(_):
        return web.json_response({"groups": [VIEW]})

    async def health(_):
        return web.json_response({"status": "ok", "leader": f"127.0.0.1:{port}"})

    async def metadata(_):
        return web.json_response({"leader": f"127.0.0.1:{port}", "raft": {"leader": "127.0.0.1:9878"},
                                  "group": "mqstore-controller", "peers": [f"127.0.0.1:{port}"]})

    async def elect(request):
        seen["elect"] = (request.match_info["group"], await request.json())
        return web.json_response({"broker_name": "broker-b", "master_id": 1, "master_addr": "127.0.0.1:10921",
                                  "master_epoch": 4, "sync_state_set": [1]})

    async def cluster(_):
        return web.json_response({"mode": "classic", "log": {"ha_runtime": MASTER_RT}})

    async def serve():
        app = web.Application()
        app.router.add_get("/groups", groups)
        app.router.add_get("/health", health)
        app.router.add_get("/metadata", metadata)
        app.router.add_post("/groups/{group}/elect-master", elect)
        app.router.add_get("/cluster", cluster)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.02)
        await runner.cleanup()

    t = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    t.start()
    assert ready.wait(10)
    yield f"127.0.0.1:{port}", seen
    stop.set()
    t.join(10)


def run(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    return cli.main(list(args), out=out), out.getvalue()


def test_verbs_end_to_end_against_stub(stub):
    addr, seen = stub
    rc, text = run("getSyncStateSet", "-a", addr, "-b", "broker-b")
    assert rc == 0 and text == admin_ha.sync_state_set_text(VIEW, {0, 1})
    rc, text = run("getSyncStateSet", "-a", addr, "-b", "broker-b", "--json")
    assert rc == 0 and json.loads(text)["sync_state_set"] == [0, 1]
    rc, text = run("haStatus", "-n", addr)
    assert rc == 0 and text == admin_ha.ha_status_text(MASTER_RT)
    rc, text = run("electMaster", "-a", addr, "-b", "broker-b", "-i", "1")
    assert rc == 0 and "#BrokerMasterAddr\t127.0.0.1:10921" in text and "#SyncStateSetEpoch\t5" in text
    assert seen["elect"] == ("broker-b", {"broker_id": 1})
    rc, text = run("getControllerMetaData", "-a", addr)
    assert rc == 0 and text.startswith("\n#ControllerGroup\tmqstore-controller\n#ControllerLeaderId\t127.0.0.1:9878")


def test_unknown_group_is_a_clear_error(stub, capsys):
    addr, _ = stub
    rc, _ = run("getSyncStateSet", "-a", addr, "-b", "nope")
    assert rc == 1 and "knows no broker group 'nope'" in capsys.readouterr().err


def test_unreachable_controller_is_a_clear_error(capsys):
    rc, _ = run("getControllerMetaData", "-a", f"127.0.0.1:{free_port()}")
    assert rc == 1 and "cannot reach" in capsys.readouterr().err
