"""Goal: a topic created on the controller reaches the brokers of its group (the classic
name-server role), through the broker's own replicated topic path.
Expected outcome: with a real controller process and a classic master + slave (controllerAddr,
autoCreateTopicEnable=false) on loopback, a send to a topic the broker lacks fails; after
`POST /topics` on the controller the master creates it from its heartbeat replies within a few
seconds, the send succeeds, the slave holds the topic (replicated, not written by the slave
itself), a later larger queue count grows the topic, and the broker's own topics stay.
Method: processes via mqstore.localcluster, free ports, a private tmp dir."""

from __future__ import annotations

import os

import pytest

from mqstore import localcluster as lc
from mqstore.localcluster import free_ports, wait_for
from mqstore.localcluster import request as http

pytestmark = pytest.mark.slow

GROUP = "broker-t"


def _topics(port: int) -> dict[str, dict]:
    st, r = http("GET", f"http://127.0.0.1:{port}/topics", timeout=2)
    return {t["topic"]: t for t in r.get("topics", [])} if st == 200 else {}


def _role(port: int) -> str | None:
    h = lc.health(port)
    return h.get("role") if h else None


def test_controller_topic_reaches_master_and_slave(tmp_path):
    tmp = str(tmp_path)
    ctl_api, ctl_raft, api0, ha0, api1, ha1 = free_ports(6)
    ctl = lc.Proc(lc.controller_argv(ctl_api, ctl_raft, os.path.join(tmp, "ctl"), heartbeat_timeout_ms=3000),
                  os.path.join(tmp, "ctl.log"), "ctl")
    nodes: list[lc.NodeProc] = []
    try:
        ctl.start()
        wait_for(lambda: (lambda h: h and h.get("role") == "LEADER" and h.get("ready"))(
            lc.get_ok(ctl_api, "/health")), timeout=30, what="controller leader")
        for b, (api, ha, role) in enumerate([(api0, ha0, "ASYNC_MASTER"), (api1, ha1, "SLAVE")]):
            conf = lc.write_conf(os.path.join(tmp, f"b{b}.conf"), lc.node_lines(api, os.path.join(tmp, f"store{b}"), [
                f"brokerName={GROUP}", "autoCreateTopicEnable=false", "brokerClusterName=t",
                *lc.classic_lines(b, role, ha, f"127.0.0.1:{ctl_api}")]))
            nodes.append(lc.NodeProc(conf, api, os.path.join(tmp, f"b{b}.log"), f"b{b}").launch())
        wait_for(lambda: _role(api0) == "MASTER", timeout=30, what="broker 0 elected master")
        wait_for(lambda: _role(api1) == "SLAVE", timeout=30, what="broker 1 slave")

        # A topic the broker made itself; the controller never names it and it must stay.
        st, _ = http("POST", f"http://127.0.0.1:{api0}/topics", {"topic": "LocalOnly", "queues": 1})
        assert st in (200, 201)

        send = {"messages": [{"body": "hello", "queue_id": 2}]}
        st, r = http("POST", f"http://127.0.0.1:{api0}/topics/CtlTopic/messages", send)
        assert st == 404, (st, r)   # unknown before the controller has it (no auto-create)

        st, r = http("POST", f"http://127.0.0.1:{ctl_api}/topics", {"topic": "CtlTopic", "queues": 4, "perm": 6})
        assert st == 201, r
        assert r["queue_datas"] == [{"broker_name": GROUP, "queue_ids": [0, 1, 2, 3], "perm": 6}]

        t = wait_for(lambda: _topics(api0).get("CtlTopic"), timeout=10, what="CtlTopic on the master")
        assert (t["read_queue_nums"], t["write_queue_nums"], t["perm"]) == (4, 4, 6)
        st, r = http("POST", f"http://127.0.0.1:{api0}/topics/CtlTopic/messages", send)
        assert st == 200, (st, r)
        # The slave gets it through replication of the master's topic record.
        wait_for(lambda: _topics(api1).get("CtlTopic"), timeout=10, what="CtlTopic on the slave")

        # More queues on the controller: the broker grows the topic, never shrinks or deletes.
        st, r = http("POST", f"http://127.0.0.1:{ctl_api}/topics", {"topic": "CtlTopic", "queues": 6})
        assert st == 201, r
        wait_for(lambda: (_topics(api0).get("CtlTopic") or {}).get("write_queue_nums") == 6, timeout=10,
                 what="CtlTopic grown to 6 queues")
        st, r = http("POST", f"http://127.0.0.1:{api0}/topics/CtlTopic/messages",
                     {"messages": [{"body": "q5", "queue_id": 5}]})
        assert st == 200, (st, r)
        assert "LocalOnly" in _topics(api0)
        wait_for(lambda: (_topics(api1).get("CtlTopic") or {}).get("write_queue_nums") == 6, timeout=10,
                 what="grown topic on the slave")

        # Regression: the controller accepted names every broker rejects, so they could never arrive.
        for bad in ({"topic": "RMQ_SYS_X", "queues": 1}, {"topic": "bad topic!", "queues": 1},
                    {"topic": "T2", "queues": 1, "perm": "rw"}, {"topic": "T3", "queues": 100000},
                    {"topic": "T4", "queues": 1, "groups": "broker-t"}):
            st, r = http("POST", f"http://127.0.0.1:{ctl_api}/topics", bad)
            assert st == 400 and r["error"] == "INVALID_TOPIC", (bad, st, r)
    except BaseException:
        for p in [ctl, *nodes]:
            print(f"--- {p.name}\n{p.tail(3000)}")
        raise
    finally:
        for p in [*reversed(nodes), ctl]:
            p.stop(10)
