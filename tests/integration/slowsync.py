"""A slow disk for real node processes (slowsync_shim.c, loaded with LD_PRELOAD).

    disk = SlowSync(dir)              # builds the shim once per test session
    disk.attach("n0", proc)
    disk.set("n0", 1500)              # each of n0's fsyncs waits 1.5 s first, from now on
    disk.reset()                      # every process back to its disk's own speed

Each process named gets a file of its own holding its delay in ms; a change rewrites it
atomically and the process sees it within ~20 ms. Only fsync and fdatasync wait: writes
land in the page cache as fast as before, as on a disk whose queue is long. Needs a C
compiler (`cc`); without one `SlowSync` raises with that reason.
"""

from __future__ import annotations

from tests.integration import shims


def unavailable() -> str | None:
    """Why syncs cannot be slowed here (no C compiler, the shim does not build), or None."""
    return shims.unavailable(SlowSync.SOURCE)


class SlowSync(shims.SettingShim):
    SOURCE = "slowsync_shim.c"
    ENV = "MQSTORE_SLOWSYNC_FILE"
    SUFFIX = ".sync-delay-ms"

    def set(self, name: str, delay_ms: int) -> None:
        self.write(name, int(delay_ms))
