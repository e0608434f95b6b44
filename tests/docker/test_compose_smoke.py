"""Goal: the compose cluster comes up healthy from `docker-compose.yml` and a real failover
drill passes against it. Expected outcome: every service healthy, one leader in broker-a and
one master in broker-b; the kill_leader drill loses no acked message, reads no duplicate or
phantom, the replicas and their consume queues agree, and a write is acked after the kill.
Method: its own compose project and subnet (so a developer's `make up` cluster is untouched),
the drill runner with short windows, then `down -v`. Needs a Docker engine and the image
(`make test-docker` builds it)."""

from __future__ import annotations

import json
import os

import pytest

from deploy.drills.cluster import CONTROLLERS, GROUPS, Cluster, Compose, docker_client

pytestmark = [pytest.mark.docker, pytest.mark.timeout(900)]
PROJECT = f"mqstoretest{os.getpid() % 10000}"


@pytest.fixture(scope="module")
def cluster():
    client = docker_client()
    image = os.environ.get("MQSTORE_IMAGE", "mqstore:latest")
    client.images.get(image)          # raises ImageNotFound with a clear name: run `make image`
    mp = pytest.MonkeyPatch()
    mp.setenv("MQSTORE_NET", f"172.30.{100 + os.getpid() % 100}")
    compose = Compose(PROJECT)
    compose.up()
    try:
        c = Cluster(PROJECT)
        c.wait_healthy([*GROUPS["broker-a"], *GROUPS["broker-b"], *CONTROLLERS], timeout_s=180)
        yield c
    finally:
        compose.down(volumes=True)
        mp.undo()


def test_cluster_is_healthy_with_one_leader_per_group(cluster):
    assert cluster.leader("broker-a", timeout_s=30) in GROUPS["broker-a"]
    assert cluster.leader("broker-b", timeout_s=30) in GROUPS["broker-b"]
    for s in (*GROUPS["broker-a"], *GROUPS["broker-b"]):
        assert cluster.nodes[s].api.startswith("127.0.0.1:"), "API published on loopback only"


def test_kill_leader_drill_passes(cluster, tmp_path):
    from deploy.drills.runner import run
    from deploy.drills.scenarios import SCENARIOS
    r = run(SCENARIOS["kill_leader"], str(tmp_path), warmup_s=3, recovery_s=6, rate_per_s=30, cluster=cluster)
    v = r["verdict"]
    assert r["ok"], r["summary"]
    assert v["lost"] == {} and v["duplicates"] == {} and v["phantoms"] == {}
    assert v["failover_s"] is not None
    assert r["store_audit"]["status"] in ("ok", "skipped")
    for key in ("json", "png", "html"):
        assert os.path.getsize(r["paths"][key]) > 0
    assert json.load(open(r["paths"]["json"]))["scenario"] == "kill_leader"
