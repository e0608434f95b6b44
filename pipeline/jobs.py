"""Pipeline jobs: rebuild, audit, export, stats.

- `rebuild(store, target)`: consume queues and index files from the committed log,
  byte-identical to what the node's dispatcher writes for the same store. Stage 1 (one
  Spark task per segment) parses records and packs, per message, the CQ unit and the
  index key hashes the dispatcher would compute (same helpers: node.store.message,
  node.store.index_file, the dispatcher's tag / delivery-time rule). Stage 2 (tasks
  grouped by (topic, queue_id)) writes each queue through the node's own `ConsumeQueue`.
  Index files must be written in commitlog order (hash chains link entries across the
  whole file), so the driver feeds the node's `IndexService.put_hash` while stage 2 runs.
- `audit(replicas)`: compares DLedger replicas entry by entry (index, term, pos,
  chain_crc, body_crc); first divergence, uncommitted tails, CRC failures.
- `export(store, out)`: Parquet partitioned by topic and store date (UTC).
- `stats(store)`: per topic/queue counts, bytes, offset and time ranges, key cardinality.

Every job takes an optional SparkSession; the scan-based ones (rebuild, audit) also run
without Spark (`spark=None`), task by task in this process, which the pure tests use.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import types
from array import array
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from node.store import layout as L
from node.store.consume_queue import ConsumeQueue
from node.store.dispatcher import DEFAULT_DELAY_LEVELS_MS, SCHEDULE_TOPIC, Dispatcher
from node.store.fileio import FileSystem
from node.store.index_file import IndexService, index_key_hash
from node.store.message import (KEY_SEPARATOR, PROPERTY_DELAY_TIME_LEVEL, PROPERTY_KEYS, PROPERTY_TAGS,
                                PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX, decode_properties, tags_code)
from pipeline import index_build
from pipeline import parsers as P

try:  # the node's fast topic#key hasher (same value as index_key_hash); private there today
    from node.store.index_file import _KeyHasher as _NodeKeyHasher
except ImportError:  # pragma: no cover - fall back to the public, slower function
    _NodeKeyHasher = None

log = logging.getLogger(__name__)

_TX_MASK = L.SYSFLAG_TRANSACTION_MASK
_TX_NO_CQ = (L.SYSFLAG_TRANSACTION_PREPARED_TYPE, L.SYSFLAG_TRANSACTION_ROLLBACK_TYPE)
_TX_ROLLBACK = L.SYSFLAG_TRANSACTION_ROLLBACK_TYPE
_CQ_UNIT = L.CQ_UNIT
_UNIT_SIZE = L.CQ_UNIT.size
MAX_TAG_CACHE = 10_000


class JobError(RuntimeError):
    """A job cannot produce a trustworthy result; the message says why and what to do."""


# --- Spark plumbing ------------------------------------------------------------------------------
def get_spark(master: str = "local[*]", app_name: str = "mqstore-pipeline", conf: dict | None = None):
    """A SparkSession whose Python workers run this interpreter, UTC session time zone."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # Python workers import pipeline/ and node/ by name: put the repository on their path.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root] + [p for p in paths if p])
    from pyspark.sql import SparkSession
    b = (SparkSession.builder.master(master).appName(app_name)
         .config("spark.sql.session.timeZone", "UTC")
         .config("spark.ui.showConsoleProgress", "false"))
    for k, v in (conf or {}).items():
        b = b.config(k, v)
    spark = b.getOrCreate()
    from pipeline.source import MqstoreDataSource
    spark.dataSource.register(MqstoreDataSource)
    return spark


def run_tasks(spark, fn: Callable, tasks: Sequence) -> list:
    """fn over tasks, one Spark task each (results in task order); in-process when spark is None."""
    if spark is None or not tasks:
        return [fn(t) for t in tasks]
    return spark.sparkContext.parallelize(list(tasks), len(tasks)).map(fn).collect()


# --- Rebuild: stage 1 (per segment) ------------------------------------------------------------
@dataclass(frozen=True)
class ScanTask:
    path: str
    base_offset: int
    kind: str
    committed_index: int | None          # DLedger: entries above it are skipped
    check_crc: bool = True
    delay_levels_ms: tuple = DEFAULT_DELAY_LEVELS_MS


@dataclass
class SegmentUnits:
    """Stage-1 output of one segment: CQ runs, index entries (hash, phy, ts), its report."""

    base_offset: int
    runs: list            # [(topic, queue_id, first_queue_offset, packed units)]
    index: bytes          # array('q') of (key_hash, phy_offset, store_timestamp) triples
    report: dict
    records: int = 0
    units: int = 0
    last_store_ts: int = 0
    cpu_s: float = 0.0    # CPU time of the task (benchmarks compare it with the dispatcher's)


class _TagCoder:
    """The dispatcher's tags code: String.hashCode of TAGS, delivery time on SCHEDULE_TOPIC."""

    def __init__(self, delay_levels_ms: tuple):
        # Dispatcher.delivery_time only reads delay_levels_ms: borrow it, one copy of the rule.
        self._levels = types.SimpleNamespace(delay_levels_ms=tuple(delay_levels_ms))
        self._cache: dict[str, int] = {}

    def __call__(self, topic: str, props: dict, store_ts: int) -> int:
        if topic == SCHEDULE_TOPIC:
            level = props.get(PROPERTY_DELAY_TIME_LEVEL)
            if level:
                return Dispatcher.delivery_time(self._levels, level, store_ts)
        tags = props.get(PROPERTY_TAGS)
        if not tags:
            return 0
        code = self._cache.get(tags)
        if code is None:
            if len(self._cache) >= MAX_TAG_CACHE:
                self._cache.clear()
            code = self._cache[tags] = tags_code(tags)
        return code


def _iter_units(task: ScanTask, report: P.ParseReport):
    if task.kind == P.KIND_COMMITLOG:
        return P.parse_commitlog_units(task.path, task.base_offset, check_crc=task.check_crc, report=report)
    assert task.committed_index is not None, "DLedger rebuild needs the committed index"
    return P.parse_dledger_units(task.path, task.base_offset, check_crc=task.check_crc,
                                 max_index=task.committed_index, report=report)


def scan_segment_units(task: ScanTask) -> SegmentUnits:
    """Stage 1: what the dispatcher would write for each committed record of one segment."""
    cpu0 = time.process_time()
    report = P.ParseReport()
    hasher = _NodeKeyHasher() if _NodeKeyHasher is not None else index_key_hash
    coder = _TagCoder(task.delay_levels_ms)
    runs: dict[tuple[str, int], list] = {}
    done: list = []
    index = array("q")
    pack = _CQ_UNIT.pack
    records = units = last_ts = 0
    for phy, size, topic, qid, qoff, sys_flag, store_ts, _born, props_raw in _iter_units(task, report):
        records += 1
        last_ts = store_ts
        props = decode_properties(props_raw) if props_raw else {}
        tx = sys_flag & _TX_MASK
        if tx not in _TX_NO_CQ:
            units += 1
            unit = pack(phy, size, coder(topic, props, store_ts))
            run = runs.get((topic, qid))
            if run is not None and run[2] + run[3] == qoff:
                run[4] += unit
                run[3] += 1
            else:
                if run is not None:
                    done.append(run)
                runs[(topic, qid)] = [topic, qid, qoff, 1, bytearray(unit)]
        if tx != _TX_ROLLBACK and props:
            _index_entries(hasher, topic, props, phy, store_ts, index)
    done.extend(runs.values())
    return SegmentUnits(task.base_offset, [(r[0], r[1], r[2], bytes(r[4])) for r in done], index.tobytes(),
                        report.as_dict(), records, units, last_ts, time.process_time() - cpu0)


def _index_entries(hasher, topic: str, props: dict, phy: int, ts: int, out: array) -> None:
    """IndexService.build_index's keys, in its order: UNIQ_KEY, then each KEYS word."""
    uniq = props.get(PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX)
    if uniq:
        out.extend((hasher(topic, uniq), phy, ts))
    keys = props.get(PROPERTY_KEYS)
    if keys:
        for k in keys.split(KEY_SEPARATOR):
            if k:
                out.extend((hasher(topic, k), phy, ts))


# --- Rebuild: checks between the stages -------------------------------------------------------
@dataclass
class LogCheck:
    """Where the committed log's readable data ends, and why it ends there."""

    valid_end: int | None = None          # first offset not covered (None: the log ends normally)
    problems: list = field(default_factory=list)


def check_reports(reports: list[dict]) -> LogCheck:
    """A corrupt record, or data after a segment that ended early, ends the valid log there.

    The node's recovery would cut the log at that point, so nothing after it is committed
    data a dispatcher could see.
    """
    out = LogCheck()
    ended_at: dict | None = None
    for r in reports:
        if ended_at is not None and r["records"] > 0:
            out.problems.append(f"{r['path']}: {r['records']} record(s) after the data ended in "
                                f"{ended_at['path']} at offset {ended_at['data_end']}")
            if out.valid_end is None:
                out.valid_end = ended_at["data_end"]
        if r["end_reason"] == P.END_CORRUPT:
            out.problems.append(f"{r['path']}: corrupt record at offset {r['corrupt_offset']}: {r['corrupt_reason']}")
            if out.valid_end is None:
                out.valid_end = r["corrupt_offset"]
        if ended_at is None and r["end_reason"] in (P.END_ZERO, P.END_CORRUPT, P.END_LIMIT):
            ended_at = r
    return out


def _trim_units(data: bytes, valid_end: int | None) -> bytes:
    """Drop units that point at or past valid_end (packed units are in offset order)."""
    if valid_end is None:
        return data
    n = len(data) // _UNIT_SIZE
    lo, hi = 0, n
    while lo < hi:  # first unit whose commitlog offset >= valid_end
        mid = (lo + hi) // 2
        if _CQ_UNIT.unpack_from(data, mid * _UNIT_SIZE)[0] >= valid_end:
            hi = mid
        else:
            lo = mid + 1
    return data[:lo * _UNIT_SIZE]


# --- Rebuild: stage 2 (per queue) and the driver's index -------------------------------------
def write_queue_runs(target_dir: str, units_per_file: int, queue_runs: Iterable) -> list[tuple]:
    """Write (topic, qid) -> runs through the node's ConsumeQueue; return (topic, qid, units, max)."""
    fs = FileSystem()
    out = []
    for (topic, qid), runs in queue_runs:
        cq = ConsumeQueue(fs, target_dir, topic, qid, units_per_file)
        count = 0
        for first, data in sorted(runs, key=lambda r: r[0]):
            if data:
                cq.put_units(first, data)
                count += len(data) // _UNIT_SIZE
        cq.flush()
        out.append((topic, qid, count, cq.max_offset))
        cq.close()
    return out


def _index_triples(blobs: Iterable[bytes], valid_end: int | None) -> array:
    """Concatenate stage-1 index blobs; cut entries at or past valid_end."""
    flat = array("q")
    for blob in blobs:
        flat.frombytes(blob)
    if valid_end is not None:
        for i in range(1, len(flat), 3):   # phys are ascending: stop at the first one past the end
            if flat[i] >= valid_end:
                del flat[i - 1:]
                break
    return flat


def build_index(target_dir: str, blobs: Iterable[bytes], hash_slots: int, max_entries: int,
                valid_end: int | None, writer: str = "bulk") -> int:
    """Index files from (hash, phy, ts) triples in commitlog order; return entries written.

    writer="node" feeds the node's IndexService entry by entry (the reference);
    writer="bulk" (default) writes the same bytes in one pass (pipeline.index_build).
    """
    flat = _index_triples(blobs, valid_end)
    n = len(flat) // 3
    if writer == "bulk":
        index_build.write_index(target_dir, flat, hash_slots, max_entries)
        return n
    assert writer == "node", writer
    svc = IndexService(FileSystem(), target_dir, hash_slots=hash_slots, max_entries=max_entries)
    svc.load()
    f = None                      # the writable file; IndexService.put_hash rolls when it is full
    for i in range(0, len(flat), 3):
        # Same as svc.put_hash (which looks the writable file up on every call), minus the lookup.
        if f is None or not f.put_hash(flat[i], flat[i + 1], flat[i + 2]):
            svc.put_hash(flat[i], flat[i + 1], flat[i + 2])
            f = svc.files[-1]
    svc.flush()
    svc.close()
    return n


@dataclass
class RebuildResult:
    segments: int
    records: int
    units: int
    index_entries: int
    queues: dict                  # "topic/qid" -> max offset
    problems: list
    valid_end: int | None
    committed_index: int | None
    timings_s: dict = field(default_factory=dict)   # scan, write (CQ + index), total

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def rebuild(store_dir: str, target_dir: str, *, spark=None, committed_index: int | None = None,
            units_per_file: int = L.CQ_UNITS_PER_FILE, index_hash_slots: int = L.INDEX_SLOTS_DEFAULT,
            index_max_entries: int = L.INDEX_ENTRIES_DEFAULT, delay_levels_ms: tuple = DEFAULT_DELAY_LEVELS_MS,
            check_crc: bool = True, stop_at_corruption: bool = False, cq_writer: str = "driver",
            index_writer: str = "bulk") -> RebuildResult:
    """Write consumequeue/ and index/ under target_dir from the committed log of store_dir.

    The geometry options must be the node's (mappedFileSizeConsumeQueue / 20, maxHashSlotNum,
    maxIndexNum, messageDelayLevel) for the files to be byte-identical. A corrupt log raises
    JobError unless stop_at_corruption, which rebuilds up to the first bad record.

    cq_writer="driver" (default) collects the packed units (20 bytes a message) and writes
    them here through the node's ConsumeQueue: cheap, and the target is this machine's disk.
    cq_writer="tasks" writes each queue inside Spark tasks grouped by (topic, queue_id)
    (target_dir must then be shared by the executors); the driver builds the index meanwhile.
    """
    if cq_writer not in ("driver", "tasks") or index_writer not in ("bulk", "node"):
        raise JobError(f"cq_writer must be driver|tasks, index_writer bulk|node; got {cq_writer}, {index_writer}")
    from pipeline.source import committed_bound
    kind = P.detect_store_kind(store_dir)
    ci = committed_bound(store_dir, kind, committed_index)
    if kind == P.KIND_DLEDGER and ci is None:
        raise JobError(f"{store_dir}: cannot tell which DLedger entries are committed (no committedIndex "
                       "given and no checkpoint); pass --committed-index")
    if os.path.isdir(os.path.join(target_dir, "consumequeue")) or os.path.isdir(os.path.join(target_dir, "index")):
        raise JobError(f"{target_dir} already holds consumequeue/ or index/; rebuild writes into an empty target")
    tasks = [ScanTask(s.path, s.base_offset, s.kind, ci, check_crc, tuple(delay_levels_ms))
             for s in P.list_segments(store_dir)]
    t0 = time.perf_counter()
    stage1 = _stage1(spark, tasks, keep_runs_on_executors=(cq_writer == "tasks"))
    t1, c1 = time.perf_counter(), time.process_time()
    reports = [s.report for s in stage1.summaries]
    check = check_reports(reports)
    if check.problems and not stop_at_corruption:
        raise JobError("the log is damaged; nothing written:\n  " + "\n  ".join(check.problems)
                       + "\n(--stop-at-corruption rebuilds up to the first bad record, as recovery would cut)")
    os.makedirs(target_dir, exist_ok=True)
    queues, entries = _stage2_and_index(spark, stage1, target_dir, units_per_file, index_hash_slots,
                                        index_max_entries, check.valid_end, index_writer)
    t2 = time.perf_counter()
    return RebuildResult(len(tasks), sum(s.records for s in stage1.summaries), sum(q[2] for q in queues),
                         entries, {f"{t}/{q}": m for t, q, _n, m in sorted(queues)}, check.problems,
                         check.valid_end, ci, {"scan": round(t1 - t0, 3), "write": round(t2 - t1, 3),
                                               "total": round(t2 - t0, 3),
                                               "scan_task_cpu": round(sum(s.cpu_s for s in stage1.summaries), 3),
                                               "write_driver_cpu": round(time.process_time() - c1, 3)})


@dataclass
class _Stage1:
    summaries: list                # SegmentUnits (with runs unless they stay on the executors)
    rdd: object = None             # cached RDD of SegmentUnits when the runs stay on the executors


def _stage1(spark, tasks: list[ScanTask], keep_runs_on_executors: bool) -> _Stage1:
    if spark is None:
        return _Stage1([scan_segment_units(t) for t in tasks])
    sc = spark.sparkContext
    sc.setJobDescription("rebuild: scan segments")
    rdd = sc.parallelize(tasks, max(1, len(tasks))).map(scan_segment_units)
    if not keep_runs_on_executors:
        return _Stage1(rdd.collect())
    from pyspark import StorageLevel
    rdd.persist(StorageLevel.MEMORY_AND_DISK)
    # Runs stay on the executors (cached); the driver takes index blobs and reports only.
    summaries = rdd.map(lambda s: SegmentUnits(s.base_offset, [], s.index, s.report, s.records, s.units,
                                                s.last_store_ts, s.cpu_s)).collect()
    return _Stage1(summaries, rdd)


def _group_runs(summaries: list, valid_end: int | None) -> dict:
    grouped: dict[tuple[str, int], list] = {}
    for s in summaries:
        for topic, qid, first, data in s.runs:
            grouped.setdefault((topic, qid), []).append((first, _trim_units(data, valid_end)))
    return grouped


def _stage2_and_index(spark, stage1: _Stage1, target_dir: str, units_per_file: int, hash_slots: int,
                      max_entries: int, valid_end: int | None, index_writer: str) -> tuple[list, int]:
    blobs = [s.index for s in stage1.summaries]
    if stage1.rdd is None:
        queues = write_queue_runs(target_dir, units_per_file, _group_runs(stage1.summaries, valid_end).items())
        return queues, build_index(target_dir, blobs, hash_slots, max_entries, valid_end, index_writer)
    # CQ writes run as Spark tasks in a thread while the driver builds the index.
    box: dict = {}

    def cq_job() -> None:
        try:
            box["queues"] = _spark_write_queues(spark, stage1.rdd, target_dir, units_per_file, valid_end)
        except Exception as e:  # noqa: BLE001 - handed to the main thread and re-raised there
            box["error"] = e
    t = threading.Thread(target=cq_job, name="rebuild-cq", daemon=True)
    t.start()
    entries = build_index(target_dir, blobs, hash_slots, max_entries, valid_end, index_writer)
    t.join()
    stage1.rdd.unpersist()
    if "error" in box:
        raise box["error"]
    return box["queues"], entries


def _spark_write_queues(spark, rdd, target_dir: str, units_per_file: int, valid_end: int | None) -> list:
    sc = spark.sparkContext
    sc.setLocalProperty("spark.job.description", "rebuild: write consume queues")
    pairs = rdd.flatMap(lambda s: [((t, q), (first, _trim_units(d, valid_end))) for t, q, first, d in s.runs])
    nparts = max(1, min(sc.defaultParallelism * 2, pairs.getNumPartitions() * 4))
    return (pairs.groupByKey(nparts)
            .mapPartitions(lambda it: write_queue_runs(target_dir, units_per_file, it))
            .collect())


# --- Audit -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AuditTask:
    replica: int
    path: str
    base_offset: int
    prev_chain_crc: int | None     # seed for the segment's first entry when known (first segment)
    check_crc: bool = True


@dataclass
class SegmentEntries:
    replica: int
    base_offset: int
    entries: bytes                 # array('q') of (index, term, pos, chain_crc, body_crc) quintuples
    first_prefix: bytes            # header[0:36] of the first entry (chain check across files)
    first_body_crc: int
    report: dict


_AUDIT_FIELDS = ("index", "term", "pos", "chain_crc", "body_crc")


def scan_segment_entries(task: AuditTask) -> SegmentEntries:
    report = P.ParseReport()
    out = array("q")
    prefix = b""
    first_body_crc = 0
    for e in P.parse_dledger_segment(task.path, task.base_offset, check_crc=task.check_crc, with_message=False,
                                     prev_chain_crc=task.prev_chain_crc, report=report):
        if not prefix:
            first_body_crc = e[6]
            prefix = _read_prefix(task.path, e[2] - task.base_offset)
        out.extend((e[0], e[1], e[2], e[5], e[6]))
    return SegmentEntries(task.replica, task.base_offset, out.tobytes(), prefix, first_body_crc, report.as_dict())


def _read_prefix(path: str, rel: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(rel)
        return f.read(L.ENTRY_CHAIN_CRC_SPAN)


@dataclass
class ReplicaLog:
    """One replica's entries after the scan, indexed by Raft index."""

    store_dir: str
    committed_index: int | None
    base_index: int = 0           # the log starts after this index (meta; 0 = from the beginning)
    base_chain: int = 0           # chain CRC seed of entry base_index + 1
    entries: dict = field(default_factory=dict)   # index -> (term, pos, chain_crc, body_crc)
    crc_failures: list = field(default_factory=list)
    corrupt: list = field(default_factory=list)

    @property
    def last_index(self) -> int:
        return max(self.entries) if self.entries else 0


@dataclass
class AuditResult:
    replicas: list
    committed_index: int | None
    first_divergence: dict | None          # first index where two replicas differ
    committed_divergence: bool             # ... at or below the committed index
    uncommitted_tails: dict                # replica -> [first, last] indexes above committed
    crc_failures: list                     # chain CRC failures and corrupt records, per replica
    last_index: dict
    ok: bool

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    @property
    def exit_code(self) -> int:
        """0 clean; 2 divergence in the committed prefix; 3 CRC failure / corruption in it."""
        if self.committed_divergence:
            return 2
        return 0 if self.ok else 3


def audit(replica_dirs: Sequence[str], *, spark=None, committed_index: int | None = None,
          check_crc: bool = True) -> AuditResult:
    """Compare DLedger replicas entry by entry. The committed prefix ends at `committed_index`
    (default: the highest committed index any replica's meta or checkpoint proves)."""
    from pipeline.source import committed_bound
    if len(replica_dirs) < 1:
        raise JobError("audit needs at least one replica directory")
    tasks = []
    for i, d in enumerate(replica_dirs):
        if P.detect_store_kind(d) != P.KIND_DLEDGER:
            raise JobError(f"{d}: audit compares DLedger replicas; this is a commitlog store")
        for s in P.list_segments(d):
            tasks.append(AuditTask(i, s.path, s.base_offset, None, check_crc))
    scans = run_tasks(spark, scan_segment_entries, tasks)
    replicas = []
    for d in replica_dirs:
        meta = P.read_dledger_meta(d) or {}
        replicas.append(ReplicaLog(d, committed_bound(d, P.KIND_DLEDGER, None), int(meta.get("base_index", 0)),
                                   int(meta.get("base_chain", 0))))
    for s in scans:
        _absorb(replicas[s.replica], s)
    for r in replicas:
        _check_chain_boundaries(r, [s for s in scans if replicas[s.replica] is r])
    ci = committed_index
    if ci is None:
        known = [r.committed_index for r in replicas if r.committed_index is not None]
        ci = max(known) if known else None
    return _compare(replicas, ci)


def _absorb(r: ReplicaLog, s: SegmentEntries) -> None:
    a = array("q")
    a.frombytes(s.entries)
    for i in range(0, len(a), 5):
        r.entries[a[i]] = (a[i + 1], a[i + 2], a[i + 3] & 0xFFFFFFFF, a[i + 4] & 0xFFFFFFFF)
    rep = s.report
    for idx in rep["chain_failures"]:
        r.crc_failures.append({"index": idx, "reason": "chain crc mismatch", "path": rep["path"]})
    if rep["end_reason"] == P.END_CORRUPT:
        r.corrupt.append({"offset": rep["corrupt_offset"], "reason": rep["corrupt_reason"], "path": rep["path"],
                          "after_index": rep["last_index"]})


def _check_chain_boundaries(r: ReplicaLog, scans: list[SegmentEntries]) -> None:
    """The first entry of each file is chained to the last entry of the one before it
    (or to 0 for the log's first entry, index 1)."""
    from dledger.entry import chain_crc_of
    for s in sorted(scans, key=lambda x: x.base_offset):
        if not s.first_prefix:
            continue
        a = array("q")
        a.frombytes(s.entries[:40])
        first = a[0]
        if first == r.base_index + 1:
            prev = r.base_chain
        else:
            prev = r.entries.get(first - 1, (None, None, None))[2]
        if prev is None:
            continue
        if chain_crc_of(s.first_prefix, s.first_body_crc, prev) != (a[3] & 0xFFFFFFFF):
            r.crc_failures.append({"index": first, "reason": "chain crc mismatch", "path": s.report["path"]})


def _compare(replicas: list[ReplicaLog], ci: int | None) -> AuditResult:
    last = {r.store_dir: r.last_index for r in replicas}
    top = max(last.values()) if last else 0
    first_div = None
    for idx in range(1, top + 1):  # bounded by the longest log
        seen = [(r.store_dir, r.entries[idx]) for r in replicas if idx in r.entries]
        if len({v for _d, v in seen}) > 1:
            first_div = {"index": idx, "committed": ci is not None and idx <= ci,
                         "replicas": {d: dict(zip(_AUDIT_FIELDS[1:], v)) for d, v in seen}}
            break
    tails = {r.store_dir: [ci + 1, r.last_index] for r in replicas
             if ci is not None and r.last_index > ci}
    failures = []
    for r in replicas:
        for f in r.crc_failures + r.corrupt:
            failures.append(dict(f, replica=r.store_dir))
    committed_div = bool(first_div and first_div["committed"])
    bad_committed = any(_in_committed(f, ci) for f in failures)
    return AuditResult([r.store_dir for r in replicas], ci, first_div, committed_div, tails, failures, last,
                       ok=not committed_div and not bad_committed)


def _in_committed(failure: dict, ci: int | None) -> bool:
    """A failure counts against the committed prefix if it is at or below ci (unknown ci: always)."""
    idx = failure.get("index", failure.get("after_index"))
    if ci is None or idx is None:
        return True
    return idx <= ci if "index" in failure else idx < ci


# --- Export and stats (DataFrame jobs over the data source) --------------------------------
def read_store(spark, store_dir: str, **options):
    # Checked here, on the driver: inside the data source a bad path comes back wrapped
    # in Spark's planner errors.
    P.detect_store_kind(store_dir)
    r = spark.read.format("mqstore").option("path", store_dir)
    for k, v in options.items():
        if v is not None:
            r = r.option(k, str(v).lower() if isinstance(v, bool) else str(v))
    return r.load()


def export(spark, store_dir: str, out_dir: str, *, mode: str = "errorifexists", topics: str | None = None,
           committed_index: int | None = None) -> dict:
    """Parquet under out_dir/topic=<t>/store_date=<yyyy-mm-dd>/ (UTC dates)."""
    from pyspark.sql import functions as F
    df = read_store(spark, store_dir, topics=topics, committedIndex=committed_index)
    df = df.withColumn("store_date", F.to_date(F.col("store_timestamp")))
    spark.sparkContext.setJobDescription("export: write parquet")
    df.write.mode(mode).partitionBy("topic", "store_date").parquet(out_dir)
    written = spark.read.parquet(out_dir)
    return {"out_dir": out_dir, "rows": written.count(),
            "partitions": written.select("topic", "store_date").distinct().count()}


def stats(spark, store_dir: str, *, committed_index: int | None = None) -> list[dict]:
    """Per (topic, queue_id): messages, bytes, offsets, store-time range, distinct keys.

    One pass: each message is exploded into one row per KEYS word (posexplode_outer keeps
    messages without keys as one row with pos null), so per-message sums count pos 0 / null only.
    """
    from pyspark.sql import functions as F
    df = read_store(spark, store_dir, includeBody=False, committedIndex=committed_index)
    words = F.filter(F.split(F.coalesce(F.col("keys"), F.lit("")), " "), lambda k: k != "")
    rows = df.select("topic", "queue_id", "queue_offset", "size", "store_timestamp",
                     F.posexplode_outer(words).alias("pos", "key"))
    first = F.col("pos").isNull() | (F.col("pos") == 0)
    agg = (rows.groupBy("topic", "queue_id")
           .agg(F.count(F.when(first, 1)).alias("messages"),
                F.sum(F.when(first, F.col("size"))).alias("bytes"),
                F.min(F.when(F.col("queue_offset") >= 0, F.col("queue_offset"))).alias("min_queue_offset"),
                F.max("queue_offset").alias("max_queue_offset"),
                F.min("store_timestamp").alias("first_store_time"),
                F.max("store_timestamp").alias("last_store_time"),
                F.count_distinct("key").alias("distinct_keys"))
           .orderBy("topic", "queue_id"))
    spark.sparkContext.setJobDescription("stats")
    out = []
    for row in agg.collect():
        d = row.asDict()
        for k in ("first_store_time", "last_store_time"):
            d[k] = d[k].isoformat() if d[k] is not None else None
        out.append(d)
    return out
