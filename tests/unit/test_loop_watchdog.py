"""The event-loop watchdog (node/loop_watchdog.py) and the stall it found.

Goal: a call that blocks a node's event loop past loopStallWarnMs is counted and logged with
the loop's stack; an idle loop counts nothing. Regression: under a background writer
(`dd` of 3 GB) the dispatcher's periodic flush fsynced the consume queues on the loop for up
to 270 ms, a DLedger leader's heartbeats stopped, and its followers elected again (the
clock-step test's leader changes in CI). The flush now fsyncs on a worker thread.
Method: a real loop with the watchdog running; a slow fsync made by wrapping the file
system's handles.
"""

from __future__ import annotations

import asyncio
import logging
import time

from node.loop_watchdog import LoopWatchdog
from node.store.fileio import FileSystem
from tests.unit.test_dispatcher import FakeLog, Store, fill


def _blocking_call_for_the_test(seconds: float) -> None:
    time.sleep(seconds)


def _watched(caplog, warn_s: float, blocking_call) -> LoopWatchdog:
    """A watchdog over a loop that runs `blocking_call()` between two short sleeps."""
    async def scenario() -> LoopWatchdog:
        wd = LoopWatchdog(warn_s=warn_s, beat_s=0.01)
        wd.start()
        try:
            await asyncio.sleep(0.05)
            blocking_call()
            await asyncio.sleep(0.05)
        finally:
            wd.stop()
        return wd

    with caplog.at_level(logging.WARNING, logger="node.loop_watchdog"):
        return asyncio.run(scenario())


def test_a_blocked_loop_is_counted_and_logged_with_where_it_was(caplog):
    wd = _watched(caplog, 0.25, lambda: _blocking_call_for_the_test(0.6))
    assert wd.stalls >= 1 and wd.stalled_s_max >= 0.55       # (a busy machine may add a stall of its own)
    assert wd.histogram.count == wd.stalls
    assert "event loop blocked for" in caplog.text and "_blocking_call_for_the_test" in caplog.text


def test_an_idle_or_busy_but_yielding_loop_counts_nothing():
    async def scenario() -> LoopWatchdog:
        wd = LoopWatchdog(warn_s=0.3, beat_s=0.01)
        wd.start()
        try:
            end = time.monotonic() + 0.5
            while time.monotonic() < end:
                _blocking_call_for_the_test(0.02)      # short steps that yield in between
                await asyncio.sleep(0)
        finally:
            wd.stop()
        return wd

    wd = asyncio.run(scenario())
    assert wd.stalls == 0 and wd.status()["stalls"] == 0


class _SlowSyncFile:
    def __init__(self, inner, seconds: float, syncing):
        self._inner, self._seconds, self._syncing = inner, seconds, syncing

    def fsync(self):
        self._syncing.set()
        time.sleep(self._seconds)
        self._inner.fsync()
        self._syncing.clear()

    def __getattr__(self, name):
        return getattr(self._inner, name)


class SlowConsumeQueueSync(FileSystem):
    """fsync of consume-queue files takes `seconds`: a disk behind another writer.
    `syncing` is set while one is under way."""

    def __init__(self, seconds: float):
        import threading
        self.seconds = seconds
        self.syncing = threading.Event()

    def open(self, path):
        handle = super().open(path)
        return _SlowSyncFile(handle, self.seconds, self.syncing) if "/consumequeue/" in path else handle


def test_regression_the_dispatchers_periodic_flush_does_not_block_the_loop(tmp_path):
    async def scenario() -> tuple[LoopWatchdog, int, int]:
        log = FakeLog()
        fill(log, 5)
        s = Store(log, tmp_path, fs=SlowConsumeQueueSync(0.8), flush_interval_ms=50)
        s.recover(log)
        wd = LoopWatchdog(warn_s=0.4, beat_s=0.01)
        wd.start()
        s.d.start()
        try:
            for i in range(20):                  # commits keep coming while flushes fsync
                fill(log, 1, start=5 + i)
                await asyncio.sleep(0.05)
            for _ in range(300):
                if s.cp.committed_offset == log.end:
                    break
                await asyncio.sleep(0.01)
        finally:
            wd.stop()
            await s.d.stop()
            s.close()
        return wd, s.cp.committed_offset, log.end

    wd, committed, end = asyncio.run(scenario())
    assert committed == end, "the flushes went on: the checkpoint reached the log's end"
    assert wd.stalls == 0, f"the loop was blocked {wd.stalls} time(s), longest {wd.stalled_s_max:.3f} s"


def test_a_soak_sums_the_warnings_of_its_nodes_logs(tmp_path):
    """stalls_in_logs reads back what the watchdog wrote: held-back stalls count, and the
    longest one names where the loop was."""
    import json as _json
    from node.loop_watchdog import stalls_in_logs
    stack = ('  File "/usr/lib/python3.11/asyncio/events.py", line 80, in _run\n'
             '  File "/srv/node/store/dispatcher.py", line 278, in flush\n'
             '  File "/srv/node/store/segment.py", line 196, in flush\n')
    lines = [_json.dumps({"msg": "event loop blocked for 250 ms (0 more stall(s) over 200 ms since the last "
                                 "warning); it was in:\n" + stack}),
             "not json at all",
             _json.dumps({"msg": "event loop blocked for 680 ms (3 more stall(s) over 200 ms since the last "
                                 "warning); it was in:\n" + stack}),
             _json.dumps({"msg": "broker ready"})]
    (tmp_path / "n0.log").write_text("\n".join(lines) + "\n")
    got = stalls_in_logs([str(tmp_path / "n0.log"), str(tmp_path / "missing.log")])
    assert got == {"stalls": 5, "longest_ms": 680, "where": "dispatcher.py:278 flush > segment.py:196 flush"}
    assert stalls_in_logs([]) == {"stalls": 0, "longest_ms": 0, "where": None}


def test_records_committed_during_a_slow_flush_are_dispatched_at_once(tmp_path):
    """The flush's fsyncs run beside dispatch, not before it: a record committed while a
    consume queue's fsync takes a second is pullable at once."""
    async def scenario() -> tuple[float, bool]:
        log = FakeLog()
        fill(log, 5)
        s = Store(log, tmp_path, fs=SlowConsumeQueueSync(1.0), flush_interval_ms=50)
        s.recover(log)
        fs = s.fs
        s.d.start()
        try:
            fill(log, 1, start=5)
            for _ in range(200):
                if fs.syncing.is_set():
                    break
                await asyncio.sleep(0.005)
            assert fs.syncing.is_set(), "no flush started"
            t0 = time.monotonic()
            fill(log, 1, start=6)
            while s.d.position < log.end and time.monotonic() - t0 < 2.0:
                await asyncio.sleep(0.002)
            return time.monotonic() - t0, fs.syncing.is_set()
        finally:
            await s.d.stop()
            s.close()

    took_s, still_syncing = asyncio.run(scenario())
    assert took_s < 0.5 and still_syncing, f"dispatched {took_s:.3f} s after its commit, behind the flush"


_PAUSED_CHILD = r"""
import asyncio, json, sys
from node.loop_watchdog import LoopWatchdog

async def main():
    wd = LoopWatchdog(warn_s=0.2, beat_s=0.01)
    wd.start()
    print("ready", flush=True)
    await asyncio.sleep(2.0)           # the parent stops and continues this process meanwhile
    wd.stop()
    print(json.dumps(wd.status()), flush=True)

asyncio.run(main())
"""


def test_a_paused_process_is_counted_as_a_pause_not_as_a_stall():
    """SIGSTOP stops the loop and the watchdog's thread alike: when the process runs again the
    loop sees a gap with nothing to blame. It was counted and warned of as a stall ("the
    stack was not taken in time"), so the random-fault runs' SIGSTOPs filled the soak's
    stall verdict. The thread, late too, and a gap without CPU now make it a pause."""
    import json
    import os
    import signal
    import subprocess
    import sys
    child = subprocess.Popen([sys.executable, "-c", _PAUSED_CHILD], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        child.send_signal(signal.SIGSTOP)
        time.sleep(0.6)
        child.send_signal(signal.SIGCONT)
        out, _ = child.communicate(timeout=20)
    finally:
        if child.poll() is None:
            child.kill()
    status = json.loads(out.strip().splitlines()[-1])
    assert status["pauses"] == 1 and status["paused_s_total"] >= 0.5, status
    assert status["stalls"] == 0, status


def test_a_call_holding_the_gil_is_a_stall_though_the_thread_could_not_run(caplog):
    """A call that keeps the GIL (a regular expression backtracking here) stops the watchdog's
    thread too, as a pause does; but the process spends the gap on the CPU: a stall."""
    import re
    wd = _watched(caplog, 0.2, lambda: re.match(r"(a|aa)+c", "a" * 33))   # ~0.5 s of backtracking, the GIL held
    assert wd.stalls == 1 and wd.pauses == 0, wd.status()
    assert "event loop blocked" in caplog.text
