"""Real node processes for the pipeline tests: a standalone node or a 3-node DLedger group.

Each node is `python -m node --config broker.conf` on free loopback ports with a temp store.
Small geometry on purpose, so a few thousand messages roll commitlog / DLedger data
segments, consume-queue files and index files:

    mappedFileSizeCommitLog=1 MiB, mapedFileSizeConsumeQueue=6000 (300 units),
    maxHashSlotNum=1000, maxIndexNum=4000
"""

from __future__ import annotations

import os
import random
import subprocess
import time

from mqstore import localcluster as lc
from mqstore.localcluster import free_port, http

GEOMETRY = "\n".join(lc.SMALL_GEOMETRY) + "\n"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 20.0
SEND_RETRIES = 100              # per batch, while a DLedger group elects or redirects


class Node(lc.NodeProc):
    """One `python -m node` process with its own directory (broker.conf, store/, node.log)."""

    def __init__(self, directory: str, port: int, extra_conf: str | list[str] = ""):
        self.dir = directory
        self.store = os.path.join(directory, "store")
        conf = lc.write_conf(os.path.join(directory, "broker.conf"), lc.node_lines(
            port, self.store, [f"haListenPort={free_port()}", "maxMessageSize=65536", "logLevel=WARNING",
                               *lc.SMALL_GEOMETRY, *lc.conf_lines(extra_conf)]))
        super().__init__(conf, port, os.path.join(directory, "node.log"))

    def wait_healthy(self, deadline: float) -> None:
        """Until /health answers 200, by the absolute `deadline` (time.monotonic())."""
        lc.wait_healthy(self.port, self, max(0.0, deadline - time.monotonic()), interval=0.1)

    def stop(self) -> int:
        """SIGTERM and wait: the node flushes, dispatches and checkpoints before it exits."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        try:
            return self.terminate(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise AssertionError(f"node on port {self.port} ignored SIGTERM: {self.tail()}") from None

    def kill(self) -> None:
        self.kill9()


def standalone(directory: str, extra_conf: str = "") -> list[Node]:
    n = Node(directory, free_port(), "flushDiskType=ASYNC_FLUSH\n" + extra_conf)
    n.launch()
    try:
        n.wait_healthy(time.monotonic() + START_TIMEOUT_S)
    except AssertionError:
        n.kill()
        raise
    return [n]


def dledger_group(directory: str, size: int = 3) -> list[Node]:
    """A DLedger group on free ports; returns once every node answers /health."""
    ids = [f"n{i}" for i in range(size)]
    ports = lc.free_ports(2 * size)
    api, raft = dict(zip(ids, ports)), dict(zip(ids, ports[size:]))
    nodes = [Node(os.path.join(directory, i), api[i],
                  [*lc.dledger_lines(i, "g", raft, api), "flushDiskType=ASYNC_FLUSH"]) for i in ids]
    for n in nodes:
        n.launch()
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        for n in nodes:
            n.wait_healthy(deadline)
    except AssertionError:
        for n in nodes:
            n.kill()
        raise
    return nodes


def leader(nodes: list[Node], timeout_s: float = 15.0) -> Node:
    port = lc.find_leader([n.port for n in nodes], timeout_s)
    if port is not None:
        return next(n for n in nodes if n.port == port)
    raise AssertionError("no leader: " + "; ".join(f"{n.port}: {n.health()}" for n in nodes))


def make_messages(n: int, queues: int, seed: int) -> list[dict]:
    """Bodies of 200..1500 bytes, tags, zero to three keys, some extra properties."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        m: dict = {"body": f"{i}:" + "x" * rng.randint(200, 1500), "queue_id": rng.randrange(queues)}
        if rng.random() < 0.8:
            m["tags"] = rng.choice(["TagA", "TagB", "TagC", "tag with space"])
        nk = rng.choice([0, 1, 1, 2, 3])
        if nk:
            m["keys"] = " ".join(f"k{rng.randrange(5000)}" for _ in range(nk))
        if rng.random() < 0.2:
            m["properties"] = {"region": rng.choice(["eu", "us"]), "n": str(i)}
        out.append(m)
    return out


def send_all(nodes: list[Node], topic: str, messages: list[dict], batch: int = 100) -> list[dict]:
    """Send in batches to the leader (following redirects across elections); return SendResults."""
    target = leader(nodes)
    results: list[dict] = []
    for i in range(0, len(messages), batch):
        chunk = messages[i:i + batch]
        for _ in range(SEND_RETRIES):
            try:
                status, doc = http(target.port, "POST", f"/topics/{topic}/messages", {"messages": chunk})
            except OSError:
                status, doc = 0, {}
            if status == 200:
                results += doc["results"]
                break
            time.sleep(0.1)
            target = leader(nodes)
        else:
            raise AssertionError(f"batch {i} was never accepted: {status} {doc}")
    return results


def create_topic(nodes: list[Node], topic: str, queues: int) -> None:
    target = leader(nodes)
    for _ in range(SEND_RETRIES):
        status, doc = http(target.port, "POST", "/topics", {"topic": topic, "queues": queues})
        if status in (200, 201):
            return
        time.sleep(0.1)
        target = leader(nodes)
    raise AssertionError(f"cannot create {topic}: {status} {doc}")


def queue_max_offsets(node: Node, topic: str) -> dict[int, int]:
    status, doc = http(node.port, "GET", f"/topics/{topic}")
    assert status == 200, doc
    queues = doc["queues"]
    items = queues.items() if isinstance(queues, dict) else ((q["queue_id"], q) for q in queues)
    return {int(k): int(q["max_offset"]) for k, q in items}


def wait_messages(node: Node, topic: str, want: int, timeout_s: float) -> None:
    """Until `topic` holds `want` messages in all (e.g. delayed ones delivered)."""
    deadline = time.monotonic() + timeout_s
    got = None
    while time.monotonic() < deadline:
        got = sum(queue_max_offsets(node, topic).values())
        if got >= want:
            return
        time.sleep(0.1)
    raise AssertionError(f"{topic}: {got} of {want} messages after {timeout_s} s")
