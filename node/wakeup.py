"""`Wakeup`: many tasks wait for "something grew" on one shared future; `fire` wakes them all.

Memory does not grow with the number of waiters (one future per generation). Waits use
`asyncio.timeout`, not `wait_for`: Python 3.11's wait_for swallows a cancel that arrives in the
same loop turn as the completion, and a task being stopped then runs on (this hung nodes on
SIGTERM; tests/unit/test_ha_wait_cancel.py and test_dledger_log_wait.py are the regressions).
"""

from __future__ import annotations

import asyncio


class Wakeup:
    def __init__(self) -> None:
        self._fut: asyncio.Future | None = None

    def fire(self) -> None:
        fut, self._fut = self._fut, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def wait(self, timeout_s: float) -> None:
        """Return when fired or after `timeout_s`, whichever comes first; a cancel always surfaces."""
        if self._fut is None:
            self._fut = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                await asyncio.shield(self._fut)   # shielded: one waiter's cancel leaves the others waiting
        except TimeoutError:
            pass
