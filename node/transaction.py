"""Transactions: half messages, commit/rollback records, and check-back by polling.

RocketMQ's TransactionalMessageService, over HTTP:
- A message sent with TRAN_MSG=true and PGROUP=<producer group> is stored as a *half
  message* in RMQ_SYS_TRANS_HALF_TOPIC queue 0, its real topic/queue in REAL_TOPIC/REAL_QID
  (`to_half`); consumers cannot see it.
- `end(COMMIT)` appends the real message AND an op record (RMQ_SYS_TRANS_OP_HALF_TOPIC
  queue 0, body = the half message's queue offset, tag "d") in one log append;
  `end(ROLLBACK)` appends the op record only. A half message with an op record is decided.
- Check-back: the broker cannot call a client over HTTP, so the producer polls
  `pending(group, older_than_ms)` for undecided half messages older than N ms, asks its
  checker, and ends each one. After TRANSACTION_CHECK_MAX checks an undecided message is
  rolled back (RocketMQ's transactionCheckMax, 15).
The decided set is derived from the op queue (so every replica agrees); a new leader fences
first (node/fence.py) so its op queue holds every committed decision before it decides.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from node.store import message as M
from node.store.errors import InvalidMessage, StoreError
from node.store.message import MessageDraft, StoredMessage

log = logging.getLogger(__name__)

HALF_TOPIC = "RMQ_SYS_TRANS_HALF_TOPIC"
OP_TOPIC = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
OP_TAG = "d"
COMMIT = "COMMIT"
ROLLBACK = "ROLLBACK"
TRANSACTION_CHECK_MAX = 15
MAX_PENDING_SCAN_UNITS = 10_000     # units of the half queue one pending() call looks at
MAX_PENDING_RESULTS = 256
MAX_OP_SCAN_UNITS = 100_000         # op records one refresh reads
_DROP_ON_COMMIT = (M.PROPERTY_TRANSACTION_PREPARED, M.PROPERTY_REAL_TOPIC, M.PROPERTY_REAL_QUEUE_ID)


def to_half(topic: str, queue_id: int, props: dict[str, str]) -> tuple[str, int, dict[str, str]]:
    out = dict(props)
    out[M.PROPERTY_REAL_TOPIC] = topic
    out[M.PROPERTY_REAL_QUEUE_ID] = str(queue_id)
    return HALF_TOPIC, 0, out


class TransactionService:
    def __init__(self, broker: Any, fence: Any):
        self.broker = broker
        self.fence = fence
        self.done: set[int] = set()         # decided half-queue offsets at or above `floor`
        self.floor = 0                      # every half offset below it is decided (or expired)
        self.op_next = 0                    # next op-queue offset to read
        self.checks: dict[int, int] = {}    # half offset -> times handed out for check-back
        self._fenced_for: tuple | None = None
        self._lock = asyncio.Lock()

    async def _prepare(self) -> None:
        key = await self.fence.ensure()
        if self._fenced_for != key:
            self.checks.clear()             # check counts are this leader's own
            self._fenced_for = key
        self._refresh()

    def _refresh(self) -> None:
        b = self.broker
        op = b.cq_store.get(OP_TOPIC, 0)
        if op is not None:
            self.op_next = max(self.op_next, op.min_offset)
            end = min(op.max_offset, self.op_next + MAX_OP_SCAN_UNITS)
            while self.op_next < end:
                units = op.get_range(self.op_next, min(1024, end - self.op_next))
                if not units:
                    break
                for phys, size, _code in units:
                    msg = b._read_unit(phys, size)
                    if msg is not None and msg.body.isdigit():
                        q = int(msg.body)
                        if q >= self.floor:
                            self.done.add(q)
                self.op_next += len(units)
        half = b.cq_store.get(HALF_TOPIC, 0)
        if half is not None:
            self.floor = max(self.floor, half.min_offset)
            while self.floor < half.max_offset and self.floor in self.done:
                self.done.discard(self.floor)
                self.checks.pop(self.floor, None)
                self.floor += 1

    def _half(self, offset_msg_id: Any) -> StoredMessage:
        from node.store.errors import BadRequest, MessageNotFound
        if not isinstance(offset_msg_id, str):
            raise BadRequest("offset_msg_id must be a string")
        try:
            _ip, _port, phys = M.decode_offset_msg_id(offset_msg_id)
        except InvalidMessage as e:
            raise BadRequest(str(e)) from None
        msg = self.broker._read_at(phys)
        if msg is None or msg.topic != HALF_TOPIC:
            raise MessageNotFound(f"no half message with offsetMsgId {offset_msg_id} on this node")
        return msg

    async def end(self, producer_group: Any, offset_msg_id: Any, action: Any) -> dict[str, Any]:
        from node.broker import check_group
        from node.store.errors import BadRequest
        group = check_group(producer_group)
        if action not in (COMMIT, ROLLBACK):
            raise BadRequest(f"action must be {COMMIT} or {ROLLBACK}, got {action!r}")
        async with self._lock:
            await self._prepare()
            half = self._half(offset_msg_id)
            if half.properties.get(M.PROPERTY_PRODUCER_GROUP) != group:
                raise BadRequest(f"half message {offset_msg_id} belongs to producer group "
                                 f"{half.properties.get(M.PROPERTY_PRODUCER_GROUP)!r}, not {group!r}")
            return await self._decide(half, action)

    async def _decide(self, half: StoredMessage, action: str) -> dict[str, Any]:
        b = self.broker
        qoff = half.queue_offset
        if qoff < self.floor or qoff in self.done:
            return {"status": "ALREADY_DECIDED", "queue_offset": qoff}
        drafts = []
        if action == COMMIT:
            props = {k: v for k, v in half.properties.items() if k not in _DROP_ON_COMMIT}
            drafts.append(MessageDraft(topic=half.properties[M.PROPERTY_REAL_TOPIC],
                                       queue_id=int(half.properties[M.PROPERTY_REAL_QUEUE_ID]), body=half.body,
                                       properties=props, born_timestamp=half.born_timestamp
                                       ).seal(b.config.max_message_size))
        drafts.append(MessageDraft(topic=OP_TOPIC, queue_id=0, body=str(qoff).encode(),
                                   properties={M.PROPERTY_TAGS: OP_TAG, "ACTION": action},
                                   born_timestamp=b.clock_ms()).seal())
        results = await b.log.append(drafts)
        self.done.add(qoff)
        self.checks.pop(qoff, None)
        out: dict[str, Any] = {"status": "COMMITTED" if action == COMMIT else "ROLLED_BACK", "queue_offset": qoff}
        if action == COMMIT:
            r, d = results[0], drafts[0]
            out["result"] = {"status": r.status.value, "msg_id": half.msg_id,
                             "offset_msg_id": M.encode_offset_msg_id(b._store_ip, b.config.listen_port,
                                                                     r.physical_offset),
                             "queue_id": d.queue_id, "queue_offset": r.queue_offset}
        return out

    async def pending(self, producer_group: Any, older_than_ms: Any, max_n: Any) -> list[StoredMessage]:
        """Undecided half messages of the group stored at least `older_than_ms` ago."""
        from node.broker import check_group, check_int
        group = check_group(producer_group)
        age = check_int("older_than_ms", older_than_ms, 0, 1 << 40)
        n = check_int("max", max_n, 1, MAX_PENDING_RESULTS)
        async with self._lock:
            await self._prepare()
            half = self.broker.cq_store.get(HALF_TOPIC, 0)
            if half is None:
                return []
            cutoff = self.broker.clock_ms() - age
            out: list[StoredMessage] = []
            expired: list[StoredMessage] = []
            offset, end = self.floor, min(half.max_offset, self.floor + MAX_PENDING_SCAN_UNITS)
            while offset < end and len(out) < n:
                units = half.get_range(offset, min(256, end - offset))
                if not units:
                    break
                for i, (phys, size, _code) in enumerate(units):
                    q = offset + i
                    if q in self.done or len(out) >= n:
                        continue
                    msg = self.broker._read_unit(phys, size)
                    if msg is None or msg.store_timestamp > cutoff:
                        continue
                    if msg.properties.get(M.PROPERTY_PRODUCER_GROUP) != group:
                        continue
                    self.checks[q] = self.checks.get(q, 0) + 1
                    if self.checks[q] > TRANSACTION_CHECK_MAX:
                        expired.append(msg)
                    else:
                        out.append(msg)
                offset += len(units)
            for msg in expired:
                log.warning("transaction: half message %s unchecked after %d checks; rolled back",
                            msg.offset_msg_id, TRANSACTION_CHECK_MAX)
                try:
                    await self._decide(msg, ROLLBACK)
                except StoreError as e:
                    log.info("transaction: rollback of an expired half message failed: %s", e)
            return out
