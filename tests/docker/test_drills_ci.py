"""Goal: every failover drill, in a short form, passes against a real compose cluster in CI.

Expected outcome, per scenario (each with at least 30 s of load): no acked message lost, no
duplicate, phantom or changed read, replicas identical (divergence 0), the store audit ok;
failover (first ack of a send started after the fault is in place) within 4 s for the DLedger
group and 8 s for the classic group; disk_full fails sends with a clear disk-full error and
recovers; ACL is on (an unsigned request is refused with 401, /health stays open); the cluster
secret is on (an unsigned controller request is refused with 401, the brokers' signed ones pass).
Method: one compose project and subnet of its own (a developer's `make up` cluster is left
alone), the drill runner, `down -v` in a finally even when a test fails. Needs a Docker
engine and the image: `make test-docker` (or deploy/ci-docker.sh) provides both.
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request

import pytest

from deploy.drills.cluster import CONTROLLERS, GROUPS, Cluster, Compose, DrillError, docker_client

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]
PROJECT = f"mqstoreci{os.getpid() % 10000}"
LOAD_S = float(os.environ.get("MQSTORE_CI_DRILL_SECONDS", "30"))
FAILOVER_LIMIT_S = {"broker-a": 4.0, "broker-b": 8.0}
# scenarios whose fault is a failover (a leader/master lost while the others stay up)
FAILOVERS = ("kill_leader", "pause_leader", "partition_leader", "oneway_leader", "kill_master")


@pytest.fixture(scope="module")
def cluster():
    client = docker_client()
    client.images.get(os.environ.get("MQSTORE_IMAGE", "mqstore:latest"))   # ImageNotFound: run `make image`
    mp = pytest.MonkeyPatch()
    mp.setenv("MQSTORE_NET", f"172.30.{150 + os.getpid() % 100}")
    compose = Compose(PROJECT)
    try:
        compose.up()
        c = Cluster(PROJECT)
        c.wait_healthy([*GROUPS["broker-a"], *GROUPS["broker-b"], *CONTROLLERS], timeout_s=240)
        yield c
    finally:
        try:
            compose.down(volumes=True)
        finally:
            mp.undo()


def test_acl_is_on_by_default(cluster):
    api = cluster.nodes[cluster.leader("broker-a", timeout_s=30)].api
    with urllib.request.urlopen(f"http://{api}/health", timeout=5) as r:
        assert r.status == 200
    req = urllib.request.Request(f"http://{api}/topics", method="GET")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 401


def test_peer_auth_is_on_by_default(cluster):
    """The controllers want the cluster secret on their API (but probes and route lookups), and
    the brokers reached them with it: broker-b has a master, so its heartbeats were accepted."""
    from deploy.drills.cluster import SECRET_FILE
    from node.peer_auth import load_secret, sign_request
    cluster.leader("broker-b", timeout_s=30)
    api = cluster.nodes["c0"].api
    with urllib.request.urlopen(f"http://{api}/health", timeout=5) as r:
        assert r.status == 200
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://{api}/metadata", timeout=5)
    assert e.value.code == 401
    headers = sign_request(load_secret(secret_file=SECRET_FILE), "ci", "GET", "/metadata")
    with urllib.request.urlopen(urllib.request.Request(f"http://{api}/metadata", headers=headers), timeout=5) as r:
        assert r.status == 200


def _run(cluster, name: str, tmp_path) -> dict:
    from deploy.drills.runner import run
    from deploy.drills.scenarios import SCENARIOS
    sc = SCENARIOS[name]
    warmup = 5.0
    recovery = max(8.0, LOAD_S - warmup - sc.fault_s)
    t0 = time.monotonic()
    r = run(sc, str(tmp_path), warmup_s=warmup, recovery_s=recovery, rate_per_s=30, cluster=cluster)
    r["took_s"] = time.monotonic() - t0
    return r


@pytest.mark.parametrize("name", [*FAILOVERS, "restart_all", "rolling_restart", "disk_full", "disk_full_leader"])
def test_drill(cluster, name, tmp_path):
    from deploy.drills.scenarios import SCENARIOS
    try:
        r = _run(cluster, name, tmp_path)
    except DrillError as e:
        pytest.fail(f"{name}: the drill could not run: {e}")
    v = r["verdict"]
    detail = f"{r['summary']} load={r['load_avg']}"
    assert v["lost"] == {}, detail
    assert v["divergence"] == [], detail
    assert v["duplicates"] == {} and v["phantoms"] == {} and v["changed"] == {} and v["gaps"] == {}, detail
    assert r["converged_s"] is not None, detail
    assert r["store_audit"]["status"] in ("ok", "skipped"), r["store_audit"]
    assert r["scenario_problems"] == [], detail
    assert v["acked"] >= 100, f"too few acks for {LOAD_S:g} s of load: {detail}"
    if name in FAILOVERS:
        limit = FAILOVER_LIMIT_S[SCENARIOS[name].group]
        assert v["failover_s"] is not None and v["failover_s"] <= limit, f"failover > {limit} s: {detail}"
    else:       # a write started after the heal was acked
        assert v["recovery_s"] is not None, detail
    if name == "disk_full_leader":   # handed over to a node with room, where writes went on
        assert r["timeline"]["leader_after"] != r["timeline"]["victim"], f"the full leader kept its leadership: {detail}"
        assert r["timeline"]["acks_while_full"] > 0, detail
    assert r["ok"], detail
