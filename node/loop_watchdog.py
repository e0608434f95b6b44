"""Notices an event loop blocked by a call that does not yield, and says where.

Everything a node does runs on one asyncio loop; a call that blocks it (a write held by the
kernel's dirty-page throttling behind another writer, a read from a saturated disk) silences
Raft heartbeats and HA pushes for as long as it lasts. A leader silent for longer than the
election timeout is replaced, so such stalls must be visible, with their cause.

A callback on the loop stamps the time every `beat_s`. A daemon thread checks the stamp;
once it is older than `warn_s` the thread takes the loop thread's stack, which is where the
loop is stuck. When the loop runs again the stall is counted (count, total, longest and a
histogram, for /metrics) and logged with that stack, at most once per `warn_every_s` (the
others are counted in the next warning).

A paused process (SIGSTOP, a host that did not run the VM) looks the same to the loop, but
it is not a stall: nothing in the process ran. The thread tells them apart. When its own
wait overshot by more than `warn_s` too, and the process used under a quarter of the gap
in CPU, the whole process was paused. Such a gap is counted in `pauses` and logged at info,
not warned of as a stall. A call holding the GIL also keeps the thread from running, but it
uses the CPU, so it still counts as a stall.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import threading
import time
import traceback

from node.log_throttle import LogThrottle
from node.histogram import LatencyHistogram

log = logging.getLogger(__name__)

STALL_BUCKETS_S = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
PAUSE_MAX_CPU_SHARE = 0.25    # a gap with less process CPU than this share of it, the thread late too: a pause
MAX_STACK_FRAMES = 12
WARNING = "event loop blocked for %.0f ms (%d more stall(s) over %.0f ms since the last warning); it was in:\n%s"
_WARNING_RE = re.compile(r"event loop blocked for (\d+) ms \((\d+) more stall")
_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


class LoopWatchdog:
    def __init__(self, warn_s: float = 0.2, beat_s: float = 0.02, warn_every_s: float = 10.0):
        assert 0 < beat_s < warn_s
        self.warn_s, self.beat_s = warn_s, beat_s
        self.histogram = LatencyHistogram(STALL_BUCKETS_S)      # count and total of the stalls
        self._warnings = LogThrottle(warn_every_s)
        self._beat = time.monotonic()
        self._stack: list[str] | None = None     # taken by the thread during the current stall
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._loop_thread_id = 0
        self._beat_cpu = time.process_time()
        self._watch_woke = time.monotonic()   # when the thread last woke
        self._watch_gap_end = 0.0    # when the thread last woke after overshooting its wait by > warn_s
        self.pauses = 0              # gaps in which the whole process was paused (not counted as stalls)
        self.paused_s_total = 0.0

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._loop_thread_id = threading.get_ident()
        self._beat = time.monotonic()
        self._handle = self._loop.call_soon(self._tick)
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()
        if self._thread is not None:
            self._thread.join(1.0)

    @property
    def stalls(self) -> int:
        return self.histogram.count

    @property
    def stalled_s_max(self) -> float:
        return self.histogram.max_s

    def status(self) -> dict:
        return {"stalls": self.stalls, "stalled_s_total": round(self.histogram.sum_s, 3),
                "stalled_s_max": round(self.stalled_s_max, 3), "warn_s": self.warn_s,
                "pauses": self.pauses, "paused_s_total": round(self.paused_s_total, 3)}

    # --- on the loop --------------------------------------------------------------------------
    def _tick(self) -> None:
        now, cpu = time.monotonic(), time.process_time()
        late = now - self._beat - self.beat_s      # how long the loop could not run this tick
        if late >= self.warn_s:
            thread_late = self._watch_gap_end > self._beat or now - self._watch_woke > self.warn_s
            if thread_late and cpu - self._beat_cpu < PAUSE_MAX_CPU_SHARE * late:
                self.pauses += 1
                self.paused_s_total += late
                log.info("process paused for %.0f ms (nothing ran: SIGSTOP or the host); not an event loop "
                         "stall", late * 1000)
            else:
                self._record(late, self._stack)
        self._beat, self._beat_cpu = now, cpu   # first: the thread must not take the stack of a loop that runs
        self._stack = None
        if not self._stop.is_set():
            self._handle = self._loop.call_later(self.beat_s, self._tick)

    def _record(self, stalled_s: float, stack: list[str] | None) -> None:
        self.histogram.observe(stalled_s)
        held = self._warnings.due(time.monotonic())
        if held is not None:
            where = "".join(stack) if stack else "  (the stack was not taken in time)\n"
            log.warning(WARNING, stalled_s * 1000, held, self.warn_s * 1000, where.rstrip())

    # --- on the watchdog thread ---------------------------------------------------------------
    def _watch(self) -> None:
        period = min(self.beat_s, self.warn_s / 4)
        self._watch_woke = time.monotonic()
        while not self._stop.wait(period):
            now = time.monotonic()
            if now - self._watch_woke - period > self.warn_s:
                self._watch_gap_end = now          # this thread did not run either
            self._watch_woke = now
            if self._stack is None and now - self._beat > self.warn_s:
                frame = sys._current_frames().get(self._loop_thread_id)
                if frame is not None:
                    self._stack = traceback.format_stack(frame, limit=MAX_STACK_FRAMES)


def stalls_in_logs(paths: list[str], max_bytes: int = 64 << 20) -> dict:
    """What this watchdog's warnings in nodes' JSON logs add up to (a soak's verdict): stalls,
    the held-back ones included; the longest warned of; and where the loop was then (the
    innermost frames outside the standard library). Reads at most `max_bytes` per file."""
    stalls, longest_ms, where = 0, 0, None
    for path in paths:
        try:
            with open(path, "rb") as f:
                lines = f.read(max_bytes).decode("utf-8", "replace").splitlines()
        except OSError:
            continue
        for line in lines:
            if "event loop blocked" not in line:
                continue
            try:
                msg = json.loads(line).get("msg", "")
            except ValueError:
                continue
            m = _WARNING_RE.search(msg)
            if m is None:
                continue
            ms, held = int(m.group(1)), int(m.group(2))
            stalls += 1 + held
            if ms > longest_ms:
                frames = [f for f in _FRAME_RE.findall(msg) if "/lib/python" not in f[0] and "<frozen" not in f[0]]
                longest_ms = ms
                where = " > ".join(f"{os.path.basename(p)}:{n} {fn}" for p, n, fn in frames[-3:]) or None
    return {"stalls": stalls, "longest_ms": longest_ms, "where": where}
