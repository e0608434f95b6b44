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
stdout stays one JSON object even when a benchmark prints: a line naming each benchmark as it
starts, and an overall bar with an ETA (node/progress.py: redrawn on a terminal, a log line every
few seconds otherwise). The ETA weighs each step by how long it took in the newest earlier report
in reports/ of the same mode (quick or full), or by a default when no report has it.

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
import logging
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

from bench import anchors as anchors_mod
from node.progress import Progress, fmt_eta

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
REPORTS_DIR = REPO_ROOT / "reports"
SUBPROCESS_TIMEOUT_S = {True: 600, False: 1800}  # quick / full, per benchmark module
ERROR_TAIL_CHARS = 2000
DEFAULT_STEP_S = {True: 30.0, False: 120.0}   # ETA weight of a step no earlier report timed
HISTORY_REPORTS = 20                          # newest reports read for step timings
TICK_S = 0.5                                  # how often the bar advances within a step
STEP_CAP = 0.95                               # a step overrunning its estimate holds the bar here


# --- progress ------------------------------------------------------------------------------------
def estimate_steps(steps: Sequence[str], quick: bool, reports_dir: Path) -> dict[str, float]:
    """Seconds each step is expected to take: its time in the newest of the last HISTORY_REPORTS
    reports of the same mode that ran it, else DEFAULT_STEP_S. Unreadable reports are skipped."""
    known: dict[str, float] = {}
    for path in sorted(reports_dir.glob("bench-*.json"), reverse=True)[:HISTORY_REPORTS]:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or doc.get("quick") != quick:
            continue
        seen = {f"anchor:{n}": r.get("elapsed_s") for n, r in (doc.get("anchors") or {}).items()
                if isinstance(r, dict)}
        seen.update((n, t) for n, t in (doc.get("timings_s") or {}).items())
        for step, secs in seen.items():
            if step not in known and isinstance(secs, (int, float)) and secs > 0:
                known[step] = float(secs)
    return {step: known.get(step, DEFAULT_STEP_S[quick]) for step in steps}


class BenchProgress(Progress):
    """An overall bar over the run's steps; `done` and `total` are estimated seconds.

    A background ticker advances the bar within a step by the time spent in it (capped at
    STEP_CAP of the step's estimate), so a long benchmark still moves the bar and the ETA.
    """

    def __init__(self, estimates: dict[str, float], *, stream: TextIO | None = None,
                 logger: logging.Logger | None = None, clock: Callable[[], float] | None = None,
                 quiet_s: float = 1.0, log_every_s: float = 10.0):
        self.estimates = dict(estimates)
        self.steps = list(estimates)
        self._weights = {s: max(1, round(w * 1000)) for s, w in self.estimates.items()}  # ms
        super().__init__("bench", sum(self._weights.values()), unit="s", scale=1000.0, stream=stream,
                         logger=logger or _progress_logger(), quiet_s=quiet_s, log_every_s=log_every_s,
                         clock=clock)
        self.index = 0                 # 1-based index of the running step, 0 before the first
        self.step = ""
        self._base = 0                 # estimated ms of the finished steps
        self._step_t0 = self.t0
        self._lock = threading.Lock()

    def text(self) -> str:
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        eta = self.eta_s()
        text = (f"bench [{self.index}/{len(self.steps)}] {self.step}: {frac * 100:5.1f}% "
                f"elapsed {fmt_eta(self.clock() - self.t0)} ETA {fmt_eta(eta) if eta is not None else '?'}")
        over = self.clock() - self._step_t0 - self.estimates.get(self.step, 0.0)
        return text + (f" (step {over:.0f} s over its estimate)" if self.step and over >= 1.0 else "")

    def say(self, line: str) -> None:
        """A line on the stream without tearing the bar: clear it, write, redraw."""
        with self._lock:
            drawn = self.tty and self.emitted
            if drawn:
                self.stream.write("\r\x1b[K")
            self.stream.write(line + "\n")
            if drawn:
                self._emit()
            self.stream.flush()

    def start_step(self, step: str) -> None:
        with self._lock:
            if self.step:
                self._base += self._weights[self.step]
            self.index = self.steps.index(step) + 1
            self.step = step
            self._step_t0 = self.clock()
            self._update(self._base)
        self.say(f"bench: [{self.index}/{len(self.steps)}] running {step} "
                 f"(about {self.estimates[step]:.0f} s)")

    def tick(self) -> None:
        with self._lock:
            if not self.step:
                return
            in_step = (self.clock() - self._step_t0) * 1000
            self._update(self._base + int(min(in_step, STEP_CAP * self._weights[self.step])))

    def _update(self, done: int) -> None:
        Progress.update(self, done)

    def update(self, done: int) -> None:
        with self._lock:
            self._update(done)

    def finish(self) -> None:
        with self._lock:
            super().finish()


def _progress_logger() -> logging.Logger:
    """Log lines for a stderr that is not a terminal (CI, `make bench > out.json 2> log`)."""
    logger = logging.getLogger("bench.progress")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


@contextlib.contextmanager
def ticking(progress: BenchProgress, every_s: float = TICK_S):
    """Advance the bar every `every_s` from a daemon thread until the block ends."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            progress.tick()

    thread = threading.Thread(target=loop, name="bench-progress", daemon=True)
    thread.start()
    try:
        yield progress
    finally:
        stop.set()
        thread.join(timeout=5.0)


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
    return REPORTS_DIR / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"


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
    wanted = {name: module for name, module in modules.items() if _wanted(name, module, only)}
    steps = [f"anchor:{n}" for n in anchor_names] + list(wanted)
    progress = BenchProgress(estimate_steps(steps, args.quick, REPORTS_DIR))
    anchors: dict[str, dict] = {}
    results: dict[str, dict] = {}
    with ticking(progress):
        for name in anchor_names:
            progress.start_step(f"anchor:{name}")
            with contextlib.redirect_stdout(sys.stderr):
                anchors.update(anchors_mod.run_anchors(args.quick, [name], args.dir))
        for name, module in wanted.items():
            progress.start_step(name)
            t0 = time.monotonic()
            results[name] = run_module(module, args.quick, anchors)
            timings[name] = round(time.monotonic() - t0, 2)
        progress.finish()

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
