"""Next queue offset per (topic, queue_id): RocketMQ's CommitLog.topicQueueTable.

The log assigns each dispatched message the next offset of its queue under the
append lock, so offsets in a queue are dense and in commitlog order. Prepared and
rolled-back transaction messages take none (-1), exactly like RocketMQ.
The table is rebuilt at start from the recovered consume queues (LocalLog) or
from the whole log (a new DLedger leader) and loaded with `load`.
"""

from __future__ import annotations

from typing import Sequence

from node.store import layout as L
from node.store.message import MessageDraft

_TX_MASK = L.SYSFLAG_TRANSACTION_MASK
_TX_PREPARED = L.SYSFLAG_TRANSACTION_PREPARED_TYPE
_TX_ROLLBACK = L.SYSFLAG_TRANSACTION_ROLLBACK_TYPE

QueueKey = tuple[str, int]


class QueueOffsetTable:
    """(topic, queue_id) -> next queue offset to assign. Missing keys start at 0."""

    __slots__ = ("_next",)

    def __init__(self, initial: dict[QueueKey, int] | None = None):
        self._next: dict[QueueKey, int] = {}
        if initial:
            self.load(initial)

    def assign(self, draft: MessageDraft) -> int:
        """The queue offset for `draft`, advancing its queue; -1 (no advance) if not dispatched."""
        if not draft.is_dispatched:
            return -1
        key = (draft.topic, draft.queue_id)
        n = self._next.get(key, 0)
        self._next[key] = n + 1
        return n

    def get(self, topic: str, queue_id: int) -> int:
        return self._next.get((topic, queue_id), 0)

    def set(self, topic: str, queue_id: int, offset: int) -> None:
        assert offset >= 0, "queue offsets are never negative"
        self._next[(topic, queue_id)] = offset

    def snapshot(self) -> dict[QueueKey, int]:
        return dict(self._next)

    def load(self, table: dict[QueueKey, int]) -> None:
        """Replace the whole table (after consume-queue recovery)."""
        fresh: dict[QueueKey, int] = {}
        for (topic, queue_id), offset in table.items():
            assert offset >= 0, f"negative queue offset for {topic}/{queue_id}"
            fresh[(topic, queue_id)] = offset
        self._next = fresh

    def assign_batch(self, drafts: Sequence[MessageDraft]) -> list[int]:
        """`assign` for each draft in order, in one tight loop (the append hot path)."""
        nxt = self._next
        get = nxt.get
        out: list[int] = []
        add = out.append
        for d in drafts:
            tx = d.sys_flag & _TX_MASK
            if tx == _TX_PREPARED or tx == _TX_ROLLBACK:
                add(-1)
                continue
            key = (d.topic, d.queue_id)
            n = get(key, 0)
            nxt[key] = n + 1
            add(n)
        return out

    def rewind(self, drafts: Sequence[MessageDraft], offsets: Sequence[int]) -> None:
        """Undo `assign_batch` for a batch that was not written (ENOSPC): each queue goes
        back to the first offset the batch gave it."""
        assert len(drafts) == len(offsets)
        for d, offset in zip(reversed(drafts), reversed(offsets)):
            if offset >= 0:
                self._next[(d.topic, d.queue_id)] = offset

    def __len__(self) -> int:
        return len(self._next)
