"""DiskGuard: the store volume's fill level, read at most once per interval, and the refusal."""

from __future__ import annotations

import pytest

from node.store.disk_guard import DiskGuard
from node.store.errors import DiskFull
from node.store.fileio import FileSystem


class CountingFs(FileSystem):
    def __init__(self, ratio: float):
        self.ratio, self.reads = ratio, 0

    def disk_usage_ratio(self, path: str) -> float:
        self.reads += 1
        return self.ratio


def test_the_ratio_is_read_at_most_once_per_interval_unless_rechecked():
    fs, now = CountingFs(0.5), [100.0]
    g = DiskGuard(fs, "/store", 90, check_interval_ms=1000, clock=lambda: now[0])
    assert g.ratio() == 0.5 and fs.reads == 1
    fs.ratio = 0.95
    now[0] += 0.999
    assert not g.full() and fs.reads == 1          # still the cached look
    g.recheck()
    assert g.full() and fs.reads == 2 and g.last_ratio == 0.95
    fs.ratio = 0.2
    now[0] += 1.0
    assert not g.full() and fs.reads == 3


def test_check_refuses_at_the_limit_with_a_clear_retriable_error():
    fs = CountingFs(0.90)
    g = DiskGuard(fs, "/store", 90, check_interval_ms=0)
    with pytest.raises(DiskFull, match=r"disk 90\.0% full at /store, at or above diskSpaceWarningLevelRatio "
                                       r"90%: sends refused") as ei:
        g.check("sends refused")
    assert ei.value.http_status == 507 and ei.value.retriable
    fs.ratio = 0.899
    g.check()


@pytest.mark.parametrize("pct", [0, -1, 101])
def test_a_limit_outside_0_to_100_is_refused(pct):
    with pytest.raises(ValueError, match="limit_pct"):
        DiskGuard(CountingFs(0.0), "/store", pct)
