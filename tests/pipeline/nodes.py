"""Real node processes for the pipeline tests: a standalone node or a 3-node DLedger group.

Each node is `python -m node --config broker.conf` on free loopback ports with a temp store.
Small geometry on purpose, so a few thousand messages roll commitlog / DLedger data
segments, consume-queue files and index files:

    mappedFileSizeCommitLog=1 MiB, mapedFileSizeConsumeQueue=6000 (300 units),
    maxHashSlotNum=1000, maxIndexNum=4000
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GEOMETRY = ("mappedFileSizeCommitLog=1048576\nmapedFileSizeConsumeQueue=6000\n"
            "maxHashSlotNum=1000\nmaxIndexNum=4000\n")
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 20.0
SEND_RETRIES = 100              # per batch, while a DLedger group elects or redirects


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(port: int, method: str, path: str, doc=None, timeout: float = 10.0) -> tuple[int, dict]:
    data = json.dumps(doc).encode() if doc is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return e.code, json.loads(body)
        except ValueError:
            return e.code, {"error": body[:300].decode("utf-8", "replace")}


class Node:
    """One `python -m node` process with its own directory (broker.conf, store/, node.log)."""

    def __init__(self, directory: str, port: int, extra_conf: str = ""):
        self.dir = directory
        self.port = port
        self.store = os.path.join(directory, "store")
        self.conf = os.path.join(directory, "broker.conf")
        self.log_path = os.path.join(directory, "node.log")
        os.makedirs(directory, exist_ok=True)
        with open(self.conf, "w") as f:
            f.write(f"listenPort={port}\nhaListenPort={free_port()}\nbindAddress=127.0.0.1\n"
                    f"brokerIP1=127.0.0.1\nstorePathRootDir={self.store}\nmaxMessageSize=65536\n"
                    f"logLevel=WARNING\n{GEOMETRY}{extra_conf}")
        self.proc: subprocess.Popen | None = None

    def launch(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "node", "--config", self.conf], cwd=ROOT,
                                         stdout=log, stderr=log)

    def health(self) -> dict | None:
        try:
            status, doc = http(self.port, "GET", "/health", timeout=1.0)
        except OSError:
            return None
        return doc if status == 200 else None

    def wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"node exited with {self.proc.returncode}: {self.tail()}")
            if self.health() is not None:
                return
            time.sleep(0.1)
        raise AssertionError(f"node on port {self.port} did not become healthy: {self.tail()}")

    def stop(self) -> int:
        """SIGTERM and wait: the node flushes, dispatches and checkpoints before it exits."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"node on port {self.port} ignored SIGTERM: {self.tail()}") from None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-3000:].decode("utf-8", "replace")
        except FileNotFoundError:
            return ""


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
    api = {i: free_port() for i in ids}
    raft = {i: free_port() for i in ids}
    peers = ";".join(f"{i}-127.0.0.1:{raft[i]}" for i in ids)
    apis = ";".join(f"{i}-127.0.0.1:{api[i]}" for i in ids)
    nodes = [Node(os.path.join(directory, i), api[i],
                  f"enableDLegerCommitLog=true\ndLegerGroup=g\ndLegerPeers={peers}\n"
                  f"dLegerPeerApis={apis}\ndLegerSelfId={i}\nflushDiskType=ASYNC_FLUSH\n") for i in ids]
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
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for n in nodes:
            h = n.health() or {}
            if h.get("role") in ("LEADER", "STANDALONE", "MASTER"):
                return n
        time.sleep(0.1)
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
