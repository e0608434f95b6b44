"""How late the running event loop gets while a block of a test runs.

    async with LoopLag() as lag:
        ...
    assert lag.worst_s < 0.2

A task sleeps `period_s` again and again; `worst_s` is the most any of its wake-ups came
past the period: a call that blocks the loop shows up there whole."""

from __future__ import annotations

import asyncio


class LoopLag:
    def __init__(self, period_s: float = 0.005):
        self.period_s = period_s
        self.worst_s = 0.0
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "LoopLag":
        self._task = asyncio.create_task(self._probe())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._task is not None
        await self._task

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            t = loop.time()
            await asyncio.sleep(self.period_s)
            self.worst_s = max(self.worst_s, loop.time() - t - self.period_s)
