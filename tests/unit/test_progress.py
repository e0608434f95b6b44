"""Progress bars and progress log lines: what is shown, when, and the ETA arithmetic.

Method: a fake clock and fake streams (one claiming to be a TTY); a real recovery scan
of a small commitlog with the clock forced past the quiet period must log progress.
"""

from __future__ import annotations

import io
import logging

from node.progress import Progress, fmt_eta


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_tty_bar_shows_percent_rate_and_eta_then_ends_the_line():
    clock, out = Clock(), Tty()
    p = Progress("scan", 100 * 1024 * 1024, stream=out, clock=clock)
    clock.t += 2.0
    p.update(25 * 1024 * 1024)          # 25 MB in 2 s: 12.5 MB/s, 75 MB left: 6 s
    text = out.getvalue()
    assert text.startswith("\r[#######-----------------------] scan  25.0% 25.0/100.0 MB 12.5 MB/s ETA 0:00:06")
    p.finish()
    assert out.getvalue().endswith("\n") and "100.0%" in out.getvalue()


def test_nothing_is_shown_for_quick_work():
    clock, out = Clock(), Tty()
    p = Progress("scan", 1000, stream=out, clock=clock)
    clock.t += 0.5
    p.update(1000)
    p.finish()
    assert out.getvalue() == "" and p.emitted == 0


def test_without_a_tty_it_logs_at_most_every_interval(caplog):
    clock = Clock()
    p = Progress("scan", 1000, stream=io.StringIO(), clock=clock, log_every_s=5.0)
    with caplog.at_level(logging.INFO, logger="node.progress"):
        for step in range(1, 11):        # 10 updates over 10 s
            clock.t += 1.0
            p.update(step * 100)
    assert p.emitted == 2                # at 5 s and 10 s
    rec = caplog.records[0]
    assert rec.progress == "scan" and rec.done_bytes == 500 and rec.total_bytes == 1000 and rec.eta_s == 5.0


def test_eta_format():
    assert fmt_eta(0) == "0:00:00" and fmt_eta(3725.4) == "1:02:05"


def test_recovery_scan_reports_progress(tmp_path, caplog, monkeypatch):
    from node.store import recovery
    from node.store.commitlog import CommitLog
    from node.store.fileio import FileSystem
    from node.store.message import MessageDraft

    from node.store.queue_offsets import QueueOffsetTable

    fs = FileSystem()
    cl = CommitLog(fs, str(tmp_path / "commitlog"), 1 << 20, b"\x7f\x00\x00\x01", 10911)
    cl.load()
    recovery.recover(cl, None, abnormal=True)
    qt = QueueOffsetTable()
    for _ in range(20):                     # ~2 MB: more than one segment and many chunks
        cl.append_batch([MessageDraft("T", 0, b"x" * 1000, {}).seal() for _ in range(100)], qt, 1)
    cl.flush()
    cl = CommitLog(fs, str(tmp_path / "commitlog"), 1 << 20, b"\x7f\x00\x00\x01", 10911)
    cl.load()
    ticks = iter(range(0, 10_000, 10))      # each clock read is 10 s later: every update is shown
    monkeypatch.setattr("node.progress.time.monotonic", lambda: float(next(ticks)))
    with caplog.at_level(logging.INFO, logger="node.progress"):
        report = recovery.recover(cl, None, abnormal=True, chunk_bytes=1 << 20)
    assert report.records == 2000
    lines = [r for r in caplog.records if getattr(r, "progress", None) == "commitlog recovery scan"]
    assert lines, "a long scan logs its progress"
    assert lines[-1].done_bytes <= lines[-1].total_bytes
