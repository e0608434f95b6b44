"""A file system of its own for one node's store, small enough to fill: a size-limited tmpfs
mounted on the store directory. Filling it gives the node a real ENOSPC on every write and a
real statvfs at 100 %, where on a loopback machine every node otherwise shares one big disk.

Needs root (mount); `unavailable()` says why not, else None, and `require()` fails a test
with that reason: as the netns tier, a test that needs a mount fails where it cannot have one,
it is not skipped (`make test` runs as root; CI does). Fill and free are the test's
fault: `fill()` writes a filler file until the file system refuses the last page, `free()`
removes it. `unmount()` copies what the store holds back onto the directory underneath first
when asked (a failing run keeps its stores).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile

FILLER = "zz-filler"          # in the store root; no store component reads a file of this name
CHUNKS = (1 << 20, 4096)      # fill with MiB writes, then page writes up to the last page


def unavailable() -> str | None:
    """Why a SmallDisk cannot be mounted here (not root, no mount), or None."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "mount/umount not installed"
    return None


def require() -> None:
    """In a test: fail, saying why, where no small disk can be mounted."""
    why = unavailable()
    if why is not None:
        import pytest
        pytest.fail(f"this test puts a store on a tmpfs of its own and cannot mount one here: {why} "
                    "(run make test as root)", pytrace=False)


class SmallDisk:
    """A tmpfs of `mib` MiB on `path` (created if missing)."""

    def __init__(self, path: str, mib: int):
        self.path, self.mib = path, mib
        self.mounted = False

    def mount(self) -> "SmallDisk":
        os.makedirs(self.path, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.mib}m,mode=0755", "tmpfs", self.path],
                       check=True, capture_output=True, timeout=10)
        self.mounted = True
        return self

    def fill(self) -> int:
        """Write the filler until no page is left; the bytes written (0 if already full)."""
        written = 0
        fd = os.open(os.path.join(self.path, FILLER), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            for size in CHUNKS:
                block = bytes(size)
                for _ in range(self.mib * (1 << 20) // size + 1):   # bounded by the disk's size
                    try:
                        n = os.write(fd, block)
                    except OSError as e:
                        if e.errno != errno.ENOSPC:
                            raise
                        break
                    written += n
                    if n < size:
                        break
        finally:
            os.close(fd)
        return written

    def free(self) -> None:
        try:
            os.remove(os.path.join(self.path, FILLER))
        except FileNotFoundError:
            pass

    def used_ratio(self) -> float:
        u = shutil.disk_usage(self.path)
        return u.used / u.total if u.total else 0.0

    def unmount(self, keep: bool = False) -> None:
        """Unmount (the processes using it must have ended); with `keep`, what the store holds
        (the filler excepted) stays on the directory underneath."""
        if not self.mounted:
            return
        saved = None
        if keep:
            self.free()
            saved = tempfile.mkdtemp(prefix="small-disk-", dir=os.path.dirname(self.path))
            shutil.copytree(self.path, saved, dirs_exist_ok=True)
        r = subprocess.run(["umount", self.path], capture_output=True, timeout=10)
        if r.returncode != 0:       # still busy: detach now, the kernel frees it when unused
            subprocess.run(["umount", "-l", self.path], check=True, capture_output=True, timeout=10)
        self.mounted = False
        if saved is not None:
            shutil.copytree(saved, self.path, dirs_exist_ok=True)
            shutil.rmtree(saved, ignore_errors=True)
