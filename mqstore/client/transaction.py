"""The transactional producer: half message, local transaction, commit/rollback, check-back.

`send_message_in_transaction(msg, arg)` sends a half message (TRAN_MSG=true, PGROUP=group;
the broker keeps it in RMQ_SYS_TRANS_HALF_TOPIC, invisible to consumers), runs the
executor `execute(msg, arg) -> LocalTransactionState`, then commits or rolls back
(`POST /transactions/end`). UNKNOW (or an executor that raises) leaves the decision to
the check-back.

Check-back is a poll by the producer (HTTP gives the broker no way to call a client):
every `check_interval_s` the producer asks each broker group for its group's undecided
half messages stored more than `check_immunity_s` ago (`GET /transactions/pending`),
calls `checker(msg) -> LocalTransactionState`, and ends each decided one. The broker rolls
back a half message after 15 unanswered checks (transactionCheckMax).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, Callable

from mqstore.client.errors import MQClientError, MQConfigError
from mqstore.client.message import (PROPERTY_PRODUCER_GROUP, PROPERTY_TRANSACTION_PREPARED, LocalTransactionState,
                                    Message, MessageExt, TransactionSendResult)
from mqstore.client.producer import AsyncProducer

log = logging.getLogger(__name__)

MAX_CHECKS_PER_POLL = 256


class AsyncTransactionProducer(AsyncProducer):
    def __init__(self, group: str, *, executor: Callable[[Message, Any], Any],
                 checker: Callable[[MessageExt], Any], check_interval_s: float = 5.0,
                 check_immunity_s: float = 6.0, **kw: Any):
        super().__init__(group, **kw)
        if check_interval_s <= 0 or check_immunity_s < 0:
            raise MQConfigError("check_interval_s must be > 0 and check_immunity_s >= 0")
        self.executor = executor
        self.checker = checker
        self.check_interval_s = check_interval_s
        self.check_immunity_s = check_immunity_s
        self._check_task: asyncio.Task | None = None
        self.checks = 0                  # check-back calls made (metrics, tests)

    async def start(self) -> "AsyncTransactionProducer":
        await super().start()
        self._check_task = asyncio.create_task(self._check_loop())
        return self

    async def close(self) -> None:
        if self._check_task is not None:
            self._check_task.cancel()
            await asyncio.gather(self._check_task, return_exceptions=True)
            self._check_task = None
        await super().close()

    async def send_message_in_transaction(self, msg: Message, arg: Any = None) -> TransactionSendResult:
        if msg.delay_level:
            raise MQConfigError("a transactional message cannot be delayed")
        msg.properties[PROPERTY_TRANSACTION_PREPARED] = "true"
        msg.properties[PROPERTY_PRODUCER_GROUP] = self.group
        half = await self.send(msg)
        try:
            state = LocalTransactionState(await _call(self.executor, msg, arg))
        except Exception:  # noqa: BLE001 - an executor failure leaves the decision to the check-back
            log.exception("local transaction of %s raised; the check-back decides", half.msg_id)
            state = LocalTransactionState.UNKNOW
        if state is not LocalTransactionState.UNKNOW:
            try:
                await self.end_transaction(half.broker_name, half.offset_msg_id, state)
            except MQClientError as e:
                log.warning("ending transaction %s failed; the check-back decides: %s", half.msg_id, e)
        return TransactionSendResult(half, state)

    async def end_transaction(self, broker_name: str, offset_msg_id: str, state: LocalTransactionState) -> dict:
        action = {LocalTransactionState.COMMIT_MESSAGE: "COMMIT", LocalTransactionState.ROLLBACK_MESSAGE: "ROLLBACK"}
        return await self.transport.call(self.routes.group(broker_name), "POST", "/transactions/end",
                                         {"producer_group": self.group, "offset_msg_id": offset_msg_id,
                                          "action": action[state]})

    async def check_once(self) -> int:
        """One check-back round over every broker group; returns the messages decided."""
        decided = 0
        for name, g in sorted(self.routes.groups.items()):
            doc = await self.transport.call(g, "GET", "/transactions/pending",
                                            params={"producer_group": self.group, "max": MAX_CHECKS_PER_POLL,
                                                    "older_than_ms": int(self.check_immunity_s * 1000)})
            for raw in doc.get("messages", []):
                msg = MessageExt.from_wire(raw, name)
                self.checks += 1
                try:
                    state = LocalTransactionState(await _call(self.checker, msg))
                except Exception:  # noqa: BLE001 - a checker failure means "ask again later"
                    log.exception("transaction checker raised for %s", msg.msg_id)
                    continue
                if state is not LocalTransactionState.UNKNOW:
                    await self.end_transaction(name, msg.offset_msg_id, state)
                    decided += 1
        return decided

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval_s)
            try:
                await self.check_once()
            except MQClientError as e:
                log.info("transaction check-back round failed: %s", e)


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
