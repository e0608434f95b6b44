"""`mqstore pipeline <job> ...` (also `python -m pipeline <job> ...`).

Jobs: rebuild, audit, export, stats. Results go to stdout as JSON; progress (Spark
stages, tasks done / total) to stderr. Exit codes: 0 ok, 1 bad input or job error,
2 audit: replicas diverge in the committed prefix, 3 audit: CRC failure or corrupt
record in the committed prefix, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import threading
import time

from node.store import layout as L

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_DIVERGED = 2
EXIT_CORRUPT = 3
EXIT_INTERRUPTED = 130
_PROGRESS_PERIOD_S = 0.5


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mqstore pipeline", description="mqstore Spark jobs")
    p.add_argument("--master", default="local[*]", help="Spark master (default local[*])")
    p.add_argument("--driver-memory", default=None, help="spark.driver.memory, e.g. 2g")
    p.add_argument("--no-progress", action="store_true", help="do not print stage progress to stderr")
    p.add_argument("--no-spark", action="store_true", help="rebuild/audit only: run the tasks in this process")
    sub = p.add_subparsers(dest="job", required=True)

    r = sub.add_parser("rebuild", help="consume queues + index files from the committed log")
    r.add_argument("store_dir")
    r.add_argument("target_dir")
    r.add_argument("--committed-index", type=int, help="DLedger committed index (else from the entry store meta / checkpoint)")
    r.add_argument("--config", help="the node's broker.conf: CQ and index geometry and messageDelayLevel are taken from it")
    r.add_argument("--cq-units-per-file", type=int, default=None,
                   help=f"mapedFileSizeConsumeQueue / 20 of the node (default {L.CQ_UNITS_PER_FILE})")
    r.add_argument("--index-hash-slots", type=int, default=None,
                   help=f"maxHashSlotNum (default {L.INDEX_SLOTS_DEFAULT})")
    r.add_argument("--index-max-entries", type=int, default=None,
                   help=f"maxIndexNum (default {L.INDEX_ENTRIES_DEFAULT})")
    r.add_argument("--no-crc", action="store_true", help="skip body CRC checks")
    r.add_argument("--stop-at-corruption", action="store_true",
                   help="rebuild up to the first bad record instead of failing")
    r.add_argument("--cq-writer", choices=("driver", "tasks"), default="driver")
    r.add_argument("--index-writer", choices=("bulk", "node"), default="bulk")

    a = sub.add_parser("audit", help="compare DLedger replicas entry by entry")
    a.add_argument("replica_dirs", nargs="+")
    a.add_argument("--committed-index", type=int, help="committed index of the group (else the highest any replica proves)")

    e = sub.add_parser("export", help="Parquet partitioned by topic and store date")
    e.add_argument("store_dir")
    e.add_argument("out_dir")
    e.add_argument("--topics", help="comma list (default all)")
    e.add_argument("--mode", default="errorifexists", choices=("errorifexists", "overwrite", "append", "ignore"))
    e.add_argument("--committed-index", type=int)

    s = sub.add_parser("stats", help="per topic/queue counts, bytes, time range, key cardinality")
    s.add_argument("store_dir")
    s.add_argument("--committed-index", type=int)
    s.add_argument("--table", action="store_true", help="print a table instead of JSON")
    return p


class Progress:
    """Polls Spark's status tracker and prints one line per change: stage, tasks done/total."""

    def __init__(self, spark, stream=sys.stderr):
        self.sc = spark.sparkContext
        self.stream = stream
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._last = ""
        self._tty = stream.isatty()

    def __enter__(self) -> "Progress":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        if self._tty and self._last:
            self.stream.write("\n")
            self.stream.flush()

    def line(self) -> str:
        tracker = self.sc.statusTracker()
        parts = []
        for sid in sorted(tracker.getActiveStageIds()):
            info = tracker.getStageInfo(sid)
            if info is not None:
                parts.append(f"stage {sid} ({info.name[:40]}): {info.numCompletedTasks}/{info.numTasks} tasks"
                             + (f", {info.numFailedTasks} failed" if info.numFailedTasks else ""))
        return "; ".join(parts)

    def _run(self) -> None:
        while not self._stop.wait(_PROGRESS_PERIOD_S):
            try:
                text = self.line()
            except Exception:  # noqa: BLE001 - progress is cosmetic; never fail the job for it
                return
            if text and text != self._last:
                self._last = text
                self.stream.write(("\r\x1b[K" if self._tty else "") + text + ("" if self._tty else "\n"))
                self.stream.flush()


def _spark(args):
    from pipeline.jobs import get_spark
    conf = {"spark.driver.memory": args.driver_memory} if args.driver_memory else {}
    spark = get_spark(args.master, f"mqstore-pipeline-{args.job}", conf)
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _print_table(rows: list[dict]) -> None:
    if not rows:
        print("(no messages)")
        return
    cols = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths)))


def run(args) -> int:
    from pipeline import jobs
    spark = None if (args.no_spark and args.job in ("rebuild", "audit")) else _spark(args)
    progress = Progress(spark) if spark is not None and not args.no_progress else None
    t0 = time.perf_counter()
    try:
        if progress:
            progress.__enter__()
        code, result = _dispatch(jobs, spark, args)
    finally:
        if progress:
            progress.__exit__(None, None, None)
    if isinstance(result, list) and getattr(args, "table", False):
        _print_table(result)
    else:
        out = result if isinstance(result, dict) else {"rows": result}
        out = dict(out, elapsed_s=round(time.perf_counter() - t0, 3))
        print(json.dumps(out, indent=2, default=str))
    return code


def _dispatch(jobs, spark, args) -> tuple[int, object]:
    if args.job == "rebuild":
        units, slots, entries, delays = _geometry(args)
        r = jobs.rebuild(args.store_dir, args.target_dir, spark=spark, committed_index=args.committed_index,
                         units_per_file=units, index_hash_slots=slots,
                         index_max_entries=entries, delay_levels_ms=delays, check_crc=not args.no_crc,
                         stop_at_corruption=args.stop_at_corruption, cq_writer=args.cq_writer,
                         index_writer=args.index_writer)
        return EXIT_OK, r.as_dict()
    if args.job == "audit":
        a = jobs.audit(args.replica_dirs, spark=spark, committed_index=args.committed_index)
        return a.exit_code, a.as_dict()
    if args.job == "export":
        return EXIT_OK, jobs.export(spark, args.store_dir, args.out_dir, mode=args.mode, topics=args.topics,
                                    committed_index=args.committed_index)
    if args.job == "stats":
        return EXIT_OK, jobs.stats(spark, args.store_dir, committed_index=args.committed_index)
    raise AssertionError(f"unknown job {args.job}")


def _geometry(args) -> tuple[int, int, int, tuple]:
    """CQ units per file, index hash slots, index entries, delay levels (ms): flags, else
    broker.conf, else defaults.

    They must match the node's for the rebuilt files to be byte-identical (the delay levels
    give the tag code of SCHEDULE_TOPIC_XXXX units: the delivery time)."""
    from node.store.dispatcher import DEFAULT_DELAY_LEVELS_MS
    units, slots, entries = L.CQ_UNITS_PER_FILE, L.INDEX_SLOTS_DEFAULT, L.INDEX_ENTRIES_DEFAULT
    delays = tuple(DEFAULT_DELAY_LEVELS_MS)
    if args.config:
        from node.config import ConfigError, load_config, parse_delay_levels
        try:
            cfg = load_config(args.config)
            delays = tuple(parse_delay_levels(cfg.message_delay_level))
        except ConfigError as e:
            raise ValueError(f"--config {args.config}: {e}") from None
        units = cfg.maped_file_size_consume_queue // L.CQ_UNIT.size
        slots, entries = cfg.max_hash_slot_num, cfg.max_index_num
    return (args.cq_units_per_file or units, args.index_hash_slots or slots, args.index_max_entries or entries,
            delays)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from pipeline.jobs import JobError
    from pipeline.source import OptionError
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (JobError, OptionError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as e:  # noqa: BLE001 - Spark's own errors; anything else is re-raised
        if not _is_spark_error(e):
            raise
        print(f"error: {spark_error_text(e)}", file=sys.stderr)
        return EXIT_ERROR


def _is_spark_error(e: BaseException) -> bool:
    try:
        from pyspark.errors import PySparkException
    except ImportError:
        return False
    return isinstance(e, PySparkException)


_PY_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Segment|Record)\b.*: ")


def spark_error_text(e: BaseException) -> str:
    """One readable line from a Spark error: for a failed Python task, the error the task
    raised (the last `Name: message` line of the worker traceback), else Spark's message."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if any(ln.startswith("Traceback") for ln in lines):
        found = [ln for ln in lines if _PY_ERROR_LINE.match(ln)]
        if found:
            return found[-1]
    return lines[0] if lines else type(e).__name__
