"""`mqstore cluster up/down`: a local cluster on loopback as plain processes.

Each node gets its own store directory, a generated `broker.conf` and a log
file under the cluster directory; `cluster.json` there records the PIDs this
command started, so `cluster down` ends exactly those.

Modes: `dledger` (default: one Raft group of 3 nodes), `standalone` (one node).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

STATE_FILE = "cluster.json"
HEALTH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class NodeSpec:
    node_id: str
    api_port: int
    raft_port: int
    config_path: str
    store_dir: str
    log_path: str

    @property
    def api(self) -> str:
        return f"127.0.0.1:{self.api_port}"


def plan(directory: str, mode: str, nodes: int, base_port: int, group: str = "broker-a") -> list[NodeSpec]:
    """Node specs and their broker.conf files (written) for a local cluster."""
    if mode == "standalone":
        nodes = 1
    specs = [NodeSpec(f"n{i}", base_port + 10 * i, 40911 + i + (base_port - 10911),
                      os.path.join(directory, f"n{i}", "broker.conf"), os.path.join(directory, f"n{i}", "store"),
                      os.path.join(directory, f"n{i}", "node.log")) for i in range(nodes)]
    peers = ";".join(f"{s.node_id}-127.0.0.1:{s.raft_port}" for s in specs)
    apis = ";".join(f"{s.node_id}-127.0.0.1:{s.api_port}" for s in specs)
    for s in specs:
        os.makedirs(os.path.dirname(s.config_path), exist_ok=True)
        lines = [
            "brokerClusterName=DefaultCluster",
            f"brokerName={group}",
            "brokerId=0",
            "brokerIP1=127.0.0.1",
            f"listenPort={s.api_port}",
            f"storePathRootDir={s.store_dir}",
            "flushDiskType=ASYNC_FLUSH",
            "mappedFileSizeCommitLog=67108864",
            "autoCreateTopicEnable=true",
        ]
        if mode == "dledger":
            lines += ["enableDLegerCommitLog=true", f"dLegerGroup={group}", f"dLegerPeers={peers}",
                      f"dLegerPeerApis={apis}", f"dLegerSelfId={s.node_id}"]
        with open(s.config_path, "w") as f:
            f.write("\n".join(lines) + "\n")
    return specs


def _healthy(api: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://{api}/health", timeout=1.0) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def start(directory: str, mode: str = "dledger", nodes: int = 3, base_port: int = 10911) -> list[NodeSpec]:
    directory = os.path.abspath(directory)
    if os.path.exists(os.path.join(directory, STATE_FILE)):
        raise SystemExit(f"a cluster is already recorded in {directory}; run `mqstore cluster down --dir {directory}`")
    specs = plan(directory, mode, nodes, base_port)
    pids = []
    for s in specs:
        log = open(s.log_path, "ab")
        proc = subprocess.Popen([sys.executable, "-m", "node", "--config", s.config_path],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        pids.append(proc.pid)
    with open(os.path.join(directory, STATE_FILE), "w") as f:
        json.dump({"mode": mode, "pids": pids, "apis": [s.api for s in specs]}, f)
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    for s in specs:
        while _healthy(s.api) is None:
            if time.monotonic() > deadline:
                stop(directory)
                raise SystemExit(f"node {s.node_id} did not become healthy in {HEALTH_TIMEOUT_S:.0f} s; see {s.log_path}")
            time.sleep(0.2)
    return specs


def wait_for_leader(specs: list[NodeSpec], timeout_s: float = 15.0) -> str | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for s in specs:
            h = _healthy(s.api) or {}
            if h.get("role") in ("LEADER", "STANDALONE", "MASTER"):
                return s.api
        time.sleep(0.2)
    return None


def stop(directory: str) -> list[int]:
    """End the node processes this cluster started (SIGTERM, then SIGKILL after 10 s)."""
    path = os.path.join(os.path.abspath(directory), STATE_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        pids = json.load(f)["pids"]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10.0
    for pid in pids:
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.1)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    os.remove(path)
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours counts as gone
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def usage_text(specs: list[NodeSpec], leader: str | None, directory: str) -> str:
    ep = leader or specs[0].api
    nodes = "\n".join(f"  {s.node_id}  http://{s.api}   (store {s.store_dir}, log {s.log_path})" for s in specs)
    return f"""mqstore cluster is up ({len(specs)} node{'s' if len(specs) > 1 else ''}); leader: {leader or 'electing'}
{nodes}

Try it (against the leader):
  curl -s -XPOST {ep}/topics -d '{{"topic":"TopicTest","queues":4}}'
  curl -s -XPOST {ep}/topics/TopicTest/messages -d '{{"messages":[{{"body":"hello","tags":"TagA","keys":"order-1","queue_id":0}}]}}'
  curl -s '{ep}/topics/TopicTest/queues/0/messages?offset=0&max=32'
  .venv/bin/mqstore send -n {ep} -t TopicTest -b hello --tags TagA --keys order-1
  .venv/bin/mqstore pull -n {ep} -t TopicTest -q 0 -o 0
  .venv/bin/mqstore topicStatus -n {ep} -t TopicTest
  curl -s {ep}/cluster

Dashboard: http://{ep}/dashboard   (metrics: http://{ep}/metrics)

Stop with Ctrl-C (or `mqstore cluster down --dir {directory}` when started with --detach).
"""


def up_main(directory: str, mode: str, nodes: int, base_port: int, detach: bool) -> int:
    specs = start(directory, mode, nodes, base_port)
    leader = wait_for_leader(specs)
    print(usage_text(specs, leader, directory), flush=True)
    if detach:
        return 0
    stopping = {"now": False}

    def _on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
        stopping["now"] = True

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        while not stopping["now"]:
            time.sleep(0.5)
    finally:
        stop(directory)
        print("mqstore cluster stopped", flush=True)
    return 0
