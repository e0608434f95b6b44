"""DLedgerLog.wait_committed under cancellation (the dispatcher's wait for new commits).

Regression: a node stopping under write load hung in SIGTERM: the broker cancels the
dispatcher task, but Python 3.11's asyncio.wait_for returns the inner result when the
awaited event fires in the same loop turn as the cancel, swallowing the cancellation;
the dispatcher loop then ran on and the stop waited forever. Found by
tests/integration/test_dledger_processes.py (restart of all nodes, SIGTERM variant).
Method: a DLedgerLog over a stand-in node; fire the commit event, then cancel, in one turn.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dledger.dledger_log import DLedgerLog


def make_log() -> DLedgerLog:
    node = SimpleNamespace(store=None, raft_config=SimpleNamespace(max_batch_entries=64), listener=None)
    return DLedgerLog(node, {"n0": "127.0.0.1:1"})


def commit_grows(log: DLedgerLog, to_position: int) -> None:
    """What _apply_commits does to waiters: new position, fire the event, arm a fresh one."""
    log._committed_pos = to_position
    log._commit_changed.set()
    log._commit_changed = asyncio.Event()


def test_cancel_racing_a_commit_is_not_swallowed():
    async def scenario():
        log = make_log()
        waiter = asyncio.create_task(log.wait_committed(0, 5.0))
        await asyncio.sleep(0)            # the waiter blocks on the commit event
        commit_grows(log, 100)            # the event fires ...
        waiter.cancel()                   # ... and the stop cancels in the same turn
        with pytest.raises(asyncio.CancelledError):
            await waiter
    asyncio.run(scenario())


def test_wait_returns_the_new_position_or_times_out():
    async def scenario():
        log = make_log()
        waiter = asyncio.create_task(log.wait_committed(0, 5.0))
        await asyncio.sleep(0)
        commit_grows(log, 100)
        assert await waiter == 100
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await log.wait_committed(100, 0.05) == 100     # nothing new: returns at the deadline
        assert 0.04 <= loop.time() - t0 < 1.0
    asyncio.run(scenario())
