"""Delay messages by level: RocketMQ's ScheduleMessageService, with its progress in the log.

Send: a message whose DELAY property names level n > 0 is stored in SCHEDULE_TOPIC_XXXX,
queue n-1, with its real topic and queue in REAL_TOPIC / REAL_QID (`to_schedule`). The
dispatcher writes its delivery time (store time + delay of level n) as the unit's tag code.

Delivery: on the node that accepts writes, `ScheduleService.run` walks each level's queue
from its progress offset. Units whose delivery time has come are read, turned back into
messages of their real topic, and appended in ONE log append together with a progress
record (RMQ_SYS_SCHEDULE_OFFSET queue 0, msgpack `{"offsets": {level: next_offset}}`).
Messages and progress therefore commit together. After a restart or a failover the new
writer fences (node/fence.py), then reads the last progress record from the consume queue:
(ours) RocketMQ keeps delayOffset.json on each broker's disk, which a DLedger failover loses.
An append that failed or timed out makes the service re-read progress from the log, so a
message may be delivered twice after a failover but is never lost (at-least-once).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Sequence

import msgpack

from node.store import message as M
from node.store.dispatcher import SCHEDULE_TOPIC
from node.store.errors import InvalidMessage, StoreError
from node.store.message import MessageDraft, StoredMessage

log = logging.getLogger(__name__)

SYS_SCHEDULE_OFFSET = "RMQ_SYS_SCHEDULE_OFFSET"
TICK_S = 0.1                 # how often due messages are looked for
BATCH_UNITS = 64             # at most this many messages per level per append
ERROR_BACKOFF_S = 0.5
_DROP_ON_DELIVERY = (M.PROPERTY_DELAY_TIME_LEVEL, M.PROPERTY_REAL_TOPIC, M.PROPERTY_REAL_QUEUE_ID)


def clamp_level(level: int, levels: int) -> int:
    """RocketMQ clamps a level above the table to its last level."""
    return min(level, levels)


def to_schedule(topic: str, queue_id: int, props: dict[str, str], level: int) -> tuple[str, int, dict[str, str]]:
    """Where a message delayed by `level` is stored: the level's schedule queue."""
    assert level >= 1
    out = dict(props)
    out[M.PROPERTY_DELAY_TIME_LEVEL] = str(level)
    out[M.PROPERTY_REAL_TOPIC] = topic
    out[M.PROPERTY_REAL_QUEUE_ID] = str(queue_id)
    return SCHEDULE_TOPIC, level - 1, out


def real_draft(msg: StoredMessage, max_body: int) -> MessageDraft | None:
    """The message a schedule-queue record stands for, ready to append to its real topic."""
    props = msg.properties
    topic, qid = props.get(M.PROPERTY_REAL_TOPIC), props.get(M.PROPERTY_REAL_QUEUE_ID)
    if not topic or qid is None or not qid.isdigit():
        log.error("schedule: record at %d names no real topic/queue; skipped", msg.physical_offset)
        return None
    clean = {k: v for k, v in props.items() if k not in _DROP_ON_DELIVERY}
    return MessageDraft(topic=topic, queue_id=int(qid), body=msg.body, properties=clean, flag=msg.flag,
                        born_timestamp=msg.born_timestamp,
                        reconsume_times=msg.reconsume_times).seal(max_body)


class ScheduleService:
    def __init__(self, broker: Any, fence: Any, levels_ms: Sequence[int]):
        assert levels_ms, "at least one delay level"
        self.broker = broker
        self.fence = fence
        self.levels_ms = tuple(levels_ms)
        self.progress: dict[int, int] = {}        # level -> next schedule-queue offset to deliver
        self._loaded_for: tuple | None = None     # fence key the progress was loaded under
        self.delivered = 0                        # metrics

    @property
    def levels(self) -> int:
        return len(self.levels_ms)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            if not self.broker.ready or not self.fence.writable():
                self._loaded_for = None
                continue
            try:
                await self.tick()
            except StoreError as e:
                log.info("schedule: delivery paused: %s", e)
                self._loaded_for = None
                await asyncio.sleep(ERROR_BACKOFF_S)

    async def tick(self) -> int:
        """Deliver what is due on every level; returns messages delivered."""
        if not self._pending():
            return 0      # nothing scheduled: no fence record is written on nodes that never delay
        key = await self.fence.ensure()
        if self._loaded_for != key:
            self.progress = self.load_progress()
            self._loaded_for = key
        now = self.broker.clock_ms()
        n = 0
        for level in range(1, self.levels + 1):
            n += await self._deliver_level(level, now)
        return n

    def _pending(self) -> bool:
        """Whether any level's queue may hold undelivered units (all of them, before progress is loaded)."""
        loaded = self._loaded_for is not None
        for level in range(1, self.levels + 1):
            cq = self.broker.cq_store.get(SCHEDULE_TOPIC, level - 1)
            if cq is None:
                continue
            start = max(self.progress.get(level, 0), cq.min_offset) if loaded else cq.min_offset
            if cq.max_offset > start:
                return True
        return False

    def load_progress(self) -> dict[int, int]:
        """The offsets in the last progress record of the log (empty if there is none)."""
        cq = self.broker.cq_store.get(SYS_SCHEDULE_OFFSET, 0)
        if cq is None or cq.max_offset <= cq.min_offset:
            return {}
        unit = cq.get(cq.max_offset - 1)
        msg = self.broker._read_unit(unit[0], unit[1]) if unit is not None else None
        if msg is None:
            return {}
        try:
            rec = msgpack.unpackb(msg.body, raw=False, strict_map_key=False)
            return {int(k): int(v) for k, v in rec["offsets"].items()}
        except (ValueError, KeyError, TypeError, AttributeError, msgpack.ExtraData, msgpack.FormatError):
            log.error("schedule: unreadable progress record at %d; starting from the queues' heads",
                      msg.physical_offset)
            return {}

    async def _deliver_level(self, level: int, now: int) -> int:
        b = self.broker
        cq = b.cq_store.get(SCHEDULE_TOPIC, level - 1)
        if cq is None:
            return 0
        start = max(self.progress.get(level, 0), cq.min_offset)
        if start >= cq.max_offset:
            return 0
        drafts: list[MessageDraft] = []
        offset = start
        for phys, size, due_ms in cq.get_range(start, BATCH_UNITS):
            if due_ms > now:
                break
            offset += 1
            msg = b._read_unit(phys, size)
            if msg is None:
                continue          # expired from the log meanwhile
            try:
                d = real_draft(msg, b.config.max_message_size)
            except InvalidMessage as e:     # e.g. maxMessageSize lowered since: skip it, do not wedge the level
                log.error("schedule: record at %d cannot be delivered: %s; skipped", phys, e)
                continue
            if d is not None:
                drafts.append(d)
        if offset == start:
            return 0
        progress = dict(self.progress)
        progress[level] = offset
        drafts.append(MessageDraft(topic=SYS_SCHEDULE_OFFSET, queue_id=0,
                                   body=msgpack.packb({"offsets": progress}), properties={},
                                   born_timestamp=now).seal())
        results = await b.log.append(drafts)
        if any(r.status.value != "SEND_OK" for r in results):
            # Appended but not known to be durable/committed: re-read progress from the log.
            self._loaded_for = None
            return 0
        self.progress = progress
        self.delivered += len(drafts) - 1
        return len(drafts) - 1


def parse_level(value: str | None) -> int:
    """The DELAY property as a level; 0 (no delay) when absent or not positive."""
    if not value:
        return 0
    try:
        return max(0, int(value))
    except ValueError:
        return -1
