"""The store volume's fill level, and the refusal of writes when it is too full.

RocketMQ refuses puts once the commitlog's disk is `diskSpaceWarningLevelRatio` (90 %) full
and lets retention free space; DLedger refuses appends, on leader and followers alike,
above its `diskFullRatio`. Both modes here use one guard: the ratio is read from the file
system at most every `check_interval_ms` (a statvfs per append would cost more than the
append), and `recheck()` makes the next look fresh (after an ENOSPC, before retention).
"""

from __future__ import annotations

import time
from typing import Callable

from node.store.errors import DiskFull
from node.store.fileio import FileSystem


class DiskGuard:
    def __init__(self, fs: FileSystem, path: str, limit_pct: int, check_interval_ms: int = 1000,
                 clock: Callable[[], float] = time.monotonic):
        if not 0 < limit_pct <= 100:
            raise ValueError(f"DiskGuard limit_pct must be in (0, 100], got {limit_pct}")
        self.fs, self.path, self.limit_pct = fs, path, limit_pct
        self.check_interval_s = check_interval_ms / 1000
        self.clock = clock
        self.last_ratio = 0.0             # as of the last look (status pages show it)
        self._checked_at = float("-inf")

    def ratio(self) -> float:
        """Used fraction of the volume, at most check_interval_ms old."""
        now = self.clock()
        if now - self._checked_at >= self.check_interval_s:
            self.last_ratio = self.fs.disk_usage_ratio(self.path)
            self._checked_at = now
        return self.last_ratio

    def recheck(self) -> None:
        self._checked_at = float("-inf")

    def full(self) -> bool:
        return self.ratio() * 100 >= self.limit_pct

    def reason(self) -> str:
        return (f"disk {self.last_ratio:.1%} full at {self.path}, at or above "
                f"diskSpaceWarningLevelRatio {self.limit_pct}%")

    def check(self, then: str = "writes refused until retention frees space") -> None:
        """Raise DiskFull (HTTP 507, retriable) at or above the limit."""
        if self.full():
            raise DiskFull(f"{self.reason()}: {then}")
