"""Drill harness health gate: a controller whose Raft state machine is not ready (it answers
/health with ready=false, as after a restart from a compacted journal) must not count as
healthy, or kill_master runs against controllers that can never elect."""

import pytest

from deploy.drills.cluster import Cluster, DrillError, Node, service_healthy


def test_service_healthy_rules():
    assert service_healthy("node", {"status": "ok"})
    assert not service_healthy("node", None)
    assert service_healthy("controller", {"status": "ok", "ready": True})
    assert not service_healthy("controller", {"status": "ok", "ready": False})
    assert not service_healthy("controller", {"status": "ok"})
    assert not service_healthy("controller", None)


class _FakeCluster(Cluster):
    def __init__(self, answers):
        self.nodes = {s: Node(s, "controller" if s.startswith("c") else "node", "10.0.0.1", "127.0.0.1:1")
                      for s in answers}
        self.answers = answers

    def refresh(self):
        pass

    def health(self, service, timeout=1.0):
        return self.answers[service]


def test_wait_healthy_rejects_controller_not_ready():
    c = _FakeCluster({"b0": {"status": "ok"}, "c0": {"status": "ok", "ready": False}})
    with pytest.raises(DrillError, match=r"\['c0'\].*ready=true"):
        c.wait_healthy(["b0", "c0"], timeout_s=0.6)


def test_wait_healthy_accepts_ready_controller():
    c = _FakeCluster({"b0": {"status": "ok"}, "c0": {"status": "ok", "ready": True}})
    assert c.wait_healthy(["b0", "c0"], timeout_s=5) < 1.0
