"""A bounded producer workload that records every send, ack and failure (JSONL history),
and the drain that reads every queue back from every replica.

Each send carries a fresh id (a retry is a new send) in its body and keys, so the checker can
tell a store duplicate from a client retry. Sends go to the group's current leader; on any
error the producer asks every replica's /health who leads now, and a route refresher asks
the same every LEADER_POLL_S, so a send started after a new leader is elected goes to it
even while the old one stalls (paused, isolated) and answers nothing.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor

from deploy.drills.checker import is_definite
from deploy.drills.cluster import GROUPS, LEADER_ROLES, Cluster, http_json

BODY_PAD = 200                 # bytes of filler after the id
PULL_BATCH = 32                # maxTransferCountOnMessageInMemory
SEND_TIMEOUT_S = 2.0            # a stalled leader holds a send this long
LEADER_POLL_S = 0.25            # the route refresher's period


def body_of(msg_id: str) -> str:
    return f"{msg_id}|" + "x" * (BODY_PAD - (zlib.crc32(msg_id.encode()) % 64))


class History:
    """Thread-safe, append-only: one JSON object a line, also kept in memory for the checker."""

    def __init__(self, path: str):
        self.path = path
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._f = open(path, "w")

    def add(self, **ev) -> None:
        ev.setdefault("t", time.time())
        with self._lock:
            self.events.append(ev)
            self._f.write(json.dumps(ev) + "\n")

    def close(self) -> None:
        with self._lock:
            self._f.close()


class Workload:
    """Open loop: one pacer starts a send every 1/rate s whatever the answers, each on a worker
    of its own (at most `max_inflight` at once; when all are held by a stalled leader the pacer
    waits for one). A closed loop would stop sending while its few workers wait out
    SEND_TIMEOUT_S on a stalled leader, and so would measure the client's timeout, not the
    failover."""

    def __init__(self, cluster: Cluster, group: str, topic: str, queues: int, history: History,
                 rate_per_s: float = 40.0, max_inflight: int | None = None, max_messages: int = 20_000):
        self.cluster = cluster
        self.group = group
        self.topic = topic
        self.queues = queues
        self.history = history
        self.interval_s = 1.0 / rate_per_s
        # enough workers for every send of SEND_TIMEOUT_S + 1 s at the rate, within [4, 256]
        self.max_inflight = max_inflight or min(256, max(4, int(rate_per_s * (SEND_TIMEOUT_S + 1))))
        self.max_messages = max_messages      # bound on the whole run, whatever its duration
        self._leader: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()        # the message count and leader discovery
        self._tally = threading.Lock()       # acked / failed
        self._slots = threading.BoundedSemaphore(self.max_inflight)
        self._count = 0
        self._workers: list[threading.Thread] = []
        self._pool: ThreadPoolExecutor | None = None
        self.acked = 0
        self.failed = 0

    def start(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=self.max_inflight, thread_name_prefix="producer")
        for target, name in ((self._pace, "pacer"), (self._refresh_routes, "route-refresher")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._workers.append(t)

    def _refresh_routes(self) -> None:
        """Every LEADER_POLL_S: the replica claiming leadership in the highest term becomes the
        producers' target (a stalled replica does not answer within the probe's timeout and so
        makes no claim). No claim at all (an election under way) keeps the current target."""
        while not self._stop.wait(LEADER_POLL_S):
            claims = []
            for s in GROUPS[self.group]:
                h = self.cluster.health(s, timeout=LEADER_POLL_S)
                if h and h.get("role") in LEADER_ROLES:
                    claims.append((int(h.get("term") or 0), s))
            if claims:
                self._leader = max(claims)[1]

    def stop(self) -> None:
        self._stop.set()
        for t in self._workers:
            t.join(SEND_TIMEOUT_S + 2)
        if self._pool is not None:
            self._pool.shutdown(wait=True)     # every send started has its answer or its failure

    def _next(self) -> int | None:
        with self._lock:
            if self._count >= self.max_messages:
                return None
            self._count += 1
            return self._count

    def _find_leader(self) -> str | None:
        with self._lock:
            try:
                self.cluster.refresh()
            except Exception:  # noqa: BLE001 - docker hiccup; keep the old map
                pass
            claims = []
            for s in GROUPS[self.group]:
                h = self.cluster.health(s, timeout=0.5)
                if h and h.get("role") in LEADER_ROLES:
                    claims.append((int(h.get("term") or 0), s))
            # a deposed leader may claim leadership for a moment: the highest term wins
            self._leader = max(claims)[1] if claims else None
            return self._leader

    def _pace(self) -> None:
        t_next = time.monotonic()
        while not self._stop.is_set():
            leader = self._leader or self._find_leader()
            if leader is None:
                time.sleep(0.1)
                continue
            if not self._slots.acquire(timeout=0.5):       # every worker held: wait, then look again
                continue
            n = self._next()
            if n is None or self._stop.is_set():
                self._slots.release()
                return
            self._pool.submit(self._send_slot, leader, f"{uuid.uuid4().hex[:12]}-{n}", n % self.queues)
            t_next = max(t_next + self.interval_s, time.monotonic() - 1.0)   # catch up at most 1 s
            time.sleep(max(0.0, t_next - time.monotonic()))

    def _send_slot(self, leader: str, msg_id: str, queue: int) -> None:
        try:
            self._send_one(leader, msg_id, queue)
        finally:
            self._slots.release()

    def _send_one(self, leader: str, msg_id: str, queue: int) -> None:
        api = self.cluster.nodes[leader].api
        self.history.add(type="send", id=msg_id, queue=queue, node=leader)
        body = {"messages": [{"body": body_of(msg_id), "keys": msg_id, "queue_id": queue}]}
        try:
            st, doc = http_json("POST", f"http://{api}/topics/{self.topic}/messages", body, timeout=SEND_TIMEOUT_S)
        except ConnectionRefusedError:
            self._fail(msg_id, "CONNECTION_REFUSED")
            return
        except OSError as e:
            refused = isinstance(getattr(e, "reason", None), ConnectionRefusedError)
            self._fail(msg_id, "CONNECTION_REFUSED" if refused else f"IO:{type(getattr(e, 'reason', e)).__name__}")
            return
        if st == 200 and doc.get("results") and doc["results"][0].get("status") == "SEND_OK":
            r = doc["results"][0]
            self.history.add(type="ack", id=msg_id, queue=r["queue_id"], queue_offset=r["queue_offset"],
                             msg_id=r.get("msg_id"))
            with self._tally:
                self.acked += 1
            return
        err = doc.get("error") or (doc.get("results") or [{}])[0].get("status") or f"HTTP_{st}"
        self._fail(msg_id, str(err), str(doc.get("message") or ""))

    def _fail(self, msg_id: str, error: str, message: str = "") -> None:
        with self._tally:
            self.failed += 1
        ev = {"message": message[:200]} if message else {}
        self.history.add(type="fail", id=msg_id, error=error, definite=is_definite(error, message), **ev)
        self._leader = None


def drain(cluster: Cluster, service: str, topic: str, queues: int, max_messages: int = 200_000) -> list[dict]:
    """Every message of `topic` on one replica, as the checker wants them."""
    api = cluster.nodes[service].api
    out: list[dict] = []
    for q in range(queues):
        offset = 0
        for _ in range(max_messages // PULL_BATCH + 10):      # bound: each round advances or stops
            st, doc = http_json("GET", f"http://{api}/topics/{topic}/queues/{q}/messages"
                                       f"?offset={offset}&max={PULL_BATCH}&wait_ms=0", timeout=10.0)
            if st != 200:
                raise RuntimeError(f"{service}: pull {topic}/{q}@{offset} -> {st} {doc}")
            if doc["status"] == "OFFSET_ILLEGAL" and offset < doc.get("min_offset", 0):
                offset = doc["min_offset"]
                continue
            for m in doc.get("messages", []):
                body = m.get("body") or ""
                mid = body.split("|", 1)[0]
                out.append({"id": mid, "queue": m["queue_id"], "queue_offset": m["queue_offset"],
                            "commitlog_offset": m.get("commitlog_offset"), "body_ok": body == body_of(mid)})
            if doc["status"] != "FOUND" or doc["next_offset"] >= doc["max_offset"]:
                break
            offset = doc["next_offset"]
    return out
