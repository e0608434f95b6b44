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

import os

from tests.integration import shims

SHIM = "slowsync_shim.c"


def unavailable() -> str | None:
    """Why syncs cannot be slowed here (no C compiler, the shim does not build), or None."""
    return shims.unavailable(SHIM)


class SlowSync:
    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.library = shims.build(SHIM)
        self.delays: dict[str, int] = {}

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}.sync-delay-ms")

    def attach(self, name: str, proc) -> None:
        """Run `proc` (an mqstore.localcluster.Proc not started yet) under the shim as `name`."""
        if name not in self.delays:
            self.set(name, 0)
        proc.env = {**shims.preload(proc.env, self.library), "MQSTORE_SLOWSYNC_FILE": self._path(name)}

    def set(self, name: str, delay_ms: int) -> None:
        shims.write_setting(self._path(name), int(delay_ms))
        self.delays[name] = int(delay_ms)

    def reset(self) -> None:
        for name in list(self.delays):
            self.set(name, 0)
