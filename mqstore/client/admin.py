"""Admin operations: topics, consumer offsets and members, message lookup, the DLQ."""

from __future__ import annotations

from typing import Any

from mqstore.client.consumer import _Client
from mqstore.client.errors import MQBrokerError
from mqstore.client.message import (DLQ_PREFIX, PROPERTY_RETRY_TOPIC, Message, MessageExt,
                                    MessageQueue, PullStatus, SendResult)
from mqstore.client.producer import AsyncProducer

MAX_DLQ_LIST = 10_000
# Set by the broker on the way to the DLQ, or carried in fields of their own; UNIQ_KEY stays.
_BROKER_PROPERTIES = frozenset({"DELAY", "REAL_TOPIC", "REAL_QID", PROPERTY_RETRY_TOPIC, "ORIGIN_MESSAGE_ID",
                                "TRAN_MSG", "PGROUP", "TAGS", "KEYS", "RECONSUME_TIME", "WAIT"})


class AsyncAdmin(_Client):
    def __init__(self, *, brokers: Any = None, controller: Any = None, request_timeout_s: float = 5.0):
        super().__init__(brokers, controller, request_timeout_s)
        self._brokers, self._controller = brokers, controller

    async def create_topic(self, topic: str, queues: int = 4, broker_name: str | None = None) -> list[dict]:
        """Create (or update) the topic on every broker group (or one)."""
        out = []
        for name, g in sorted(self.routes.groups.items()):
            if broker_name is None or name == broker_name:
                out.append(await self.transport.call(g, "POST", "/topics", {"topic": topic, "queues": queues}))
        self.routes.invalidate(topic)
        return out

    async def topic_status(self, topic: str) -> dict[str, dict]:
        return {name: await self.transport.call(g, "GET", f"/topics/{topic}")
                for name, g in sorted(self.routes.groups.items())}

    async def consumer_offsets(self, group: str, topic: str | None = None) -> dict[MessageQueue, int]:
        out = {}
        for name, g in sorted(self.routes.groups.items()):
            doc = await self.transport.call(g, "GET", f"/groups/{group}/offsets", params={"topic": topic})
            for row in doc.get("offsets", []):
                out[MessageQueue(row["topic"], name, int(row["queue_id"]))] = int(row["offset"])
        return out

    async def group_members(self, group: str) -> dict[str, list[dict]]:
        return {name: (await self.transport.call(g, "GET", f"/groups/{group}/members"))["members"]
                for name, g in sorted(self.routes.groups.items())}

    async def query_message(self, broker_name: str, offset_msg_id: str) -> MessageExt:
        doc = await self.transport.call(self.routes.group(broker_name), "GET", f"/messages/{offset_msg_id}")
        return MessageExt.from_wire(doc, broker_name)

    async def list_dlq(self, group: str, max_messages: int = 1000) -> list[MessageExt]:
        """Messages in %DLQ%<group>, oldest first (every queue, from its min offset)."""
        topic = DLQ_PREFIX + group
        out: list[MessageExt] = []
        try:
            queues = await self.fetch_queues(topic)
        except MQBrokerError as e:
            if e.code == "TOPIC_NOT_EXIST":
                return []
            raise
        limit = min(max_messages, MAX_DLQ_LIST)
        for mq in queues:
            offset = (await self.queue_bounds(mq))[0]
            while len(out) < limit:
                r = await self.pull(mq, offset, min(32, limit - len(out)))
                if r.status is PullStatus.OFFSET_ILLEGAL and r.next_offset != offset:
                    offset = r.next_offset
                    continue
                if r.status is not PullStatus.FOUND:
                    break
                out.extend(r.messages)
                offset = r.next_offset
        return out

    async def resend_dlq(self, msg: MessageExt, topic: str | None = None) -> SendResult:
        """Send a DLQ message again to its original topic (RETRY_TOPIC), keeping its msg_id."""
        target = topic or msg.properties.get(PROPERTY_RETRY_TOPIC) or msg.topic
        props = {k: v for k, v in msg.properties.items() if k not in _BROKER_PROPERTIES}
        async with AsyncProducer("MQSTORE_ADMIN", brokers=self._brokers, controller=self._controller) as p:
            return await p.send(Message(target, msg.body, tags=msg.tags, keys=msg.keys, properties=props))
