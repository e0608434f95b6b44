"""Prometheus metrics of a node: one CollectorRegistry per node, values read at scrape time.

Nothing here updates a gauge per message. The hot path only bumps plain integers
(`TrafficStats.sent` / `.pulled`, one dict add each) and times fsyncs
(`TimedFileSystem`); everything else — consumer lag per topic/queue/group, dispatch
backlog, Raft term/role/indexes, HA ack offset, disk usage — is computed from the
broker's own state when /metrics is scraped, by `NodeCollector`. A per-node registry
keeps several nodes in one process (tests) apart; the global registry is never used.

Names follow Prometheus conventions with RocketMQ's exporter prefix (`rocketmq_*`):
counters end in `_total`, sizes in `_bytes`, durations in `_seconds`.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from node.histogram import LatencyHistogram
from node.store import cold_reads
from node.store.fileio import FileHandle, FileSystem

OTHER_TOPIC = "_other_"                 # label for topics beyond MAX_TOPIC_SERIES
MAX_TOPIC_SERIES = 10_000               # bound on per-topic series (label cardinality)
MAX_LAG_SERIES = 50_000                 # bound on (topic, queue, group) lag series per scrape
MAX_DISK_WALK_FILES = 100_000           # bound on files summed for the store size
RATE_WINDOW_S = 60                      # seconds of per-second counts kept for TPS
ROLE_VALUES = ("LEADER", "FOLLOWER", "CANDIDATE", "MASTER", "SLAVE", "STANDALONE")


# --- hot-path counters ---------------------------------------------------------------------------
class _Rate:
    """Counts per whole second for the last RATE_WINDOW_S seconds (bounded deque)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.buckets: deque[list[int]] = deque(maxlen=RATE_WINDOW_S + 1)   # [second, count]

    def add(self, n: int) -> None:
        sec = int(self.clock())
        if self.buckets and self.buckets[-1][0] == sec:
            self.buckets[-1][1] += n
        else:
            self.buckets.append([sec, n])

    def per_second(self, window_s: int = 10) -> float:
        """Mean rate over the last `window_s` whole seconds (the current one excluded)."""
        now = int(self.clock())
        total = sum(c for s, c in self.buckets if now - window_s <= s < now)
        return total / window_s


class Window:
    """Messages counted over the last minute (six 10-second slots) and the last day (24 hourly
    slots), in fixed memory: RocketMQ's statsMinute TPS and statsDay sum of one stats key
    (BrokerStatsManager's TOPIC_PUT_NUMS, GROUP_GET_NUMS). An add within the 10-second period
    of the last one is two increments (it is on the send path)."""

    __slots__ = ("secs", "sec_periods", "hours", "hour_periods", "period", "i_sec", "i_hour")

    def __init__(self) -> None:
        self.secs, self.sec_periods = [0] * 6, [-1] * 6          # 10-second periods
        self.hours, self.hour_periods = [0] * 24, [-1] * 24      # hours
        self.period, self.i_sec, self.i_hour = -1, 0, 0

    def add(self, n: int, now: float) -> None:
        period = int(now // 10)
        if period != self.period:
            self._turn(period)
        self.secs[self.i_sec] += n
        self.hours[self.i_hour] += n

    def _turn(self, period: int) -> None:
        self.period = period
        i, hour = period % 6, period // 360
        j = hour % 24
        if self.sec_periods[i] != period:
            self.sec_periods[i], self.secs[i] = period, 0
        if self.hour_periods[j] != hour:
            self.hour_periods[j], self.hours[j] = hour, 0
        self.i_sec, self.i_hour = i, j

    def tps(self, now: float) -> float:
        """Mean per second over the last six whole 10-second periods (the current one excluded)."""
        period = int(now // 10)
        return sum(c for c, p in zip(self.secs, self.sec_periods) if period - 6 <= p < period) / 60.0

    def day_sum(self, now: float) -> int:
        """The current hour's count and the 23 hours' before it."""
        hour = int(now // 3600)
        return sum(c for c, p in zip(self.hours, self.hour_periods) if hour - 23 <= p <= hour)


class TrafficStats:
    """Messages and bytes in (acked sends) and out (pulled) per topic; TPS over a window; and
    for statsAll, per topic (in) and per topic and consumer group (out, the pulls that named
    their group) the last minute's TPS and the last day's count (`Window`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_topics: int = MAX_TOPIC_SERIES,
                 wall_clock: Callable[[], float] = time.time):
        self.max_topics = max_topics
        self.in_messages: dict[str, int] = {}
        self.in_bytes: dict[str, int] = {}
        self.out_messages: dict[str, int] = {}
        self.out_bytes: dict[str, int] = {}
        self.in_rate = _Rate(clock)
        self.out_rate = _Rate(clock)
        self.wall_clock = wall_clock      # hours of the day's slots are wall-clock hours
        self.topic_put: dict[str, Window] = {}
        self.group_get: dict[tuple[str, str], Window] = {}

    def _key(self, table: dict, topic: Any) -> Any:
        return topic if topic in table or len(table) < self.max_topics else OTHER_TOPIC

    def sent(self, topic: str, messages: int, body_bytes: int) -> None:
        k = self._key(self.in_messages, topic)
        self.in_messages[k] = self.in_messages.get(k, 0) + messages
        self.in_bytes[k] = self.in_bytes.get(k, 0) + body_bytes
        self.in_rate.add(messages)
        w = self.topic_put.get(k)        # `_window`, inline: this is the send path
        if w is None:
            w = self.topic_put[k] = Window()
        w.add(messages, self.wall_clock())

    def pulled(self, topic: str, messages: int, body_bytes: int, group: str | None = None) -> None:
        if not messages:
            return
        k = self._key(self.out_messages, topic)
        self.out_messages[k] = self.out_messages.get(k, 0) + messages
        self.out_bytes[k] = self.out_bytes.get(k, 0) + body_bytes
        self.out_rate.add(messages)
        if group is not None:
            key = self._key(self.group_get, (topic, group))
            self._window(self.group_get, (OTHER_TOPIC, OTHER_TOPIC) if key == OTHER_TOPIC else key).add(
                messages, self.wall_clock())

    @staticmethod
    def _window(table: dict, key: Any) -> Window:
        w = table.get(key)
        if w is None:
            w = table[key] = Window()
        return w

    def tps(self, window_s: int = 10) -> tuple[float, float]:
        return self.in_rate.per_second(window_s), self.out_rate.per_second(window_s)

    def put_stats(self, topic: str) -> tuple[float, int]:
        """(TPS over the last minute, messages in the last day) sent to `topic` here."""
        w, now = self.topic_put.get(topic), self.wall_clock()
        return (w.tps(now), w.day_sum(now)) if w is not None else (0.0, 0)

    def get_stats(self, topic: str, group: str) -> tuple[float, int]:
        """(TPS over the last minute, messages in the last day) `group` pulled from `topic` here."""
        w, now = self.group_get.get((topic, group)), self.wall_clock()
        return (w.tps(now), w.day_sum(now)) if w is not None else (0.0, 0)

    def groups_pulling(self) -> dict[str, set[str]]:
        """topic -> the groups whose pulls of it were counted."""
        out: dict[str, set[str]] = {}
        for t, g in self.group_get:
            out.setdefault(t, set()).add(g)
        return out

    def group_tps(self, group: str) -> float:
        """The last minute's TPS of `group`'s pulls, every topic's (consumerProgress's Consume TPS)."""
        now = self.wall_clock()
        return sum(w.tps(now) for (_, g), w in self.group_get.items() if g == group)


# --- fsync latency ----------------------------------------------------------------------------------
class _TimedFile:
    """A FileHandle whose fsync is timed into the file system's histogram."""

    __slots__ = ("inner", "hist")

    def __init__(self, inner: FileHandle, hist: LatencyHistogram):
        self.inner = inner
        self.hist = hist

    def __getattr__(self, name: str) -> Any:   # path, fd, and anything a subclass adds
        return getattr(self.inner, name)

    def pwrite(self, data, offset: int) -> int:
        return self.inner.pwrite(data, offset)

    def pread(self, size: int, offset: int) -> bytes:
        return self.inner.pread(size, offset)

    def fsync(self) -> None:
        t0 = time.perf_counter()
        try:
            self.inner.fsync()
        finally:
            self.hist.observe(time.perf_counter() - t0)

    def truncate(self, size: int) -> None:
        self.inner.truncate(size)

    def size(self) -> int:
        return self.inner.size()

    def data_end(self, limit: int) -> int:
        return self.inner.data_end(limit)

    def close(self) -> None:
        self.inner.close()


class TimedFileSystem(FileSystem):
    """The real file system, with every file and directory fsync timed (`fsync_seconds`)."""

    def __init__(self) -> None:
        self.fsync_seconds = LatencyHistogram()

    def open(self, path: str) -> FileHandle:
        return _TimedFile(super().open(path), self.fsync_seconds)

    def fsync_dir(self, path: str) -> None:
        t0 = time.perf_counter()
        try:
            super().fsync_dir(path)
        finally:
            self.fsync_seconds.observe(time.perf_counter() - t0)


# --- scrape-time collector ------------------------------------------------------------------------
def store_size_bytes(root: str, max_files: int = MAX_DISK_WALK_FILES) -> int:
    """Bytes allocated by the store directory's files (bounded walk; sparse files count as stored)."""
    total, seen = 0, 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            seen += 1
            if seen > max_files:
                return total
            try:
                st = os.stat(os.path.join(dirpath, name))
            except OSError:
                continue   # deleted by retention while we walked
            total += st.st_blocks * 512
    return total


class NodeCollector:
    """Every rocketmq_* family of one node, computed from the broker's state at scrape time."""

    def __init__(self, broker: Any, fs: FileSystem | None = None):
        self.broker = broker
        self.fs = fs

    def collect(self) -> Iterator[Metric]:
        yield from self._log_families()
        yield from self._traffic_families()
        yield from self._lag_families()
        yield from self._disk_families()
        st = self.broker.log.status()
        if self.broker.log.mode == "dledger":
            yield from self._raft_families(st)
        elif self.broker.log.mode == "classic":
            yield from self._ha_families(st)

    def _log_families(self) -> Iterator[Metric]:
        b = self.broker
        labels = ["group", "node"]
        who = [b.config.group, b.config.node_id]
        yield _gauge("rocketmq_commitlog_committed_offset", "Committed log position", labels, who,
                     b.log.committed_position)
        yield _gauge("rocketmq_commitlog_min_offset", "First retained log position", labels, who, b.log.min_position)
        yield _gauge("rocketmq_dispatch_behind_bytes", "Committed bytes not yet dispatched to consume queues",
                     labels, who, int(getattr(b.dispatcher, "behind_bytes", 0)))
        yield CounterMetricFamily("rocketmq_dispatch_disk_full_errors",
                                  "Consume-queue/index/checkpoint writes refused with ENOSPC (dispatch paused, retried)",
                                  value=int(getattr(b.dispatcher, "disk_full_errors", 0)))
        yield CounterMetricFamily("rocketmq_messages_in", "User messages acknowledged since start",
                                  value=b.messages_in)
        yield GaugeMetricFamily("rocketmq_long_poll_waiters", "Pulls held by long polling",
                                value=b.long_poll_waiters)
        yield GaugeMetricFamily("rocketmq_topics", "Topics known to this node", value=len(b.topics))
        corruption = getattr(b, "corruption", None)
        if corruption is not None:   # node/store/scrub.py: CRC failures found on read, by recovery or scrub
            yield CounterMetricFamily("rocketmq_store_corrupt_records", "Corrupt records found on disk since start",
                                      value=corruption.found_total)
            yield GaugeMetricFamily("rocketmq_store_corrupt_ranges", "Known corrupt ranges not yet repaired",
                                    value=len(corruption))
            yield CounterMetricFamily("rocketmq_store_corrupt_repaired", "Corrupt ranges repaired from a peer",
                                      value=corruption.repaired_total)
        repairer = getattr(b.log, "repairer", None)
        if repairer is not None:     # DLedger: dledger/repair.py fetches corrupt entries from peers
            yield CounterMetricFamily("rocketmq_store_repaired_entries", "Corrupt entries rewritten in place with "
                                      "a peer's verified copy", value=repairer.repaired)
            yield CounterMetricFamily("rocketmq_store_repair_failures", "Fetches of a corrupt entry from a peer "
                                      "that failed (refused, no answer in time, bytes that do not verify)",
                                      value=repairer.failures)
            yield GaugeMetricFamily("rocketmq_store_repair_pending_entries", "Corrupt entries waiting for a repair "
                                    "from a peer", value=repairer.pending_entries())
            yield CounterMetricFamily("rocketmq_store_repair_served_fetches", "Peers' fetches of entries this "
                                      "node answered with verified entries",
                                      value=repairer.metrics["serve_entries_answers"])
        role = GaugeMetricFamily("rocketmq_node_role", "1 for this node's current role", labels=["role"])
        current = b.log.role()
        for r in ROLE_VALUES:
            role.add_metric([r], 1 if r == current else 0)
        yield role
        fs = self.fs
        if isinstance(fs, TimedFileSystem):
            yield fs.fsync_seconds.family("rocketmq_fsync_latency_seconds",
                                          "Time of each fsync (data files and directories)")
        yield cold_reads.FILLS.family("rocketmq_store_cold_read_fill_seconds",
                                      "Each read of old bytes (pulls, HA and DLedger pushes far behind the log's "
                                      "end) made by a worker thread, off the event loop")
        watchdog = getattr(b, "loop_watchdog", None)
        if watchdog is not None:   # node/loop_watchdog.py
            yield watchdog.histogram.family("rocketmq_event_loop_stall_seconds",
                                            "Each time the event loop was blocked past loopStallWarnMs")
            yield CounterMetricFamily("rocketmq_process_pauses", "Gaps past loopStallWarnMs in which the whole "
                                      "process was paused (SIGSTOP, the host), not counted as loop stalls",
                                      value=watchdog.pauses)

    def _traffic_families(self) -> Iterator[Metric]:
        t: TrafficStats | None = getattr(self.broker, "traffic", None)
        if t is None:
            return
        for name, doc, table in (
                ("rocketmq_producer_messages", "Messages acknowledged to producers, per topic", t.in_messages),
                ("rocketmq_producer_message_bytes", "Body bytes acknowledged to producers, per topic", t.in_bytes),
                ("rocketmq_consumer_messages", "Messages returned by pulls, per topic", t.out_messages),
                ("rocketmq_consumer_message_bytes", "Body bytes returned by pulls, per topic", t.out_bytes)):
            fam = CounterMetricFamily(name, doc, labels=["topic"])
            for topic, v in sorted(table.items()):
                fam.add_metric([topic], v)
            yield fam
        tin, tout = t.tps()
        yield GaugeMetricFamily("rocketmq_producer_tps", "Messages in per second (last 10 s)", value=tin)
        yield GaugeMetricFamily("rocketmq_consumer_tps", "Messages out per second (last 10 s)", value=tout)

    def _lag_families(self) -> Iterator[Metric]:
        """Lag = queue max offset - committed consumer offset, per (topic, queue, group)."""
        b = self.broker
        lag = GaugeMetricFamily("rocketmq_consumer_lag_messages", "Messages not yet consumed by a group",
                                labels=["topic", "queue", "group"])
        offset = GaugeMetricFamily("rocketmq_consumer_offset", "Committed consumer offset",
                                   labels=["topic", "queue", "group"])
        max_off = GaugeMetricFamily("rocketmq_queue_max_offset", "Next offset to be written in a queue",
                                    labels=["topic", "queue"])
        n = 0
        for key in sorted(b.offsets):
            topic, _, group = key.rpartition("@")
            if topic.startswith("RMQ_SYS_") or topic not in b.topics:
                continue
            for qid, off in sorted(b.offsets[key].items()):
                n += 1
                if n > MAX_LAG_SERIES:
                    break
                hi = _queue_max(b, topic, qid)
                lag.add_metric([topic, str(qid), group], max(0, hi - off))
                offset.add_metric([topic, str(qid), group], off)
        for topic in sorted(b.topics)[:MAX_TOPIC_SERIES]:
            cfg = b.topics[topic]
            for qid in range(max(cfg.read_queue_nums, cfg.write_queue_nums)):
                max_off.add_metric([topic, str(qid)], _queue_max(b, topic, qid))
        yield lag
        yield offset
        yield max_off

    def _disk_families(self) -> Iterator[Metric]:
        root = self.broker.config.store_root
        yield GaugeMetricFamily("rocketmq_store_size_bytes", "Bytes allocated by the store directory",
                                value=store_size_bytes(root))
        try:
            st = os.statvfs(root)
        except OSError:
            return
        total = st.f_blocks * st.f_frsize
        used = total - st.f_bfree * st.f_frsize
        yield GaugeMetricFamily("rocketmq_store_disk_used_ratio", "Used fraction of the store's file system",
                                value=used / total if total else 0.0)
        yield GaugeMetricFamily("rocketmq_store_disk_free_bytes", "Free bytes on the store's file system",
                                value=st.f_bavail * st.f_frsize)

    def _raft_families(self, st: dict) -> Iterator[Metric]:
        yield GaugeMetricFamily("rocketmq_raft_term", "Current Raft term", value=st.get("term") or 0)
        yield GaugeMetricFamily("rocketmq_raft_commit_index", "Highest Raft index known committed",
                                value=st.get("commit_index") or 0)
        yield GaugeMetricFamily("rocketmq_raft_applied_index", "Highest Raft index applied to the commitlog",
                                value=st.get("applied_index") or 0)
        yield GaugeMetricFamily("rocketmq_raft_last_index", "Last Raft index in the local log",
                                value=st.get("last_index") or 0)
        yield GaugeMetricFamily("rocketmq_raft_is_leader", "1 when this node is the Raft leader",
                                value=1 if st.get("role") == "LEADER" else 0)
        yield CounterMetricFamily("rocketmq_raft_leader_changes", "Times this node saw the leader change",
                                  value=getattr(self.broker.log, "leader_changes", 0))
        match = GaugeMetricFamily("rocketmq_raft_peer_match_index", "Leader's match index per follower",
                                  labels=["peer"])
        for peer, p in sorted((st.get("peers") or {}).items()):
            match.add_metric([peer], p.get("match_index") or 0)
        yield match

    def _ha_families(self, st: dict) -> Iterator[Metric]:
        yield GaugeMetricFamily("rocketmq_ha_master_epoch", "Master epoch known to this broker",
                                value=st.get("master_epoch") or 0)
        yield GaugeMetricFamily("rocketmq_ha_slave_ack_offset", "Highest commitlog offset a slave acknowledged",
                                value=st.get("ha_slave_ack_offset") or 0)
        yield GaugeMetricFamily("rocketmq_ha_lag_bytes", "Master's written bytes not yet acked by the best slave",
                                value=st.get("ha_lag_bytes") or 0)


def _gauge(name: str, doc: str, labels: list[str], values: list[str], value: float) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, doc, labels=labels)
    fam.add_metric(values, value)
    return fam


def _queue_max(broker: Any, topic: str, qid: int) -> int:
    cq = broker.cq_store.get(topic, qid)
    return cq.max_offset if cq is not None else 0


def node_registry(broker: Any, fs: FileSystem | None = None) -> CollectorRegistry:
    """A fresh registry holding this node's collector (never the process-global one)."""
    registry = CollectorRegistry()
    registry.register(NodeCollector(broker, fs if fs is not None else getattr(broker, "fs", None)))
    from node.limits import RejectionsCollector   # rocketmq_limit_rejections_total{limit}
    registry.register(RejectionsCollector())
    from node.tls import HandshakeFailuresCollector   # rocketmq_tls_handshake_failures_total{listener}
    registry.register(HandshakeFailuresCollector())
    return registry


# --- controller ------------------------------------------------------------------------------------
class ControllerCollector:
    """Controller epoch, SyncStateSet size and Raft role, from the replicated state at scrape time."""

    def __init__(self, sm: Any):
        self.sm = sm

    def collect(self) -> Iterator[Metric]:
        st = self.sm.snapshot()
        yield GaugeMetricFamily("rocketmq_controller_is_leader", "1 when this controller leads its Raft group",
                                value=1 if self.sm.is_leader() else 0)
        epoch = GaugeMetricFamily("rocketmq_controller_master_epoch", "Master epoch per broker group",
                                  labels=["group"])
        sss = GaugeMetricFamily("rocketmq_controller_sync_state_set_size", "Replicas in the SyncStateSet",
                                labels=["group"])
        master = GaugeMetricFamily("rocketmq_controller_master_id", "Broker id of the group's master (-1 none)",
                                   labels=["group"])
        for name, g in sorted(st.get("groups", {}).items()):
            epoch.add_metric([name], g.get("master_epoch") or 0)
            sss.add_metric([name], len(g.get("sss") or ()))
            mid = g.get("master_id")
            master.add_metric([name], -1 if mid is None else mid)
        yield epoch
        yield sss
        yield master
        yield GaugeMetricFamily("rocketmq_controller_topics", "Topics with routes", value=len(st.get("topics", {})))


def controller_registry(sm: Any) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(ControllerCollector(sm))
    from node.tls import HandshakeFailuresCollector   # rocketmq_tls_handshake_failures_total{listener}
    registry.register(HandshakeFailuresCollector())
    return registry
