"""Reads that would wait for the disk leave the event loop.

A read of data that is no longer in the page cache (a consumer far behind, a slave catching up
from the start of a segment) waits for the disk: 392 ms once in a random-fault run, with every
other request, heartbeat and replication message of the node stalled behind it. RocketMQ serves
pulls on a thread pool (PullMessageProcessor's executor) for that reason.

Here a read of older bytes (more than HOT_BYTES behind its files' end: newer ones are taken as
in the page cache, as RocketMQ's accessMessageInMemoryMaxRatio takes the newest part of the
commitlog) is first tried on the loop with `RWF_NOWAIT` (preadv2): the kernel answers from the
page cache or refuses at once. A refused read raises `DiskWait`, which carries how to bring
those bytes into the page cache; a small pool of worker threads does that while the loop
serves everything else, and the read is tried on the loop again:

    result = await read_without_stalling(fn, *args)

So `fn` always completes on the loop, its side effects (metrics, damage reports) included;
the workers only read files into the page cache. `fn` must do nothing before its reads that
it cannot do twice (a try cut short by `DiskWait` is tried again). A worker reads through
`SegmentedFile._warm`, which holds the lock that closing a segment takes, so it never reads a
closed descriptor.

Where the kernel or the file system has no `RWF_NOWAIT`, reads run on the loop as before; so
does a read whose `DiskWait` says nothing of how to warm it, and one still cold after
MAX_WARM_ROUNDS rounds (memory so short that what was read is gone again).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import os
import threading
import time
import weakref
from typing import Any, Callable, TypeVar

T = TypeVar("T")

WORKER_THREADS = 4          # page-cache fills at once (they only wait for the disk)
MAX_PENDING = 256           # fills queued or running per loop; more wait for a slot (a bound, not a drop)
MAX_WARM_ROUNDS = 64        # a pull touches at most a few dozen cold ranges; then it reads on the loop
WARM_BYTES = 256 * 1024     # a fill reads at least this much from the cold offset on (the records after it)
HOT_BYTES = 64 << 20        # reads this close to a file set's end are taken as cached and read plainly
_NOWAIT_FLAG = getattr(os, "RWF_NOWAIT", None)


class DiskWait(Exception):
    """A read made where reads must not wait found bytes outside the page cache. Not an
    OSError, so no handler of I/O errors on the read path mistakes it for damage. `warm`,
    set by the file that raised it, reads those bytes into the page cache (on a worker)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.warm: Callable[[], None] | None = None


class _Mode(threading.local):
    nowait = False        # this thread is the event loop, inside read_without_stalling's tries


_mode = _Mode()


class ColdReadStats:
    """Process-wide: page-cache fills made by the workers, and the seconds they took (for /metrics)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.seconds_total = 0.0
        self.seconds_max = 0.0
        self.nowait_unsupported = _NOWAIT_FLAG is None

    def observe(self, seconds: float) -> None:
        with self._lock:
            self.count += 1
            self.seconds_total += seconds
            self.seconds_max = max(self.seconds_max, seconds)


STATS = ColdReadStats()


def must_not_wait() -> bool:
    """True while the calling thread's reads must come from the page cache or raise DiskWait."""
    return _mode.nowait


def pread_nowait(fd: int, size: int, offset: int) -> bytes:
    """`size` bytes at `offset` from the page cache, or DiskWait. A short answer (part of the
    range cached) is a DiskWait too: the readers here never read past a file's end."""
    if size == 0:
        return b""
    buf = bytearray(size)
    try:
        n = os.preadv(fd, [buf], offset, _NOWAIT_FLAG)
    except BlockingIOError:
        raise DiskWait(f"{size} bytes at {offset} are not in the page cache") from None
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        STATS.nowait_unsupported = True     # an old kernel or a file system without it: read as before
        return os.pread(fd, size, offset)
    if n != size:
        raise DiskWait(f"{size - n} of {size} bytes at {offset} are not in the page cache")
    return bytes(buf)


def nowait_supported() -> bool:
    return not STATS.nowait_unsupported


class no_disk_waits:
    """`with no_disk_waits():` reads through a SegmentedFile raise DiskWait instead of waiting
    for the disk (for a synchronous caller that defers its work itself: a DLedger leader's
    push to a follower far behind, dledger/entry_store.py)."""

    __slots__ = ("_before",)

    def __enter__(self) -> None:
        self._before = _mode.nowait
        _mode.nowait = not STATS.nowait_unsupported

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
    """`fn(*args)` on the loop once every byte it reads is in the page cache; the bytes that
    were not are read into it by a worker meanwhile."""
    mode = _mode
    if STATS.nowait_unsupported:
        return fn(*args)
    for _ in range(MAX_WARM_ROUNDS):
        mode.nowait = True
        try:
            return fn(*args)
        except DiskWait as e:
            if e.warm is None:
                break
            warm = e.warm
        finally:
            mode.nowait = False
        await fill(warm)
    return fn(*args)


async def fill(warm: Callable[[], None]) -> None:
    """Run a DiskWait's `warm` on a cold-read worker (at most MAX_PENDING per loop at once)."""
    loop = asyncio.get_running_loop()
    slots = _slots.get(loop)
    if slots is None:
        slots = _slots[loop] = asyncio.Semaphore(MAX_PENDING)
    async with slots:
        t0 = time.perf_counter()
        try:
            await loop.run_in_executor(_pool(), warm)
        finally:
            STATS.observe(time.perf_counter() - t0)
