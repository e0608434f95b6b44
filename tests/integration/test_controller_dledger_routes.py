"""Goal: a DLedger group with `controllerAddr` reports its leader to the controller, so the
controller's routes (name-server role) point at the leader. Method: one controller process and
a single-node DLedger group (`python -m node`, it leads itself) on free loopback ports; the
test reads the controller's groups and a topic route. Expected: group mode "dledger", master
address = the node's API address, the route's queues point there."""

from __future__ import annotations

import pytest

from tests.integration.test_ha_processes import Group, http

pytestmark = pytest.mark.slow


def test_dledger_leader_reaches_controller_routes(tmp_path):
    g = Group(str(tmp_path))
    try:
        g.start_controller()
        api = g.start_dledger_node("dl")
        ctl = f"http://127.0.0.1:{g.ctl_api}"
        view = g.wait_registered("broker-a", f"127.0.0.1:{api}")     # the DLedger leader
        assert view["mode"] == "dledger" and view["leader_term"] >= 1
        st, route = http("POST", f"{ctl}/topics", {"topic": "DlTopic", "queues": 2})
        assert st == 201, route
        assert {q["addr"] for q in route["queues"]} == {f"127.0.0.1:{api}"}
        # DLedger mode never turns classic HA on: no HA runtime in the node's status.
        st, cluster = http("GET", f"http://127.0.0.1:{api}/cluster")
        assert st == 200 and cluster["mode"] == "dledger" and "ha_runtime" not in cluster["log"]
    finally:
        g.stop_all()
