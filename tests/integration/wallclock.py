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

import time

from tests.integration import shims


def unavailable() -> str | None:
    """Why steps cannot be made here (no C compiler, the shim does not build), or None."""
    return shims.unavailable(WallClock.SOURCE)


class WallClock(shims.SettingShim):
    """Each process's offset from the real wall clock, in seconds (the file holds nanoseconds)."""

    SOURCE = "wallclock_shim.c"
    ENV = "MQSTORE_WALLCLOCK_FILE"
    SUFFIX = ".offset"

    def offset(self, name: str) -> float:
        return self.settings.get(name, 0) / 1e9

    def set(self, name: str, offset_s: float) -> None:
        self.write(name, int(offset_s * 1e9))

    def step(self, name: str, by_s: float, settle_s: float = 0.05) -> None:
        """Move `name`'s wall clock by `by_s` seconds (either way) from its current offset."""
        self.set(name, self.offset(name) + by_s)
        time.sleep(settle_s)      # the shim looks at the file at most every 20 ms
