"""kill -9 a SYNC_FLUSH node 30 times under load; every acknowledged message survives.

Method: one real node process (1 MiB commitlog segments so files roll, small consume-queue
files). Four writer threads send unique messages in small batches over HTTP and record every
ack (offset_msg_id, queue_id, queue_offset, body). Each round restarts the node, lets load
run for a random 0.1-0.8 s and kills the process with SIGKILL mid-load. After every restart:
- every acked message is served at its queue offset and by its offsetMsgId with its body;
- every queue is dense (queue offset i holds the unit at i, commitlog offsets increase) and
  everything visible is a complete message some writer attempted (unacked but visible is fine,
  corrupt or partial never);
- recovery needed no human (the node came back healthy on its own).
Every 10 rounds and at the end the node is stopped cleanly and its consume queues are compared,
unit by unit, with a rebuild from a scan of the commitlog files. Recovery's dropped bytes are
read from the node's JSON log.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
import urllib.error

from node.store import layout as L
from node.store.consume_queue import ConsumeQueueStore
from node.store.fileio import FileSystem
from node.store.message import decode_record, tags_code
from tests.integration.test_node_process import NodeProcess, free_port, http, write_conf

ROUNDS = 30
TOPIC = "Crash"
QUEUES = 4
WRITERS = 4
CQ_UNITS_PER_FILE = 300


class Load:
    """Writer threads; `acks` maps offset_msg_id -> (queue_id, queue_offset, body)."""

    def __init__(self, port: int, seed: int):
        self.port = port
        self.rng = random.Random(seed)
        self.acks: dict[str, tuple[int, int, str]] = {}
        self.attempted: set[str] = set()
        self.lock = threading.Lock()
        self.seq = 0
        self.round_acks: list[str] = []

    def run_until_failure(self, stop: threading.Event) -> None:
        threads = [threading.Thread(target=self._writer, args=(w, stop), daemon=True) for w in range(WRITERS)]
        for t in threads:
            t.start()
        self._threads = threads

    def join(self) -> None:
        for t in self._threads:
            t.join(15)

    def _batch(self, writer: int) -> list[dict]:
        with self.lock:
            n = self.rng.randint(1, 4)
            bodies = []
            for _ in range(n):
                self.seq += 1
                pad = "x" * self.rng.randint(10, 4000)
                bodies.append(f"w{writer}-{self.seq}-{pad}")
            self.attempted.update(bodies)
            qid = self.rng.randrange(QUEUES)
        return [{"body": b, "queue_id": qid, "keys": [b.split("-")[1]]} for b in bodies]

    def _writer(self, writer: int, stop: threading.Event) -> None:
        while not stop.is_set():
            batch = self._batch(writer)
            try:
                status, doc = http(self.port, "POST", f"/topics/{TOPIC}/messages", {"messages": batch}, timeout=5)
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                return  # the node died: this batch is unacknowledged
            if status != 200:
                return
            with self.lock:
                for msg, r in zip(batch, doc["results"]):
                    assert r["status"] == "SEND_OK", r
                    self.acks[r["offset_msg_id"]] = (r["queue_id"], r["queue_offset"], msg["body"])
                    self.round_acks.append(r["offset_msg_id"])


def pull_all(port: int, qid: int) -> list[dict]:
    out, offset = [], 0
    while True:
        status, doc = http(port, "GET", f"/topics/{TOPIC}/queues/{qid}/messages?offset={offset}&max=1024")
        assert status == 200, doc
        if doc["status"] != "FOUND":
            assert doc["status"] == "NO_NEW_MSG" and doc["next_offset"] == offset, doc
            return out
        out.extend(doc["messages"])
        offset = doc["next_offset"]


def wait_dispatched(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, doc = http(port, "GET", "/cluster")
        if doc["dispatch_behind_bytes"] == 0:
            return
        time.sleep(0.02)
    raise AssertionError("dispatch did not catch up")


def verify(port: int, load: Load, rng: random.Random) -> int:
    """Check the node against the acks; return how many messages are visible."""
    wait_dispatched(port)
    visible = 0
    by_queue: dict[int, dict[int, tuple[str, str]]] = {}
    for qid in range(QUEUES):
        msgs = pull_all(port, qid)
        last_phys = -1
        for i, m in enumerate(msgs):
            assert m["queue_offset"] == i and m["queue_id"] == qid, m["offset_msg_id"]
            assert m["commitlog_offset"] > last_phys
            last_phys = m["commitlog_offset"]
            assert m["body"] in load.attempted, "a message no writer sent is visible"
        by_queue[qid] = {m["queue_offset"]: (m["offset_msg_id"], m["body"]) for m in msgs}
        visible += len(msgs)
    for msg_id, (qid, qoff, body) in load.acks.items():
        assert by_queue[qid].get(qoff) == (msg_id, body), f"acked message {msg_id} lost or changed"
    sample = rng.sample(sorted(load.acks), min(40, len(load.acks))) + load.round_acks[-40:]
    for msg_id in sample:
        qid, qoff, body = load.acks[msg_id]
        status, doc = http(port, "GET", f"/messages/{msg_id}")
        assert status == 200 and doc["body"] == body, (msg_id, doc)
        status, doc = http(port, "GET", f"/topics/{TOPIC}/queues/{qid}/messages/{qoff}")
        assert status == 200 and doc["offset_msg_id"] == msg_id
    return visible


def scan_commitlog(store: str) -> dict[tuple[str, int], list[tuple[int, int, int]]]:
    """Expected consume-queue units, from the commitlog files alone."""
    units: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    directory = os.path.join(store, "commitlog")
    for name in sorted(os.listdir(directory)):
        base = int(name)
        data = open(os.path.join(directory, name), "rb").read()
        pos = 0
        while pos + 8 <= len(data):
            size, magic = L.BLANK.unpack_from(data, pos)
            if magic != L.MESSAGE_MAGIC:
                break  # blank (end of file) or the end of data
            m = decode_record(data, pos)
            assert m.physical_offset == base + pos
            units.setdefault((m.topic, m.queue_id), []).append((m.physical_offset, size, tags_code(m.tags)))
            assert len(units[(m.topic, m.queue_id)]) == m.queue_offset + 1, "queue offsets must be dense"
            pos += size
    return units


def compare_cq_with_rebuild(store: str, scratch: str) -> int:
    """Open a copy of the stopped node's consume queues and compare every unit with the scan."""
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(store, scratch)
    cqs = ConsumeQueueStore(FileSystem(), scratch, CQ_UNITS_PER_FILE)
    cqs.load_all()
    cqs.recover_all()
    expected = scan_commitlog(scratch)
    assert set(cqs.max_offsets()) >= set(expected)
    n = 0
    for key, units in expected.items():
        cq = cqs.get(*key)
        assert cq.min_offset == 0 and cq.max_offset == len(units), key
        got = []
        while len(got) < len(units):
            got.extend(cq.get_range(len(got), 1000))
        assert got == units, f"consume queue {key} differs from the commitlog"
        n += len(units)
    cqs.close()
    return n


def dropped_bytes(log_path: str) -> int:
    total = 0
    with open(log_path, "rb") as f:
        for line in f:
            if b"recovery dropped" in line:
                total += int(json.loads(line)["msg"].split()[2])
    return total


def test_kill_9_thirty_times_under_sync_flush_load(tmp_path):
    seed = int(os.environ.get("CRASH_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    print(f"crash test seed {seed} (rerun with CRASH_SEED={seed})")
    port = free_port()
    conf = write_conf(tmp_path, port, "flushDiskType=SYNC_FLUSH\nmaxTransferCountOnMessageInMemory=1024\n"
                                      f"mapedFileSizeConsumeQueue={CQ_UNITS_PER_FILE * 20}\n")
    store = str(tmp_path / "store")
    node = NodeProcess(conf, port, str(tmp_path / "node.log"))
    load = Load(port, seed)
    node.start()
    http(port, "POST", "/topics", {"topic": TOPIC, "queues": QUEUES})
    visible = 0
    t0 = time.monotonic()
    try:
        for rnd in range(ROUNDS):
            load.round_acks = []
            stop = threading.Event()
            load.run_until_failure(stop)
            time.sleep(rng.uniform(0.1, 0.8))
            node.kill9()                     # mid-load: some batches are in flight
            stop.set()
            load.join()
            node.start()                     # recovery needs no human: it must come back healthy
            visible = verify(port, load, rng)
            if rnd % 10 == 9:
                assert node.terminate() == 0, node.tail()
                compare_cq_with_rebuild(store, str(tmp_path / "scratch"))
                node.start()
    finally:
        node.kill9()
    segments = len(os.listdir(os.path.join(store, "commitlog")))
    print(f"crash test: {ROUNDS} kills, {len(load.acks)} acked, {visible} visible, "
          f"{segments} commitlog files, {dropped_bytes(node.log_path)} bytes dropped by recovery, "
          f"{time.monotonic() - t0:.1f}s")
    assert len(load.acks) > 500 and segments >= 3
