"""Shared-future waits under cancellation: `node.wakeup.Wakeup.wait` (HALog's SYNC_MASTER ack
waiters, the slave's wait for growth) and LocalLog's `_wait_growth` (disk-full back-pressure).

Regression: both waited with `asyncio.wait_for(asyncio.shield(fut), t)`. In Python 3.11
wait_for returns the inner result when the future completes in the same loop turn as a
cancel, swallowing the cancellation, so a task being stopped ran on (the same fault hung
DLedger nodes on SIGTERM; see tests/unit/test_dledger_log_wait.py). Method: resolve the
shared future, then cancel the waiter, in one turn; the cancel must surface.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from node.local_log import LocalLog
from node.wakeup import Wakeup


def test_signal_cancel_racing_fire_is_not_swallowed():
    async def scenario():
        sig = Wakeup()
        waiter = asyncio.create_task(sig.wait(5.0))
        await asyncio.sleep(0)        # the waiter blocks on the shared future
        sig.fire()                    # the future resolves ...
        waiter.cancel()               # ... and the stop cancels in the same turn
        with pytest.raises(asyncio.CancelledError):
            await waiter
    asyncio.run(scenario())


def test_signal_wakes_every_waiter_or_times_out():
    async def scenario():
        sig = Wakeup()
        waiters = [asyncio.create_task(sig.wait(5.0)) for _ in range(3)]
        await asyncio.sleep(0)
        sig.fire()
        await asyncio.wait_for(asyncio.gather(*waiters), 1.0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await sig.wait(0.05)                      # nothing fires: returns at the deadline
        assert 0.04 <= loop.time() - t0 < 1.0
        await sig.wait(-1.0)                      # a past deadline returns at once
        # One waiter cancelled does not cancel the shared future for the others.
        a, b = asyncio.create_task(sig.wait(5.0)), asyncio.create_task(sig.wait(5.0))
        await asyncio.sleep(0)
        a.cancel()
        await asyncio.sleep(0)
        sig.fire()
        await asyncio.wait_for(b, 1.0)
        assert a.cancelled()
    asyncio.run(scenario())


def _local_stub() -> SimpleNamespace:
    return SimpleNamespace(_grown=Wakeup(), _committed=0)


def test_local_log_wait_growth_cancel_racing_growth_is_not_swallowed():
    async def scenario():
        log = _local_stub()
        waiter = asyncio.create_task(LocalLog._wait_growth(log, 5.0))
        await asyncio.sleep(0)
        LocalLog._set_committed(log, 100)        # committed grows: the shared future resolves ...
        waiter.cancel()                           # ... and the cancel arrives in the same turn
        with pytest.raises(asyncio.CancelledError):
            await waiter
    asyncio.run(scenario())


def test_local_log_wait_growth_returns_on_growth_or_deadline():
    async def scenario():
        log = _local_stub()
        waiter = asyncio.create_task(LocalLog._wait_growth(log, 5.0))
        await asyncio.sleep(0)
        LocalLog._set_committed(log, 100)
        await asyncio.wait_for(waiter, 1.0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await LocalLog._wait_growth(log, 0.05)
        assert 0.04 <= loop.time() - t0 < 1.0
    asyncio.run(scenario())
