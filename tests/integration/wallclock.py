"""Wall-clock steps for real node processes (wallclock_shim.c, loaded with LD_PRELOAD).

    clock = WallClock(dir)            # builds the shim once per test session
    clock.attach("n0", proc)
    clock.step("n0", +7200)           # n0's time.time() is two hours ahead from now on

Each process named gets a file of its own holding its offset; a step rewrites it atomically
and the process sees it within ~20 ms. Only CLOCK_REALTIME moves: monotonic clocks (Raft
ticks, leases, timeouts) and the kernel's own stamps (file mtimes) do not, as with a real
NTP step. Needs a C compiler (`cc`); without one `WallClock` raises with that reason.
"""

from __future__ import annotations

import os
import time

from tests.integration import shims

SHIM = "wallclock_shim.c"


def unavailable() -> str | None:
    """Why steps cannot be made here (no C compiler, the shim does not build), or None."""
    return shims.unavailable(SHIM)


class WallClock:
    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.library = shims.build(SHIM)
        self.offsets: dict[str, float] = {}

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}.offset")

    def env(self, name: str) -> dict[str, str]:
        """Environment for process `name` (its offset starts at 0)."""
        if name not in self.offsets:
            self.set(name, 0.0)
        return {"LD_PRELOAD": self.library, "MQSTORE_WALLCLOCK_FILE": self._path(name)}

    def attach(self, name: str, proc) -> None:
        """Run `proc` (an mqstore.localcluster.Proc not started yet) under the shim as `name`."""
        env = self.env(name)
        proc.env = {**shims.preload(proc.env, env.pop("LD_PRELOAD")), **env}

    def set(self, name: str, offset_s: float) -> None:
        shims.write_setting(self._path(name), int(offset_s * 1e9))
        self.offsets[name] = offset_s

    def reset(self) -> None:
        """Every process back to the real wall clock."""
        for name in list(self.offsets):
            self.set(name, 0.0)

    def step(self, name: str, by_s: float, settle_s: float = 0.05) -> None:
        """Move `name`'s wall clock by `by_s` seconds (either way) from its current offset."""
        self.set(name, self.offsets.get(name, 0.0) + by_s)
        time.sleep(settle_s)      # the shim looks at the file at most every 20 ms
