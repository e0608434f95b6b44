"""A stop's cancel is never lost: no asyncio.wait_for in node/, dledger/, ha/ or the SDK (mqstore/).

Regression: a SIGTERM'd DLedger node logged "stopping" and never stopped (a full test run,
`test_restart_of_all_nodes[TERM]`). On Python 3.11, `asyncio.wait_for` returns the result of
an inner await that finished just as the task was cancelled, and the cancel is gone: a Raft
reader whose handshake read completed as `Transport.stop()` cancelled it went on serving the
connection, and stop() waited for it forever (the same for a connect, a drain, the HA
handshakes and LocalLog's flusher wait). `asyncio.timeout` keeps the cancel.
Method: the race made deterministic (the inner future completed and the task cancelled before
it runs again), then a scan of the packages' sources.
"""

from __future__ import annotations

import asyncio
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


async def _race(wrapped) -> str:
    inner = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(wrapped(inner))
    await asyncio.sleep(0)              # the task is waiting on `inner`
    inner.set_result("read done")       # the read finishes ...
    task.cancel()                       # ... as stop() cancels the task
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


def test_asyncio_timeout_keeps_a_cancel_that_races_a_finished_read():
    async def with_timeout(inner):
        async with asyncio.timeout(10):
            return await inner
    assert asyncio.run(_race(with_timeout)) == "cancelled"


def test_no_module_uses_asyncio_wait_for():
    offenders = [f"{p.relative_to(ROOT)}:{n}" for pkg in ("node", "dledger", "ha", "mqstore")
                 for p in sorted((ROOT / pkg).rglob("*.py"))
                 for n, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"asyncio\.wait_for\(|from asyncio import .*\bwait_for\b", line)
                 and not line.lstrip().startswith("#")]
    assert offenders == [], f"asyncio.wait_for can lose a stop's cancel on 3.11; use asyncio.timeout: {offenders}"
