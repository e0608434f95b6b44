"""The one thin layer every store file goes through.

`OsFileSystem` is the real thing (pread/pwrite/fdatasync on descriptors).
`FaultyFileSystem` wraps it for tests: it remembers what each file held at its
last fsync, and `crash()` puts the unsynced bytes back (optionally leaving a
torn prefix of the last write); it can also return ENOSPC on writes (charged only
for bytes the disk must newly allocate, as a real disk would), cut one write short,
and return EIO on fsync. Anything that writes a store file takes a `FileSystem`.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import errno
import functools
import os
import random
import shutil
import threading
from typing import TYPE_CHECKING, Protocol

from node.store import cold_reads

if TYPE_CHECKING:
    from node.store.reaper import FileReaper


class ShortWrite(OSError):
    """A write that stored only its first `written` bytes before failing (ENOSPC).

    The caller must treat those bytes as present in the file: they are there until
    it truncates them away."""

    def __init__(self, err: int, message: str, written: int):
        super().__init__(err, message)
        self.written = written


class FileHandle(Protocol):
    path: str

    def pwrite(self, data: bytes | memoryview, offset: int) -> int: ...
    def pread(self, size: int, offset: int) -> bytes: ...
    def fsync(self) -> None: ...
    def drop_cache(self, offset: int, size: int) -> None: ...
    def truncate(self, size: int) -> None: ...
    def size(self) -> int: ...
    def data_end(self, limit: int) -> int: ...
    def close(self) -> None: ...


class OsFile:
    __slots__ = ("path", "fd")

    def __init__(self, path: str, fd: int):
        self.path = path
        self.fd = fd

    def pwrite(self, data: bytes | memoryview, offset: int) -> int:
        """Write all of `data` at `offset`, or raise; ShortWrite says how much landed."""
        size = len(data)
        n = os.pwrite(self.fd, data, offset)
        if n == size:
            return n
        # A short write on a regular file: retry the rest once; it fails with the real error
        # (ENOSPC) or completes. Either way the caller learns exactly what is in the file.
        view = memoryview(data)
        done = n
        for _ in range(2):
            try:
                n = os.pwrite(self.fd, view[done:], offset + done)
            except OSError as e:
                raise ShortWrite(e.errno or errno.ENOSPC, f"short write to {self.path}: {e.strerror}",
                                 done) from e
            if n == 0:
                break
            done += n
            if done == size:
                return size
        raise ShortWrite(errno.ENOSPC, f"short write to {self.path} ({done} of {size} bytes)", done)

    def pread(self, size: int, offset: int) -> bytes:
        if size < 0 or offset < 0:
            raise ValueError(f"pread of {self.path}: size {size} and offset {offset} must be >= 0")
        return os.pread(self.fd, size, offset)

    def fsync(self) -> None:
        os.fdatasync(self.fd)

    def drop_cache(self, offset: int, size: int) -> None:
        """Drop the OS page cache of [offset, offset + size) (clean pages only: flush first)."""
        os.posix_fadvise(self.fd, offset, size, os.POSIX_FADV_DONTNEED)

    def truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def data_end(self, limit: int) -> int:
        """Where the bytes ever written from offset 0 end, within `limit`: the start of a hole
        that runs to the end of the file (past it every byte reads as zero), or `limit` when
        data follows a hole or the file system cannot say. A file created sparse at full size
        and half filled reads as only that half."""
        try:
            hole = os.lseek(self.fd, 0, os.SEEK_HOLE)
            if hole >= limit:
                return limit
            try:
                os.lseek(self.fd, hole, os.SEEK_DATA)
            except OSError as e:
                return hole if e.errno == errno.ENXIO else limit   # ENXIO: a hole to the end
            return limit
        except OSError:
            return limit

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class DeferredDirSync:
    """The names of files created in one directory, made durable by the owner's next flush
    instead of at creation: an fsync of the directory on an append path blocked the event
    loop for up to 680 ms behind another writer, and for as long as a slow disk takes.

    A flush syncs the waiting names before it fsyncs any data (call `sync()` first), so a
    file whose name a crash lost never held a flushed byte, and neither did any file created
    after it. Any number of names may wait once the directory holds a durable name before
    them: a crash then loses some of the newest files, possibly one between two others, and
    the owner's load sets aside what follows such a gap (`SegmentedFile.load`). In a
    directory with no durable name (a new one, or one just opened until its names are
    synced: the owners' loads do that at once, off the event loop) one name waits and a
    second new file fsyncs the directory at once: a crash could otherwise keep a later file
    with no earlier one to show the gap, and the later file would be taken for the start.
    `sync()` may run on a flush thread. Where writes must not wait (the dispatch on the event
    loop, within `cold_reads.no_disk_waits`), an owner calls `off_loop_first()` before each new
    file: such a second file then has a worker make the names durable first."""

    def __init__(self, fs: "FileSystem", directory: str, existing: bool = False):
        self.fs, self.directory = fs, directory
        self._pending = 1 if existing else 0   # names not known durable (opened ones count as one)
        self._anchored = False                 # a durable name precedes every waiting one
        self._lock = threading.Lock()          # never held over an fsync: the loop takes it

    def created(self, defer: bool = True) -> None:
        """A file was just created here; call it before the file counts toward what a flush
        claims durable. `defer=False`: its name is made durable now."""
        with self._lock:
            self._pending += 1
            if defer and (self._anchored or self._pending == 1):
                return
        self._fsync(anchored=True)

    def off_loop_first(self) -> None:
        """Before a new file here: where writes must not wait (the dispatch on the loop), raise
        DiskWait if the file would fsync the directory at once (a second new file where no
        name is durable yet: a new queue, any queue after a reset, a new index directory). Its
        `fetch` makes the names durable on a worker; the write is then tried again and defers
        its name. A random-fault run's event loop stalled 791 ms in such an fsync."""
        if not cold_reads.must_not_wait():
            return
        with self._lock:
            if self._anchored or not self._pending:
                return
        e = cold_reads.DiskWait(f"{self.directory}: its file names are not durable yet; fsync it off the loop first")
        e.fetch = self._sync_if_there
        raise e

    def _sync_if_there(self) -> None:
        """sync(), for a worker. A directory gone meanwhile (its topic deleted while this
        waited: the queue's directory renamed aside) has nothing left to make durable."""
        try:
            self.sync()
        except FileNotFoundError:
            pass

    def restarted(self) -> None:
        """The owner removed its files and created one: that name waits, none durable before it
        (the next `sync()` makes the removals durable too). For derived data only, which a
        crash before that sync rebuilds."""
        with self._lock:
            self._pending, self._anchored = 1, False

    def sync(self) -> None:
        """Before a flush claims bytes durable: the waiting names, if any."""
        if self._pending:
            self._fsync(anchored=True)

    def sync_now(self, files_remain: bool) -> None:
        """The owner removed files (or changed names otherwise): fsync the directory now;
        `files_remain` says whether it still holds a file of the owner's."""
        self._fsync(anchored=files_remain)

    def _fsync(self, anchored: bool) -> None:
        # A name created while the fsync runs may be covered or not: it stays waiting.
        with self._lock:
            covered = self._pending
        self.fs.fsync_dir(self.directory)
        with self._lock:
            self._pending -= covered
            self._anchored = anchored


class FileSystem:
    """Real files. Subclass (see FaultyFileSystem) to inject faults."""

    # Removes the old files retention deletes (SegmentedFile.delete_head) on a thread of its
    # own (node/store/reaper.py); None: the caller removes them. A node sets one.
    reaper: "FileReaper | None" = None

    def open(self, path: str) -> FileHandle:
        """Open for read/write, creating it if missing."""
        return OsFile(path, os.open(path, os.O_RDWR | os.O_CREAT, 0o644))

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def mtime(self, path: str) -> float:
        """Last modification time in seconds since the epoch (retention ages files by it)."""
        return os.stat(path).st_mtime

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path)) if os.path.isdir(path) else []

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def remove(self, path: str) -> None:
        if os.path.exists(path):
            os.remove(path)

    def rmtree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_file(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def reserve_blocks(self, path: str, size: int) -> None:
        """Allocate the blocks of the existing file `path` up to `size` bytes without changing
        its length (fallocate FALLOC_FL_KEEP_SIZE): a file that later grows into them through
        an mmap (pysyncobj's journal) needs no new block then, so a full disk cannot fault its
        writes (SIGBUS). OSError when the file system cannot (ENOSPC, EOPNOTSUPP)."""
        fallocate = _fallocate()
        if fallocate is None:
            raise OSError(errno.EOPNOTSUPP, "fallocate(2) is not available on this system")
        fd = os.open(path, os.O_RDWR)
        try:
            if fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, size) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"fallocate {path}: {os.strerror(err)}")
        finally:
            os.close(fd)

    def allocate(self, path: str, size: int) -> None:
        """Make `path` a file of `size` bytes whose blocks are all allocated (zeros written,
        not a sparse hole), durably: a reserve whose removal gives that much room back.
        Nothing to do when it already has that size. OSError (ENOSPC) leaves no file behind."""
        f = self.open(path)
        try:
            if f.size() == size:
                return
            f.truncate(0)
            zeros = bytes(min(size, 1 << 20))
            for at in range(0, size, len(zeros)):
                f.pwrite(zeros[:size - at], at)
            f.fsync()
        except OSError:
            f.close()
            self.remove(path)
            raise
        finally:
            f.close()
        self.fsync_dir(os.path.dirname(path) or ".")

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write temp, fsync, rename over `path`, fsync the directory: all or nothing."""
        tmp = path + ".tmp"
        f = self.open(tmp)
        try:
            f.truncate(0)
            f.pwrite(data, 0)
            f.fsync()
        finally:
            f.close()
        self.rename(tmp, path)
        self.fsync_dir(os.path.dirname(path) or ".")

    def free_bytes(self, path: str) -> int:
        return shutil.disk_usage(path).free

    def disk_usage_ratio(self, path: str) -> float:
        usage = shutil.disk_usage(path)
        return usage.used / usage.total if usage.total else 0.0


FALLOC_FL_KEEP_SIZE = 0x01


@functools.cache
def _fallocate():
    """libc's fallocate(2) (the os module has only posix_fallocate, which grows the file)."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).fallocate
    except (OSError, AttributeError):    # not Linux
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong)
    fn.restype = ctypes.c_int
    return fn


def _data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """The allocated (non-hole) byte ranges of an open file, as the kernel reports them."""
    out: list[tuple[int, int]] = []
    pos = 0
    for _ in range(1 << 20):   # bounded: a file has far fewer extents than this
        if pos >= size:
            break
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:        # ENXIO: only a hole from here on
            break
        end = os.lseek(fd, start, os.SEEK_HOLE)
        out.append((start, min(end, size)))
        pos = end
    return out


class _Extents:
    """Sorted, disjoint, non-touching [start, end) ranges: the bytes a file has allocated.

    Lookups and inserts bisect, so random small writes (index hash slots) stay cheap."""

    __slots__ = ("starts", "ends")

    def __init__(self, ranges: list[tuple[int, int]] | None = None):
        self.starts: list[int] = []
        self.ends: list[int] = []
        for a, b in ranges or []:
            self.add(a, b)

    def covered(self, lo: int, hi: int) -> int:
        """How many bytes of [lo, hi) are already allocated."""
        n = 0
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        starts, ends = self.starts, self.ends
        while i < len(starts) and starts[i] < hi:
            if ends[i] > lo:
                n += min(ends[i], hi) - max(starts[i], lo)
            i += 1
        return n

    def add(self, lo: int, hi: int) -> None:
        if lo >= hi:
            return
        starts, ends = self.starts, self.ends
        i = bisect.bisect_left(ends, lo)           # first range that ends at or after lo (may touch)
        j = bisect.bisect_right(starts, hi)        # ranges [i, j) overlap or touch [lo, hi)
        if i < j:
            lo, hi = min(lo, starts[i]), max(hi, ends[j - 1])
        starts[i:j] = [lo]
        ends[i:j] = [hi]

    def cut(self, size: int) -> None:
        """The file was truncated to `size`: nothing past it stays allocated."""
        i = bisect.bisect_left(self.starts, size)
        del self.starts[i:], self.ends[i:]
        if self.ends and self.ends[-1] > size:
            self.ends[-1] = size


class _FaultyFile:
    """An OsFile that remembers the bytes it overwrote since its last fsync."""

    def __init__(self, fs: "FaultyFileSystem", inner: OsFile):
        self.fs = fs
        self.inner = inner
        self.path = inner.path
        fs._extents_of(self.path, inner)

    def pwrite(self, data: bytes | memoryview, offset: int) -> int:
        extents = self.fs._extents_of(self.path, self.inner)
        new_bytes = len(data) - extents.covered(offset, offset + len(data))
        self.fs._charge(new_bytes, self.path)
        cut = self.fs.short_write_bytes
        if cut is not None and cut < len(data):
            self.fs.short_write_bytes = None       # one-shot
            self._write(data[:cut], offset)
            raise ShortWrite(errno.ENOSPC, f"injected short write to {self.path} ({cut} of {len(data)} bytes)",
                             cut)
        return self._write(data, offset)

    def _write(self, data: bytes | memoryview, offset: int) -> int:
        old = self.inner.pread(len(data), offset)
        size_before = self.inner.size()
        self.fs._undo.setdefault(self.path, []).append((offset, old, size_before))
        n = self.inner.pwrite(data, offset)
        self.fs._extents_of(self.path, self.inner).add(offset, offset + len(data))
        return n

    def pread(self, size: int, offset: int) -> bytes:
        return self.inner.pread(size, offset)

    def fsync(self) -> None:
        if self.fs.fail_fsync:
            raise OSError(errno.EIO, f"injected EIO on fsync of {self.path}")
        self.inner.fsync()
        self.fs._undo.pop(self.path, None)

    def drop_cache(self, offset: int, size: int) -> None:
        self.inner.drop_cache(offset, size)

    def truncate(self, size: int) -> None:
        # Treated as durable at once: the store fsyncs right after every truncate it relies on.
        self.inner.truncate(size)
        self.fs._extents_of(self.path, self.inner).cut(size)

    def size(self) -> int:
        return self.inner.size()

    def data_end(self, limit: int) -> int:
        return self.inner.data_end(limit)

    def close(self) -> None:
        self.inner.close()


class FaultyFileSystem(FileSystem):
    """Real files plus injectable faults, for crash and disk-error tests.

    crash(torn=True) undoes every write not followed by an fsync of its file;
    with torn=True the newest write of each file keeps a random prefix instead.
    `write_budget_bytes` models free space: a write is charged only for the bytes it
    newly allocates (overwriting bytes already written costs nothing; filling a sparse
    hole does), and one that does not fit fails with ENOSPC before writing anything;
    removing a file this file system has written gives its bytes back.
    `short_write_bytes` makes the next write longer than that store only that many bytes
    and raise ShortWrite (ENOSPC). `mtimes` overrides FileSystem.mtime per path.
    A file created since its directory's last fsync_dir is gone after crash(), as its
    directory entry would be, or with crash(new_names="random") each such file survives or
    not (a rename counts as durable at once).
    """

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self._undo: dict[str, list[tuple[int, bytes, int]]] = {}
        self._extents: dict[str, _Extents] = {}
        self.fail_fsync = False
        self.write_budget_bytes: int | None = None   # None = unlimited; else ENOSPC when exhausted
        self.short_write_bytes: int | None = None    # one-shot: the next longer write stops here
        self.mtimes: dict[str, float] = {}
        self._new_files: dict[str, set[str]] = {}    # directory -> files created since its last fsync

    def open(self, path: str) -> FileHandle:
        if not os.path.exists(path):
            self._new_files.setdefault(os.path.dirname(path), set()).add(path)
        return _FaultyFile(self, super().open(path))  # type: ignore[arg-type]

    def fsync_dir(self, path: str) -> None:
        super().fsync_dir(path)
        self._new_files.pop(path.rstrip(os.sep) or os.sep, None)

    def _extents_of(self, path: str, handle: OsFile) -> _Extents:
        ext = self._extents.get(path)
        if ext is None:   # first sight of the file (or forgotten after a crash): ask the kernel
            ext = self._extents[path] = _Extents(_data_extents(handle.fd, handle.size()))
        return ext

    def remove(self, path: str) -> None:
        super().remove(path)
        ext = self._extents.pop(path, None)
        if ext is not None and self.write_budget_bytes is not None:   # its blocks are free again
            self.write_budget_bytes += ext.covered(0, 1 << 62)

    def rmtree(self, path: str) -> None:
        super().rmtree(path)
        prefix = os.path.join(path, "")
        for p in [p for p in self._extents if p.startswith(prefix)]:
            del self._extents[p]

    def rename(self, src: str, dst: str) -> None:
        super().rename(src, dst)
        self._new_files.get(os.path.dirname(src), set()).discard(src)
        if src in self._extents:
            self._extents[dst] = self._extents.pop(src)
        else:
            self._extents.pop(dst, None)

    def mtime(self, path: str) -> float:
        return self.mtimes[path] if path in self.mtimes else super().mtime(path)

    def _charge(self, n: int, path: str) -> None:
        if self.write_budget_bytes is None or n <= 0:
            return
        if n > self.write_budget_bytes:
            raise OSError(errno.ENOSPC, f"injected ENOSPC writing {path}")
        self.write_budget_bytes -= n

    def crash(self, torn: bool = False, new_names: str = "lost") -> dict[str, int]:
        """Lose unsynced writes, and files whose directory entry was never fsynced: all of them
        (`new_names="lost"`), or each one or not, at random (`"random"`: POSIX promises no
        order among names a directory fsync has not covered). Returns bytes reverted per file
        (-1: the file is gone)."""
        assert new_names in ("lost", "random")
        reverted: dict[str, int] = {}
        for files in self._new_files.values():
            for path in sorted(files):
                if new_names == "random" and self.rng.random() < 0.5:
                    continue          # its name survived; its unsynced writes are reverted below
                if os.path.exists(path):
                    os.remove(path)
                    reverted[path] = -1
                self._undo.pop(path, None)
        self._new_files.clear()
        for path, writes in self._undo.items():
            if not os.path.exists(path):
                continue
            fd = os.open(path, os.O_RDWR)
            try:
                keep_last = torn and self.rng.random() < 0.5
                for i, (offset, old, size_before) in enumerate(reversed(writes)):
                    if keep_last and i == 0 and old:
                        cut = self.rng.randrange(len(old))  # torn: the first `cut` new bytes stay
                        os.pwrite(fd, old[cut:], offset + cut)
                    else:
                        os.pwrite(fd, old, offset)
                    if os.fstat(fd).st_size > size_before and not (keep_last and i == 0):
                        os.ftruncate(fd, size_before)
                    reverted[path] = reverted.get(path, 0) + len(old)
            finally:
                os.close(fd)
        self._undo.clear()
        self._extents.clear()   # reverted writes may have freed space: re-read allocation on next use
        return reverted
