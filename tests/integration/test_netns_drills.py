"""Goal: the failover drills of the docker tier run unchanged against the netns tier (node
processes in network namespaces on one host, no Docker), and pass.
Expected outcome: kill_leader (DLedger) and kill_master (classic, via the controllers) each run
>= 30 s of load with zero lost acks, zero duplicates/phantoms, zero divergence, a clean store
audit, failover <= 4 s (DLedger) / <= 8 s (classic); disk_full_leader (the DLedger leader's
disk filled) the same without a failover, sends refused with 507 until space returns; the
iptables shapes cut what they say;
teardown leaves no namespace, link or iptables rule behind, also for a run that died.
Method: one NetnsCluster for the module (3 controllers, broker-a x3, broker-b x2 on 10.213.N.x),
the shared runner/scenarios/workload/checker. Needs root with `ip netns` and iptables: when
that is missing the tests FAIL with the reason (they are not skipped)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from deploy.drills.control import PROTOCOL_MEMBERS, ClusterControl

pytestmark = [pytest.mark.netns, pytest.mark.timeout(400)]
MIN_LOAD_S = 30.0
WARMUP_S, RECOVERY_S, RATE = 6.0, 17.0, 30.0   # + the 8 s fault window: 31 s of load


def _usable() -> str | None:
    from deploy.netns import net
    try:
        net.preflight()
    except net.NetnsError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def cluster():
    why = _usable()
    if why:
        pytest.fail(f"netns tier cannot run on this host: {why}", pytrace=False)
    from deploy.netns.cluster import NetnsCluster
    with NetnsCluster() as c:
        yield c


def test_both_tiers_implement_the_cluster_control_protocol():
    from deploy.drills.cluster import Cluster
    from deploy.netns.cluster import NetnsCluster
    for cls in (Cluster, NetnsCluster):
        missing = [m for m in PROTOCOL_MEMBERS if m != "nodes" and not callable(getattr(cls, m, None))]
        assert not missing, f"{cls.__name__} lacks {missing}"
    assert set(PROTOCOL_MEMBERS) - {"nodes"} <= {n for n in dir(ClusterControl) if not n.startswith("_")}


def _run(cluster, name, tmp_path):
    from deploy.drills.runner import run
    from deploy.drills.scenarios import SCENARIOS
    r = run(SCENARIOS[name], str(tmp_path), warmup_s=WARMUP_S, recovery_s=RECOVERY_S, rate_per_s=RATE, cluster=cluster)
    with open(os.path.join(os.path.dirname(r["paths"]["json"]), "history.jsonl")) as f:
        hist = [json.loads(ln) for ln in f]
    sends = [e["t"] for e in hist if e["type"] == "send"]
    load_s = max(sends) - min(sends)
    print(f"{name}: {r['summary']} load_s={load_s:.1f} load_avg={r['load_avg']:.2f}")
    return r, load_s


def _assert_clean(r, load_s, failover_max_s):
    v = r["verdict"]
    assert load_s >= MIN_LOAD_S, f"only {load_s:.1f} s of load"
    assert v["lost"] == {}, v["lost"]
    assert v["duplicates"] == {} and v["phantoms"] == {} and v["changed"] == {} and v["gaps"] == {}
    assert v["divergence"] == [], v["divergence"]
    assert r["converged_s"] is not None, "replicas never agreed on the committed offset"
    assert r["store_audit"]["status"] == "ok", r["store_audit"]
    assert v["failover_s"] is not None, "no write acked after the fault"
    assert v["failover_s"] <= failover_max_s, f"failover {v['failover_s']:.2f} s > {failover_max_s} s"
    assert r["timeline"]["leader_after"] in ("a0", "a1", "a2", "b0", "b1")
    assert r["ok"], r["summary"]
    for key in ("json", "png", "html"):
        assert os.path.getsize(r["paths"][key]) > 0


def test_kill_leader_drill(cluster, tmp_path):
    r, load_s = _run(cluster, "kill_leader", tmp_path)
    _assert_clean(r, load_s, 4.0)
    assert r["timeline"]["victim"] == r["timeline"]["leader_before"]


def test_kill_master_drill(cluster, tmp_path):
    r, load_s = _run(cluster, "kill_master", tmp_path)
    _assert_clean(r, load_s, 8.0)
    assert r["timeline"]["leader_after"] != r["timeline"]["victim"], "the slave was not elected"


def test_disk_full_leader_drill(cluster, tmp_path):
    """The DLedger leader's store (its small tmpfs) filled to 100 %: it refuses sends with the
    disk-full 507 and hands leadership to a node with room, where writes continue (its own step
    down waits on the full disk: it stops claiming leadership meanwhile); nothing is lost."""
    r, load_s = _run(cluster, "disk_full_leader", tmp_path)
    v = r["verdict"]
    assert load_s >= MIN_LOAD_S, f"only {load_s:.1f} s of load"
    assert v["lost"] == {} and v["divergence"] == [], r["summary"]
    assert v["duplicates"] == {} and v["phantoms"] == {} and v["changed"] == {} and v["gaps"] == {}
    assert r["scenario_problems"] == [], r["scenario_problems"]   # a 507 disk-full send, an ack after
    assert v["recovery_s"] is not None, "no write acked after the space came back"
    assert r["timeline"]["leader_after"] != r["timeline"]["victim"], "the full leader kept its leadership"
    assert r["timeline"]["acks_while_full"] > 0
    assert r["store_audit"]["status"] == "ok", r["store_audit"]
    assert r["ok"], r["summary"]


def _reach(cluster, src: str, dst: str) -> bool:
    """Can `src` open a TCP connection to `dst`'s API port, from inside src's namespace?"""
    host, port = cluster.nodes[dst].api.rsplit(":", 1)
    code = f"import socket; socket.create_connection(({host!r}, {port}), timeout=1.0).close()"
    r = subprocess.run(["ip", "netns", "exec", cluster.net.ns(src), sys.executable, "-c", code],
                       capture_output=True, timeout=15)
    return r.returncode == 0


def test_iptables_shapes_cut_what_they_say(cluster):
    """Controllers only (broker groups untouched): bridge, one-way, full isolation, then heal."""
    assert _reach(cluster, "c0", "c2") and _reach(cluster, "c2", "c0")
    cluster.bridge("c1", ["c0"], ["c2"])
    try:
        assert not _reach(cluster, "c0", "c2") and not _reach(cluster, "c2", "c0")
        assert _reach(cluster, "c0", "c1") and _reach(cluster, "c2", "c1") and _reach(cluster, "c1", "c0")
    finally:
        cluster.heal(["c0", "c1", "c2"])
    assert _reach(cluster, "c0", "c2")
    cluster.iptables_drop_from("c0", ["c1"])        # c0 hears nothing from c1: no SYN-ACK either way
    try:
        assert not _reach(cluster, "c1", "c0") and not _reach(cluster, "c0", "c1")
        assert _reach(cluster, "c0", "c2")
    finally:
        cluster.iptables_flush("c0")
    token = cluster.disconnect("c2")
    try:
        assert cluster.health("c2", timeout=1.0) is None, "the drill client still reaches an isolated node"
        assert not _reach(cluster, "c0", "c2")
    finally:
        cluster.reconnect("c2", token)
    cluster.wait_healthy(["c0", "c1", "c2"], timeout_s=30)


def test_down_removes_everything_it_made(cluster):
    from deploy.netns import net
    pids = [cluster.pid(s) for s in cluster.nodes]
    assert all(pids)
    names = [cluster.net.ns(s) for s in cluster.nodes]
    assert cluster.down() == []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    rules = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True).stdout
    assert not [n for n in names if n in listed]
    assert cluster.tag not in links and f"{net.RULE_PREFIX}{cluster.tag}" not in rules
    assert not [p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in _state(p)]
    assert not os.path.exists(cluster.workdir)
    with open("/proc/mounts") as f:
        assert cluster.workdir not in f.read(), "a small-disk tmpfs is still mounted"
    from deploy.drills import cluster as dc
    assert dc.CREDENTIALS == cluster._creds_before, "the drill credentials were not restored"


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_clean_leftovers_removes_only_dead_runs():
    """A run killed before its cleanup leaves a namespace, veth, bridge and rule; `clean` removes
    them, and leaves a live run's alone."""
    why = _usable()
    if why:
        pytest.fail(f"netns tier cannot run on this host: {why}", pytrace=False)
    from deploy.netns import net
    with open("/proc/sys/kernel/pid_max") as f:
        dead_pid = int(f.read()) + 1                  # no process can have it
    dead = net.Net(f"{dead_pid}x0", net.pick_subnet(f"{dead_pid}x0"), {"t0": 5})
    live = None
    try:
        dead.up()
        tag = net.new_tag()
        live = net.Net(tag, net.pick_subnet(tag), {"t0": 5})     # picked after dead's subnet is taken
        live.up()
        removed = net.clean_leftovers()
        assert any(dead.ns("t0") in x for x in removed) and any(dead.bridge in x for x in removed)
        assert any(f"{net.RULE_PREFIX}{dead.tag}" in x for x in removed)
        assert not [x for x in removed if live.tag in x]
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert live.ns("t0") in listed and dead.ns("t0") not in listed
    finally:
        dead.down()
        assert live is None or live.down() == []


def test_preflight_names_the_missing_privilege(monkeypatch):
    from deploy.netns import net
    monkeypatch.setattr(net.os, "geteuid", lambda: 1000)
    with pytest.raises(net.NetnsError, match="needs root"):
        net.preflight()


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start_cli_cluster():
    """`python -m deploy.drills --tier netns up` in the background; (process, tag) once it is up."""
    p = subprocess.Popen([sys.executable, "-m", "deploy.drills", "--tier", "netns", "up"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline, out, tag = time.monotonic() + 120, [], None
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        out.append(line)
        m = re.search(r"tag (\d+x\d)", line)
        tag = tag or (m.group(1) if m else None)
        if "Ctrl-C" in line:
            return p, tag
    p.kill()
    pytest.fail("`--tier netns up` did not come up:\n" + "".join(out[-40:]))


def _leftovers(tag: str) -> list[str]:
    from deploy.netns import net
    found = [ln for ln in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
             if f"{net.NS_PREFIX}{tag}-" in ln]
    found += [ln for ln in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines()
              if tag in ln]
    found += [ln for ln in subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True).stdout
              .splitlines() if f"{net.RULE_PREFIX}{tag}" in ln]
    with open("/proc/mounts") as f:
        found += [ln for ln in f if f"{net.WORKDIR_PREFIX}{tag}-" in ln]
    import tempfile
    found += [d for d in os.listdir(tempfile.gettempdir()) if d.startswith(f"{net.WORKDIR_PREFIX}{tag}-")]
    return found


def test_sigterm_to_the_drill_command_removes_everything():
    p, tag = _start_cli_cluster()
    assert tag and _leftovers(tag), "the cluster made nothing?"
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 143
    p.stdout.close()
    assert _leftovers(tag) == []


def test_clean_removes_what_a_killed_drill_left():
    p, tag = _start_cli_cluster()
    os.kill(p.pid, signal.SIGKILL)            # no cleanup runs: nodes, namespaces and rule stay
    p.wait(10)
    p.stdout.close()
    assert _leftovers(tag), "nothing left behind to clean"
    r = subprocess.run([sys.executable, "-m", "deploy.drills", "--tier", "netns", "clean"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert _leftovers(tag) == [], r.stdout


def test_a_second_run_on_the_same_subnet_is_refused():
    """Two runs racing for one /24 would route each other's traffic: the second one stops with a
    clear error and removes what it made."""
    why = _usable()
    if why:
        pytest.fail(f"netns tier cannot run on this host: {why}", pytrace=False)
    from deploy.netns import net
    first_tag = net.new_tag()
    first = net.Net(first_tag, net.pick_subnet(first_tag), {"t0": 5})
    second = net.Net(net.new_tag(), first.subnet, {"t0": 5})
    try:
        first.up()
        with pytest.raises(net.NetnsError, match="also on"):
            second.up()
        assert second.down() == []
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert second.bridge not in links
    finally:
        second.down()
        assert first.down() == []
