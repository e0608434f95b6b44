"""The `mqstore` Spark data source (Python Data Source API, Spark 4).

    from pipeline.source import MqstoreDataSource
    spark.dataSource.register(MqstoreDataSource)
    df = spark.read.format("mqstore").option("path", "/data/store").load()
    df = (spark.read.format("mqstore").option("endpoint", "127.0.0.1:10911")
          .option("topics", "orders").load())

Two modes:
- `path`: a store root on a filesystem every executor can read. One partition per
  segment file (commitlog or DLedger data); each task mmaps its segment and yields
  Arrow record batches (much cheaper than row tuples through Spark's converter).
- `endpoint`: a running node's REST API (DESIGN section 6), one partition per queue,
  committed data only. `readStream` works in this mode with per-queue offsets.

Options (named after Spark's Kafka source where they mean the same thing):
  topics             comma list; default all
  startingOffsets    "earliest" (default) | "latest" | JSON {"topic": {"0": 23, "1": -2}}
  endingOffsets      "latest" (default) | JSON; -2 = earliest, -1 = latest; end is exclusive
  includeUncommitted "false" (default): DLedger entries above the committed index are left out
  committedIndex     DLedger committed index, when the store does not say (see committed_bound)
  checkCrc           "true" (default): body/entry CRCs are checked; a failure fails the task
  includeBody        "true" (default); "false" leaves `body` null and skips the copy
  onCorruption       "fail" (default) | "stop": stop the segment at the bad record, keep what came before
  batchRows          rows per Arrow batch (default 8192)
  maxRecordsPerPull  REST mode: messages per pull request (default 256)

The Python Data Source API passes no column pruning, so `includeBody=false` is the way
to skip body copies when bodies are not needed.
"""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Iterator

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.types import StructType

from mqstore.client.errors import not_leader_hint
from pipeline import parsers as P

EARLIEST = -2
LATEST = -1
_INF = 1 << 62
_REST_TIMEOUT_S = 30.0
_REST_MAX_PULLS = 1_000_000      # bound on pulls of one partition (each returns >= 1 message or ends it)


# --- Options -------------------------------------------------------------------------------
class OptionError(ValueError):
    """A data source option is malformed; the message names it."""


def _bool(options, name: str, default: bool) -> bool:
    raw = options.get(name)
    if raw is None:
        return default
    v = str(raw).strip().lower()
    if v not in ("true", "false"):
        raise OptionError(f"option {name}={raw!r}: expected true or false")
    return v == "true"


def _int(options, name: str, default: int | None) -> int | None:
    raw = options.get(name)
    if raw is None or str(raw).strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise OptionError(f"option {name}={raw!r}: expected an integer") from None


def parse_offsets(raw: str | None, default: int, name: str) -> tuple[int, dict[tuple[str, int], int]]:
    """'earliest' | 'latest' | JSON {"topic": {"qid": offset}} -> (default, per-queue offsets)."""
    if raw is None or raw.strip() == "":
        return default, {}
    text = raw.strip()
    if text in ("earliest", "latest"):
        return (EARLIEST if text == "earliest" else LATEST), {}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise OptionError(f"option {name}: not 'earliest', 'latest' or JSON ({e})") from None
    if not isinstance(obj, dict):
        raise OptionError(f"option {name}: JSON must be an object {{topic: {{queue_id: offset}}}}")
    out: dict[tuple[str, int], int] = {}
    for topic, queues in obj.items():
        if not isinstance(queues, dict):
            raise OptionError(f"option {name}: {topic!r} must map queue ids to offsets")
        for qid, off in queues.items():
            try:
                q, o = int(qid), int(off)
            except (TypeError, ValueError):
                raise OptionError(f"option {name}: {topic}/{qid} -> {off!r} is not an integer pair") from None
            if o < EARLIEST:
                raise OptionError(f"option {name}: {topic}/{qid} offset {o} (use -2 earliest, -1 latest)")
            out[(topic, q)] = o
    return default, out


@dataclass(frozen=True)
class OffsetRanges:
    """Per-queue [start, end) filters on queue_offset; picklable, cheap to test per row."""

    start_default: int
    start: dict
    end_default: int
    end: dict

    @property
    def explicit(self) -> bool:
        return bool(self.start or self.end) or self.start_default != EARLIEST or self.end_default != LATEST

    def bounds(self, topic: str, queue_id: int) -> tuple[int, int]:
        s = self.start.get((topic, queue_id), self.start_default)
        e = self.end.get((topic, queue_id), self.end_default)
        lo = 0 if s == EARLIEST else (_INF if s == LATEST else s)
        hi = _INF if e == LATEST else (0 if e == EARLIEST else e)
        return lo, hi


@dataclass(frozen=True)
class ReadOptions:
    path: str | None
    endpoint: str | None
    topics: frozenset | None
    ranges: OffsetRanges
    include_uncommitted: bool
    committed_index: int | None
    check_crc: bool
    include_body: bool
    on_corruption: str
    batch_rows: int
    max_per_pull: int


def read_options(options) -> ReadOptions:
    path, endpoint = options.get("path"), options.get("endpoint")
    if bool(path) == bool(endpoint):
        raise OptionError("give exactly one of option path (a store root) or endpoint (host:port)")
    topics = options.get("topics")
    topic_set = frozenset(t.strip() for t in topics.split(",") if t.strip()) if topics else None
    sd, so = parse_offsets(options.get("startingOffsets"), EARLIEST, "startingOffsets")
    ed, eo = parse_offsets(options.get("endingOffsets"), LATEST, "endingOffsets")
    on_corruption = (options.get("onCorruption") or "fail").lower()
    if on_corruption not in ("fail", "stop"):
        raise OptionError(f"option onCorruption={on_corruption!r}: expected fail or stop")
    batch_rows = _int(options, "batchRows", 8192)
    max_per_pull = _int(options, "maxRecordsPerPull", 256)
    if batch_rows <= 0 or max_per_pull <= 0:
        raise OptionError("options batchRows and maxRecordsPerPull must be positive")
    return ReadOptions(path, endpoint, topic_set, OffsetRanges(sd, so, ed, eo),
                       _bool(options, "includeUncommitted", False), _int(options, "committedIndex", None),
                       _bool(options, "checkCrc", True), _bool(options, "includeBody", True),
                       on_corruption, batch_rows, max_per_pull)


# --- Schemas -----------------------------------------------------------------------------------
def spark_schema() -> StructType:
    """The data source schema as a StructType, built from parsers.COLUMNS without a JVM."""
    from pyspark.sql.types import (BinaryType, BooleanType, IntegerType, LongType, MapType, StringType,
                                   StructField, TimestampType)
    types = {"string": StringType(), "int": IntegerType(), "bigint": LongType(), "boolean": BooleanType(),
             "timestamp": TimestampType(), "binary": BinaryType(),
             "map<string,string>": MapType(StringType(), StringType(), True)}
    return StructType([StructField(name, types[typ], nullable) for name, typ, nullable in P.COLUMNS])


# --- Arrow batches ---------------------------------------------------------------------------
def arrow_schema(schema: StructType):
    from pyspark.sql.pandas.types import to_arrow_schema
    return to_arrow_schema(schema, timezone="UTC")


def rows_to_batch(rows: list[tuple], pa_schema):
    """Row tuples in COLUMNS order (timestamps in epoch ms) -> one pyarrow.RecordBatch."""
    import pyarrow as pa
    cols = list(zip(*rows)) if rows else [()] * len(pa_schema)
    arrays = []
    for f, col in zip(pa_schema, cols):
        if pa.types.is_timestamp(f.type):
            # Spark timestamps are microseconds; a list comprehension beats importing
            # pyarrow.compute (~0.1 s) in every task's fresh worker process.
            assert f.type.unit == "us", f.type
            arrays.append(pa.array([None if v is None else v * 1000 for v in col], f.type))
        else:
            arrays.append(pa.array(col, f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=pa_schema)


def _batched(rows: Iterator[tuple], n: int, pa_schema) -> Iterator:
    buf: list[tuple] = []
    for r in rows:
        buf.append(r)
        if len(buf) >= n:
            yield rows_to_batch(buf, pa_schema)
            buf = []
    if buf:
        yield rows_to_batch(buf, pa_schema)


# --- Store (path) mode -----------------------------------------------------------------------
def committed_bound(store_dir: str, kind: str, option_index: int | None) -> int | None:
    """The committed DLedger index, or None when nothing says (then every entry is uncommitted).

    The `committedIndex` option wins. Otherwise the highest of two lower bounds the store
    keeps: the entry store's meta `committed` (committed and fsynced at its last checkpoint),
    and the dispatcher checkpoint's committed offset (a data position) mapped to an index
    through the DLedger index file. Commitlog stores return None: standalone and classic
    stores count every readable record as committed (committed = written there; a slave
    only holds what its master sent).
    """
    if kind != P.KIND_DLEDGER:
        return None
    if option_index is not None:
        return option_index
    bounds = []
    meta = P.read_dledger_meta(store_dir)
    if meta and int(meta.get("committed") or 0) > 0:
        bounds.append(int(meta["committed"]))
    cp = P.read_checkpoint(store_dir)
    last = _last_index_hint(store_dir) if cp is not None and cp["committed_offset"] > 0 else None
    if last is not None:
        first = max(1, int((meta or {}).get("base_index", 0)) + 1)
        found = P.dledger_last_index_within(store_dir, cp["committed_offset"], first, last)
        if found is not None:
            bounds.append(found)
    return max(bounds) if bounds else None


def _last_index_hint(store_dir: str) -> int | None:
    """Last index in the DLedger index file (its data ends at the first zero slot)."""
    d = os.path.join(P.dledger_dirs(store_dir)[0], "index")
    files = [n for n in sorted(os.listdir(d)) if len(n) == 20 and n.isdigit()] if os.path.isdir(d) else []
    if not files:
        return None
    lo = max(1, int(files[0]) // 32)
    hi = (int(files[-1]) + os.path.getsize(os.path.join(d, files[-1]))) // 32 - 1
    best = None
    while lo <= hi:  # bounded binary search over slots
        mid = (lo + hi) // 2
        if P.dledger_index_entry(store_dir, mid) is not None:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


@dataclass(frozen=True)
class SegmentTask:
    path: str
    base_offset: int
    kind: str
    committed_index: int | None


class SegmentPartition(InputPartition):
    def __init__(self, task: SegmentTask):
        super().__init__(task)
        self.task = task


def message_rows(task: SegmentTask, opts: ReadOptions, report: P.ParseReport) -> Iterator[tuple]:
    """Full-schema row tuples of one segment after the committed / topic / offset filters."""
    keep = _row_filter(opts)
    if task.kind == P.KIND_COMMITLOG:
        for m in P.parse_commitlog_segment(task.path, task.base_offset, check_crc=opts.check_crc,
                                           with_body=opts.include_body, report=report):
            if keep is None or keep(m):
                yield m + (None, None, True)
        return
    ci = task.committed_index
    max_index = None if opts.include_uncommitted else (ci if ci is not None else 0)
    for e in P.parse_dledger_segment(task.path, task.base_offset, check_crc=opts.check_crc,
                                     with_body=opts.include_body, max_index=max_index, report=report):
        m = e[8]
        if m is not None and (keep is None or keep(m)):
            yield m + (e[0], e[1], ci is not None and e[0] <= ci)


def _row_filter(opts: ReadOptions):
    """A predicate over message tuples, or None when every row passes."""
    topics = opts.topics
    ranges = opts.ranges if opts.ranges.explicit else None
    if topics is None and ranges is None:
        return None
    cache: dict[tuple[str, int], tuple[int, int]] = {}

    def keep(m: tuple) -> bool:
        if topics is not None and m[0] not in topics:
            return False
        if ranges is None:
            return True
        key = (m[0], m[1])
        b = cache.get(key)
        if b is None:
            b = cache[key] = ranges.bounds(*key)
        return b[0] <= m[2] < b[1]
    return keep


class CorruptSegment(RuntimeError):
    """A segment failed its checks; the message names the file, offset and reason."""


def read_segment_batches(task: SegmentTask, opts: ReadOptions, pa_schema) -> Iterator:
    report = P.ParseReport()
    yield from _batched(message_rows(task, opts, report), opts.batch_rows, pa_schema)
    if report.end_reason == P.END_CORRUPT and opts.on_corruption == "fail":
        raise CorruptSegment(f"{task.path}: corrupt record at offset {report.corrupt_offset}: "
                             f"{report.corrupt_reason} (option onCorruption=stop reads up to it)")


class StoreReader(DataSourceReader):
    def __init__(self, opts: ReadOptions, schema: StructType):
        self.opts = opts
        self.schema = schema
        self.kind = P.detect_store_kind(opts.path)
        self.committed_index = committed_bound(opts.path, self.kind, opts.committed_index)
        if self.kind == P.KIND_DLEDGER and self.committed_index is None and not opts.include_uncommitted:
            # Returning nothing would look like an empty store; say what is missing instead.
            raise OptionError(f"{opts.path}: cannot tell which DLedger entries are committed (no checkpoint); "
                              "set option committedIndex, or includeUncommitted=true to read them all")

    def partitions(self):
        return [SegmentPartition(SegmentTask(s.path, s.base_offset, s.kind, self.committed_index))
                for s in P.list_segments(self.opts.path)]

    def read(self, partition):
        yield from read_segment_batches(partition.task, self.opts, arrow_schema(self.schema))


# --- REST (endpoint) mode --------------------------------------------------------------------
def _base_url(endpoint: str) -> str:
    return endpoint if endpoint.startswith(("http://", "https://")) else f"http://{endpoint}"


def rest_get(endpoint: str, path: str, params: dict | None = None, redirects: int = 2) -> dict | list:
    """GET a node's JSON; a NOT_LEADER answer (a follower or slave that does not serve pulls,
    slaveReadEnable=false) is followed to the node it names, at most `redirects` times."""
    url = _base_url(endpoint).rstrip("/") + path
    if params:
        url += "?" + urllib.parse.urlencode(params)
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=_REST_TIMEOUT_S) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raw = e.read()[:2000]
        leader = not_leader_hint(raw)
        if leader and redirects > 0:
            scheme = _base_url(endpoint).split("://", 1)[0]
            return rest_get(f"{scheme}://{leader}", path, params, redirects - 1)
        raise RuntimeError(f"GET {url}: HTTP {e.code}: {raw[:500].decode('utf-8', 'replace')}") from None


def list_topics(endpoint: str) -> list[str]:
    """GET /topics, accepting a list of names, a list of objects, or {"topics": ...}."""
    obj = rest_get(endpoint, "/topics")
    items = obj.get("topics", obj) if isinstance(obj, dict) else obj
    if isinstance(items, dict):
        return sorted(items)
    return sorted(i if isinstance(i, str) else (i.get("topic") or i.get("name")) for i in items)


def queue_offsets(endpoint: str, topic: str) -> dict[int, tuple[int, int]]:
    """GET /topics/{topic} -> {queue_id: (min_offset, max_offset)}."""
    obj = rest_get(endpoint, f"/topics/{urllib.parse.quote(topic, safe='')}")
    queues = obj.get("queues", obj) if isinstance(obj, dict) else obj
    out: dict[int, tuple[int, int]] = {}
    if isinstance(queues, dict):
        for qid, q in queues.items():
            out[int(qid)] = (int(q["min_offset"]), int(q["max_offset"]))
    else:
        for q in queues:
            out[int(q["queue_id"])] = (int(q["min_offset"]), int(q["max_offset"]))
    return out


@dataclass(frozen=True)
class QueueTask:
    endpoint: str
    topic: str
    queue_id: int
    start: int          # first queue offset to read
    end: int            # exclusive


class QueuePartition(InputPartition):
    def __init__(self, task: QueueTask):
        super().__init__(task)
        self.task = task


def _rest_row(m: dict, topic: str, queue_id: int) -> tuple:
    if m.get("body_b64") is not None:
        body = base64.b64decode(m["body_b64"])
    elif m.get("body") is not None:
        body = m["body"].encode("utf-8") if isinstance(m["body"], str) else bytes(m["body"])
    else:
        body = None
    props = m.get("properties") or {}
    keys = m.get("keys")
    if isinstance(keys, list):
        keys = " ".join(keys)
    return (m.get("topic", topic), int(m.get("queue_id", queue_id)), int(m["queue_offset"]),
            int(m["commitlog_offset"]), m.get("size"), m.get("tags"), keys or None,
            {str(k): str(v) for k, v in props.items()}, m.get("born_timestamp"), m.get("store_timestamp"),
            m.get("born_host"), m.get("store_host"), m.get("reconsume_times"), m.get("sys_flag"),
            body, None, None, True)


def pull_rows(task: QueueTask, max_per_pull: int, include_body: bool = True) -> Iterator[tuple]:
    """Messages [start, end) of one queue, pulled in pages (committed data only, by contract)."""
    offset = task.start
    path = f"/topics/{urllib.parse.quote(task.topic, safe='')}/queues/{task.queue_id}/messages"
    for _ in range(_REST_MAX_PULLS):
        if offset >= task.end:
            return
        obj = rest_get(task.endpoint, path, {"offset": offset, "max": min(max_per_pull, task.end - offset)})
        msgs = obj.get("messages") or []
        status = obj.get("status")
        if status == "OFFSET_ILLEGAL" and offset < int(obj.get("min_offset", 0)):
            offset = int(obj["min_offset"])  # head expired since planning: skip to what is retained
            continue
        for m in msgs:
            row = _rest_row(m, task.topic, task.queue_id)
            if row[2] >= task.end:
                return
            yield row if include_body else row[:14] + (None,) + row[15:]
        nxt = int(obj.get("next_offset", offset + len(msgs)))
        if not msgs and nxt <= offset:
            return  # nothing more committed (NO_NEW_MSG / NO_MATCHED_MSG with no progress)
        offset = nxt
    raise RuntimeError(f"{task.topic}/{task.queue_id}: gave up after {_REST_MAX_PULLS} pulls")


def plan_queue_tasks(opts: ReadOptions) -> list[QueueTask]:
    topics = sorted(opts.topics) if opts.topics else list_topics(opts.endpoint)
    tasks = []
    for t in topics:
        for qid, (lo, hi) in sorted(queue_offsets(opts.endpoint, t).items()):
            a, b = opts.ranges.bounds(t, qid)
            start, end = max(lo, a), min(hi, b)
            if start < end:
                tasks.append(QueueTask(opts.endpoint, t, qid, start, end))
    return tasks


class RestReader(DataSourceReader):
    def __init__(self, opts: ReadOptions, schema: StructType):
        self.opts = opts
        self.schema = schema

    def partitions(self):
        return [QueuePartition(t) for t in plan_queue_tasks(self.opts)]

    def read(self, partition):
        rows = pull_rows(partition.task, self.opts.max_per_pull, self.opts.include_body)
        yield from _batched(rows, self.opts.batch_rows, arrow_schema(self.schema))


class RestStreamReader(DataSourceStreamReader):
    """Micro-batches over a node's queues; offsets are {"topic": {"qid": next_offset}}."""

    def __init__(self, opts: ReadOptions, schema: StructType):
        self.opts = opts
        self.schema = schema

    def _latest(self) -> dict:
        topics = sorted(self.opts.topics) if self.opts.topics else list_topics(self.opts.endpoint)
        return {t: {str(q): hi for q, (_lo, hi) in sorted(queue_offsets(self.opts.endpoint, t).items())}
                for t in topics}

    def initialOffset(self) -> dict:
        latest = self._latest()
        r = self.opts.ranges
        out: dict = {}
        for t, queues in latest.items():
            out[t] = {}
            for q, hi in queues.items():
                s = r.start.get((t, int(q)), r.start_default)
                out[t][q] = hi if s == LATEST else (0 if s == EARLIEST else s)
        return out

    def latestOffset(self, start: dict | None = None, limit=None) -> dict:
        return self._latest()

    def partitions(self, start: dict, end: dict):
        parts = []
        for t, queues in end.items():
            for q, hi in queues.items():
                lo = start.get(t, {}).get(q, 0)
                if lo < hi:
                    parts.append(QueuePartition(QueueTask(self.opts.endpoint, t, int(q), lo, hi)))
        return parts

    def read(self, partition):
        rows = pull_rows(partition.task, self.opts.max_per_pull, self.opts.include_body)
        yield from _batched(rows, self.opts.batch_rows, arrow_schema(self.schema))

    def commit(self, end: dict) -> None:
        """Nothing to release: consumer offsets of the pipeline live in Spark's checkpoint."""


# --- The data source -------------------------------------------------------------------------
class MqstoreDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "mqstore"

    def schema(self) -> StructType:
        return spark_schema()

    def reader(self, schema: StructType) -> DataSourceReader:
        opts = read_options(self.options)
        return StoreReader(opts, schema) if opts.path else RestReader(opts, schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        opts = read_options(self.options)
        if not opts.endpoint:
            raise OptionError("readStream needs option endpoint (a running node); path mode is batch only")
        return RestStreamReader(opts, schema)


def register(spark) -> None:
    """spark.dataSource.register(MqstoreDataSource), for callers that prefer a function."""
    spark.dataSource.register(MqstoreDataSource)
