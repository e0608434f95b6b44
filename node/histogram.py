"""LatencyHistogram: durations in cumulative buckets, observed from any thread, exported to
Prometheus as a histogram (`..._bucket`, `..._count`, `..._sum`) at scrape time.

Used for fsyncs (node/metrics.py TimedFileSystem), event-loop stalls (node/loop_watchdog.py)
and reads of old bytes made by a worker (node/store/cold_reads.py).
"""

from __future__ import annotations

import threading

from prometheus_client.core import HistogramMetricFamily

FSYNC_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)


class LatencyHistogram:
    """Cumulative-bucket histogram, safe to observe from worker threads (fsyncs run in to_thread)."""

    def __init__(self, buckets: tuple[float, ...] = FSYNC_BUCKETS_S):
        assert list(buckets) == sorted(buckets), "buckets ascend"
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)       # last one is +Inf
        self.sum_s = 0.0
        self.max_s = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = 0
        while i < len(self.buckets) and seconds > self.buckets[i]:
            i += 1
        with self._lock:
            self.counts[i] += 1
            self.sum_s += seconds
            if seconds > self.max_s:
                self.max_s = seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        with self._lock:
            counts, total = list(self.counts), self.sum_s
        cumulative, acc = [], 0
        for bound, c in zip([*map(_fmt_bound, self.buckets), "+Inf"], counts):
            acc += c
            cumulative.append((bound, acc))
        return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=total)


def _fmt_bound(b: float) -> str:
    return repr(float(b))
