"""Reads of old bytes leave the event loop.

A read of data that is no longer in the page cache (a consumer far behind, a slave or a
follower catching up from far back) waits for the disk: 392 ms once in a random-fault run,
400-550 ms while a DLedger follower caught up 500 MB here, with every other request,
heartbeat and replication message of the node stalled behind it. RocketMQ serves pulls on a
thread pool (PullMessageProcessor's executor) for that reason.

Here a read of bytes more than HOT_BYTES behind the end of their files (newer ones are taken as
in the page cache, as RocketMQ's accessMessageInMemoryMaxRatio takes the newest part of the
commitlog, and are read on the loop as before) is never made on the loop. Made where reads must
not wait, it raises `DiskWait`, whose `fetch` reads at least FETCH_BYTES from there on a small
pool of worker threads and leaves them with the file (`SegmentedFile`'s fetched slots); the
read is then tried on the loop again and answered from those bytes:

    result = await read_without_stalling(fn, *args)

So `fn` always completes on the loop, its side effects (metrics, damage reports) included; the
workers only read. `fn` must do nothing before its reads that it cannot do twice (a try cut
short by `DiskWait` is tried again). A worker reads under the lock that closing a segment
takes, so it never reads a closed descriptor; whatever changes bytes a fetch holds (truncation,
expiry, a reset, an in-place repair) drops the file's fetched bytes.

With `pageCacheRetainBytes` (RETAIN_BYTES, at least HOT_BYTES) a file set's flush also drops
the page cache of its flushed bytes more than RETAIN_BYTES behind its end (posix_fadvise
DONTNEED, on the flusher's thread, a quarter of the tail or DROP_STEP_BYTES at a time): the
node's page cache stays bounded and its writes take the pages it freed. On a VM whose host
backs guest memory lazily and takes back what the guest frees, a page never touched (or freed
a while ago) costs about ten times the system CPU of a reused one: writing new file data took
2.4-2.9 s of system CPU per GiB here once the recently freed pages were used up, against
0.19-0.25 s per GiB with the tail bounded at 256 MiB.

Asking the kernel instead (cachestat(2) for residency, then preadv2 with RWF_NOWAIT) was tried
first and is not enough: a page counted as cached may still be under a readahead's I/O, and
RWF_NOWAIT still submits readahead at a marker page; either waited 376-468 ms on a busy disk.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import weakref
from typing import Any, Callable, TypeVar

from node.histogram import LatencyHistogram

T = TypeVar("T")

WORKER_THREADS = 4          # fetches at once (they only wait for the disk)
MAX_PENDING = 256           # fetches queued or running per loop; more wait for a slot (a bound, not a drop)
MAX_FETCH_ROUNDS = 64       # a pull touches at most a few dozen old ranges; then it reads on the loop
FETCH_BYTES = 256 * 1024    # a fetch reads at least this much from the old offset on (the records after it)
FETCH_AHEAD_MAX = 4 << 20   # and, for a larger read, as much again (up to this): the next batch of a catch-up
FETCH_SLOTS = 8             # fetched ranges a file keeps for the loop's next tries (oldest dropped first)
FETCH_SLOT_BYTES = 16 << 20 # and at most this many bytes of them
FETCH_SLOT_TTL_S = 5.0      # a fetched range older than this is dropped (its memory freed) at the next lookup
HOT_BYTES = 64 << 20        # reads this close to a file set's end are taken as cached, made on the loop (coldReadHotBytes)
RETAIN_BYTES = 0            # flushed bytes kept in the page cache behind a file set's end; 0: all (pageCacheRetainBytes)
DROP_STEP_BYTES = 32 << 20  # a flush drops cached pages once a quarter of the tail, at most this, is past it


class DiskWait(Exception):
    """A read of old bytes, made where reads must not wait. Not an OSError, so no handler of
    I/O errors on the read path mistakes it for damage. `fetch`, set by the file that raised
    it, reads those bytes for the next try (on a worker)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.fetch: Callable[[], None] | None = None


class _Mode(threading.local):
    nowait = False        # this thread is the event loop, inside a try that must not wait


_mode = _Mode()


# Each fetch made by a worker and the seconds it took (for /metrics: one process-wide histogram).
FILL_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FILLS = LatencyHistogram(FILL_BUCKETS_S)


def must_not_wait() -> bool:
    """True while the calling thread's reads of old bytes must raise DiskWait."""
    return _mode.nowait


class no_disk_waits:
    """`with no_disk_waits():` reads of old bytes through a SegmentedFile raise DiskWait unless
    fetched already (for a synchronous caller that defers its work itself: a DLedger leader's
    push to a follower far behind, dledger/entry_store.py)."""

    __slots__ = ("_before",)

    def __enter__(self) -> None:
        self._before = _mode.nowait
        _mode.nowait = True

    def __exit__(self, *exc: object) -> None:
        _mode.nowait = self._before


_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()
_slots: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]" = weakref.WeakKeyDictionary()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="cold-read")
        return _executor


async def read_without_stalling(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the loop, its reads of old bytes fetched by a worker first."""
    for _ in range(MAX_FETCH_ROUNDS):
        try:
            with no_disk_waits():
                return fn(*args)
        except DiskWait as e:
            if e.fetch is None:
                break
            fetch = e.fetch
        await fill(fetch)
    return fn(*args)


async def fill(fetch: Callable[[], None]) -> None:
    """Run a DiskWait's `fetch` on a cold-read worker (at most MAX_PENDING per loop at once)."""
    loop = asyncio.get_running_loop()
    slots = _slots.get(loop)
    if slots is None:
        slots = _slots[loop] = asyncio.Semaphore(MAX_PENDING)
    async with slots:
        t0 = time.perf_counter()
        try:
            await loop.run_in_executor(_pool(), fetch)
        finally:
            FILLS.observe(time.perf_counter() - t0)
