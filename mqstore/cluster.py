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
import time
from dataclasses import dataclass

from mqstore import localcluster as lc

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
    raft = {s.node_id: s.raft_port for s in specs}
    api = {s.node_id: s.api_port for s in specs}
    for s in specs:
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
            lines += lc.dledger_lines(s.node_id, group, raft, api)
        lc.write_conf(s.config_path, lines)
    return specs


def start(directory: str, mode: str = "dledger", nodes: int = 3, base_port: int = 10911) -> list[NodeSpec]:
    directory = os.path.abspath(directory)
    if os.path.exists(os.path.join(directory, STATE_FILE)):
        raise SystemExit(f"a cluster is already recorded in {directory}; run `mqstore cluster down --dir {directory}`")
    specs = plan(directory, mode, nodes, base_port)
    procs = [lc.Proc(lc.node_argv(s.config_path), s.log_path, s.node_id, new_session=True).start() for s in specs]
    pids = [p.pid for p in procs]
    with open(os.path.join(directory, STATE_FILE), "w") as f:
        json.dump({"mode": mode, "pids": pids, "apis": [s.api for s in specs]}, f)
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    for s in specs:
        try:
            lc.wait_healthy(s.api, timeout_s=max(0.0, deadline - time.monotonic()), interval=0.2)
        except lc.ClusterError:
            stop(directory)
            raise SystemExit(f"node {s.node_id} did not become healthy in {HEALTH_TIMEOUT_S:.0f} s; see {s.log_path}")
    return specs


def wait_for_leader(specs: list[NodeSpec], timeout_s: float = 15.0) -> str | None:
    return lc.find_leader([s.api for s in specs], timeout_s, interval=0.2)


def stop(directory: str) -> list[int]:
    """End the node processes this cluster started (SIGTERM, then SIGKILL after 10 s)."""
    path = os.path.join(os.path.abspath(directory), STATE_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        pids = json.load(f)["pids"]
    lc.stop_pids(pids, 10.0)
    os.remove(path)
    return pids


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
