"""The one thin layer every store file goes through.

`OsFileSystem` is the real thing (pread/pwrite/fdatasync on descriptors).
`FaultyFileSystem` wraps it for tests: it remembers what each file held at its
last fsync, and `crash()` puts the unsynced bytes back (optionally leaving a
torn prefix of the last write); it can also return ENOSPC on writes and EIO on
fsync. Anything that writes a store file takes a `FileSystem`.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
from typing import Protocol


class FileHandle(Protocol):
    path: str

    def pwrite(self, data: bytes | memoryview, offset: int) -> int: ...
    def pread(self, size: int, offset: int) -> bytes: ...
    def fsync(self) -> None: ...
    def truncate(self, size: int) -> None: ...
    def size(self) -> int: ...
    def close(self) -> None: ...


class OsFile:
    __slots__ = ("path", "fd")

    def __init__(self, path: str, fd: int):
        self.path = path
        self.fd = fd

    def pwrite(self, data: bytes | memoryview, offset: int) -> int:
        n = os.pwrite(self.fd, data, offset)
        if n != len(data):  # a short write on a regular file means the disk is full
            raise OSError(errno.ENOSPC, f"short write to {self.path}")
        return n

    def pread(self, size: int, offset: int) -> bytes:
        return os.pread(self.fd, size, offset)

    def fsync(self) -> None:
        os.fdatasync(self.fd)

    def truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class FileSystem:
    """Real files. Subclass (see FaultyFileSystem) to inject faults."""

    def open(self, path: str) -> FileHandle:
        """Open for read/write, creating it if missing."""
        return OsFile(path, os.open(path, os.O_RDWR | os.O_CREAT, 0o644))

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

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

    def disk_usage_ratio(self, path: str) -> float:
        usage = shutil.disk_usage(path)
        return usage.used / usage.total if usage.total else 0.0


class _FaultyFile:
    """An OsFile that remembers the bytes it overwrote since its last fsync."""

    def __init__(self, fs: "FaultyFileSystem", inner: OsFile):
        self.fs = fs
        self.inner = inner
        self.path = inner.path

    def pwrite(self, data: bytes | memoryview, offset: int) -> int:
        self.fs._charge(len(data), self.path)
        old = self.inner.pread(len(data), offset)
        size_before = self.inner.size()
        self.fs._undo.setdefault(self.path, []).append((offset, old, size_before))
        return self.inner.pwrite(data, offset)

    def pread(self, size: int, offset: int) -> bytes:
        return self.inner.pread(size, offset)

    def fsync(self) -> None:
        if self.fs.fail_fsync:
            raise OSError(errno.EIO, f"injected EIO on fsync of {self.path}")
        self.inner.fsync()
        self.fs._undo.pop(self.path, None)

    def truncate(self, size: int) -> None:
        # Treated as durable at once: the store fsyncs right after every truncate it relies on.
        self.inner.truncate(size)

    def size(self) -> int:
        return self.inner.size()

    def close(self) -> None:
        self.inner.close()


class FaultyFileSystem(FileSystem):
    """Real files plus injectable faults, for crash and disk-error tests.

    crash(torn=True) undoes every write not followed by an fsync of its file;
    with torn=True the newest write of each file keeps a random prefix instead.
    """

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self._undo: dict[str, list[tuple[int, bytes, int]]] = {}
        self.fail_fsync = False
        self.write_budget_bytes: int | None = None   # None = unlimited; else ENOSPC when exhausted

    def open(self, path: str) -> FileHandle:
        return _FaultyFile(self, super().open(path))  # type: ignore[arg-type]

    def _charge(self, n: int, path: str) -> None:
        if self.write_budget_bytes is None:
            return
        if n > self.write_budget_bytes:
            raise OSError(errno.ENOSPC, f"injected ENOSPC writing {path}")
        self.write_budget_bytes -= n

    def crash(self, torn: bool = False) -> dict[str, int]:
        """Lose unsynced writes. Returns bytes reverted per file."""
        reverted: dict[str, int] = {}
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
        return reverted
