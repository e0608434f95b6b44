"""Progress with an ETA for long work (recovery scans, benchmarks).

On a terminal (stderr is a TTY) it redraws one bar line at most every `redraw_s`;
otherwise (containers, tests, log files) it writes one structured log line every
`log_every_s`. Nothing is shown for work that finishes within `quiet_s`, so short
recoveries stay silent. The clock is injected for tests.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable, TextIO

log = logging.getLogger(__name__)

BAR_WIDTH = 30


def fmt_eta(seconds: float) -> str:
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    def __init__(self, label: str, total: int, *, unit: str = "MB", scale: float = 1024 * 1024,
                 stream: TextIO | None = None, logger: logging.Logger | None = None,
                 quiet_s: float = 1.0, redraw_s: float = 0.2, log_every_s: float = 5.0,
                 clock: Callable[[], float] | None = None):
        assert total >= 0, total
        self.label, self.total, self.unit, self.scale = label, total, unit, scale
        self.stream = stream if stream is not None else sys.stderr
        self.logger = logger or log
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.quiet_s, self.redraw_s, self.log_every_s = quiet_s, redraw_s, log_every_s
        self.clock = clock or time.monotonic
        self.t0 = self.clock()
        self.done = 0
        self._last_emit = self.t0
        self.emitted = 0            # lines or redraws written (tests read it)

    def rate(self) -> float:
        elapsed = self.clock() - self.t0
        return self.done / elapsed if elapsed > 0 else 0.0

    def eta_s(self) -> float | None:
        r = self.rate()
        return (self.total - self.done) / r if r > 0 else None

    def text(self) -> str:
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        eta = self.eta_s()
        return (f"{self.label} {frac * 100:5.1f}% {self.done / self.scale:.1f}/{self.total / self.scale:.1f} "
                f"{self.unit} {self.rate() / self.scale:.1f} {self.unit}/s ETA "
                f"{fmt_eta(eta) if eta is not None else '?'}")

    def update(self, done: int) -> None:
        self.done = max(0, min(done, self.total)) if self.total else done
        now = self.clock()
        if now - self.t0 < self.quiet_s:
            return
        if now - self._last_emit < (self.redraw_s if self.tty else self.log_every_s):
            return
        self._last_emit = now
        self._emit()

    def _emit(self) -> None:
        self.emitted += 1
        if self.tty:
            frac = min(1.0, self.done / self.total) if self.total else 1.0
            filled = int(frac * BAR_WIDTH)
            self.stream.write(f"\r[{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {self.text()}\x1b[K")
            self.stream.flush()
        else:
            eta = self.eta_s()
            self.logger.info(self.text(), extra={"progress": self.label, "done_bytes": self.done,
                                                 "total_bytes": self.total,
                                                 "eta_s": round(eta, 1) if eta is not None else None})

    def finish(self) -> None:
        """End the bar line (TTY) if anything was drawn; log lines need no closing."""
        if self.tty and self.emitted:
            self.done = self.total
            self._emit()
            self.stream.write("\n")
            self.stream.flush()
