"""Goal: a DLedger group with `controllerAddr` reports its leader to the controller, so the
controller's routes (name-server role) point at the leader. Method: one controller process and
a single-node DLedger group (`python -m node`, it leads itself) on free loopback ports; the
test reads the controller's groups and a topic route. Expected: group mode "dledger", master
address = the node's API address, the route's queues point there."""

from __future__ import annotations

import os
import sys

import pytest

from tests.integration.test_ha_processes import ROOT, Group, free_ports, http, wait_for

pytestmark = pytest.mark.slow


def test_dledger_leader_reaches_controller_routes(tmp_path):
    g = Group(str(tmp_path))
    try:
        g.start_controller()
        api, raft = free_ports(2)
        conf = tmp_path / "dl.conf"
        conf.write_text("\n".join([
            "brokerClusterName=dl", "brokerName=broker-a", "enableDLegerCommitLog=true", "dLegerGroup=broker-a",
            f"dLegerPeers=n0-127.0.0.1:{raft}", "dLegerSelfId=n0", f"dLegerPeerApis=n0-127.0.0.1:{api}",
            f"storePathRootDir={tmp_path / 'dlstore'}", "mappedFileSizeCommitLog=1048576", "maxMessageSize=262144",
            f"listenPort={api}", "brokerIP1=127.0.0.1", "bindAddress=127.0.0.1",
            f"controllerAddr=127.0.0.1:{g.ctl_api}", ""]))
        g._spawn("dl", [sys.executable, "-m", "node", "-c", str(conf)])
        ctl = f"http://127.0.0.1:{g.ctl_api}"

        def leader_known():
            groups = {v["broker_name"]: v for v in http("GET", f"{ctl}/groups", timeout=2)[1].get("groups", [])}
            v = groups.get("broker-a")
            return v if v and v["master_addr"] == f"127.0.0.1:{api}" else None
        view = wait_for(leader_known, timeout=30, what="DLedger leader registered at the controller")
        assert view["mode"] == "dledger" and view["leader_term"] >= 1
        st, route = http("POST", f"{ctl}/topics", {"topic": "DlTopic", "queues": 2})
        assert st == 201, route
        assert {q["addr"] for q in route["queues"]} == {f"127.0.0.1:{api}"}
        # DLedger mode never turns classic HA on: no HA runtime in the node's status.
        st, cluster = http("GET", f"http://127.0.0.1:{api}/cluster")
        assert st == 200 and cluster["mode"] == "dledger" and "ha_runtime" not in cluster["log"]
    finally:
        g.stop_all()
