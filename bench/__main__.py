"""`python -m bench [--quick] [--only NAME,...] [--out FILE] [--dir DIR]`

Runs the anchors (bench/anchors.py), then every `bench/bench_*.py`, and prints ONE JSON object
on stdout:

    {"machine": {...}, "anchors": {name: {...}}, "results": {name: {...}},
     "timings_s": {name: seconds}, "elapsed_s": seconds}

The same JSON goes to `--out` (default `reports/bench-<timestamp>.json`, gitignored).

A benchmark module `bench/bench_<name>.py` is run in-process as `run(quick, anchors) -> dict`;
one without `run` is run as `python -m bench.bench_<name> [--quick]` and its stdout JSON is
parsed (the anchors are passed in the environment as MQSTORE_BENCH_ANCHORS). A benchmark that
fails is reported as `{"error": "..."}` and the run goes on. Progress goes to stderr only, so
stdout stays one JSON object even when a benchmark prints.

`--only` takes result names (`store` or `bench_store`), `anchors` (all anchors) or anchor names
(`disk`, `nats` = all four NATS runs, `nats_r3_async`, `pysyncobj`, ...). Benchmarks run without
their anchors get `{}` and should report ratios as null.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

from bench import anchors as anchors_mod

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
SUBPROCESS_TIMEOUT_S = {True: 600, False: 1800}  # quick / full, per benchmark module
ERROR_TAIL_CHARS = 2000


def machine_info() -> dict:
    """What the figures depend on; anchors cover the rest."""
    info: dict[str, Any] = {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "kernel": platform.release(),
        "platform": platform.platform(),
        "cpu_model": _proc_field("/proc/cpuinfo", "model name"),
        "mem_total": _proc_field("/proc/meminfo", "MemTotal"),
        # Other work on the machine moves every figure; the load says how busy it was.
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    return info


def _proc_field(path: str, key: str) -> str | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def discover() -> dict[str, str]:
    """result name -> module name, for every bench/bench_*.py present now."""
    return {p.stem.removeprefix("bench_"): p.stem for p in sorted(BENCH_DIR.glob("bench_*.py"))}


def _wanted(name: str, module: str, only: set[str] | None) -> bool:
    return only is None or name in only or module in only


def _error(exc: BaseException) -> dict:
    tb = traceback.format_exception(exc)
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": "".join(tb)[-ERROR_TAIL_CHARS:]}


def run_module(module: str, quick: bool, anchors: dict) -> dict:
    """Run one benchmark module; never raises (a failure becomes {"error": ...})."""
    try:
        mod = importlib.import_module(f"bench.{module}")
    except Exception as exc:  # a broken module must not stop the others
        return _error(exc)
    if not callable(getattr(mod, "run", None)):
        return run_module_subprocess(module, quick, anchors)
    try:
        # Their prints would corrupt our one-object stdout: send them to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            result = mod.run(quick, anchors)
    except (Exception, SystemExit) as exc:  # SystemExit: an argparse or sys.exit inside run
        return _error(exc)
    if not isinstance(result, dict):
        return {"error": f"run() returned {type(result).__name__}, expected dict"}
    return result


def run_module_subprocess(module: str, quick: bool, anchors: dict) -> dict:
    argv = [sys.executable, "-m", f"bench.{module}"] + (["--quick"] if quick else [])
    env = dict(os.environ, MQSTORE_BENCH_ANCHORS=json.dumps(anchors, default=str))
    try:
        proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=SUBPROCESS_TIMEOUT_S[quick])
    except subprocess.TimeoutExpired:
        # subprocess.run kills the child it started before raising.
        return {"error": f"timed out after {SUBPROCESS_TIMEOUT_S[quick]} s: {' '.join(argv)}"}
    sys.stderr.write(proc.stderr[-ERROR_TAIL_CHARS:])
    if proc.returncode != 0:
        return {"error": f"exit status {proc.returncode}: {proc.stderr[-ERROR_TAIL_CHARS:]}"}
    parsed = parse_json_output(proc.stdout)
    if parsed is None:
        return {"error": f"no JSON object on stdout: {proc.stdout[-ERROR_TAIL_CHARS:]}"}
    return parsed


def parse_json_output(text: str) -> dict | None:
    """The whole stdout as one JSON object, else the last line that is one."""
    for candidate in [text, *reversed(text.splitlines())]:
        candidate = candidate.strip()
        if not candidate.startswith("{"):
            continue
        try:
            obj = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    return None


def default_out() -> Path:
    return REPO_ROOT / "reports" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, shorter runs")
    parser.add_argument("--only", default=None,
                        help="comma-separated: anchors, disk, nats, pysyncobj, store, ...")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON report path (default reports/bench-<timestamp>.json)")
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="directory for the disk anchor (default: the temp dir)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    only = {s.strip() for s in args.only.split(",") if s.strip()} if args.only else None
    start = time.monotonic()
    timings: dict[str, float] = {}
    modules = discover()
    known = {"anchors", "nats", *anchors_mod.ANCHOR_NAMES, *modules, *modules.values()}
    for unknown in sorted((only or set()) - known):
        print(f"bench: --only {unknown!r} matches nothing (known: {sorted(known)})",
              file=sys.stderr)

    anchor_names = anchors_mod.select_anchors(only)
    with contextlib.redirect_stdout(sys.stderr):
        anchors = (anchors_mod.run_anchors(args.quick, anchor_names, args.dir)
                   if anchor_names else {})

    results: dict[str, dict] = {}
    for name, module in modules.items():
        if not _wanted(name, module, only):
            continue
        t0 = time.monotonic()
        print(f"bench: running {module}", file=sys.stderr)
        results[name] = run_module(module, args.quick, anchors)
        timings[name] = round(time.monotonic() - t0, 2)

    report = {
        "machine": machine_info(),
        "quick": args.quick,
        "anchors": anchors,
        "results": results,
        "timings_s": timings,
        "elapsed_s": round(time.monotonic() - start, 2),
    }
    text = json.dumps(report, indent=2, default=str)
    out = args.out or default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(f"bench: report written to {out}", file=sys.stderr)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
