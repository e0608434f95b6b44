"""Consumer offset stores: on the broker (clustering) or in a local JSON file (broadcasting).

Both keep offsets in memory, updated as messages are consumed, and persist them every
`auto_commit_interval_s` (5 s), on `commit()`, when a queue moves to another consumer, and
on close. The local file is `<base_dir>/<client_id>/<group>/offsets.json` (RocketMQ's
LocalFileOffsetStore layout), written to a temp file and renamed.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any

from mqstore.client.errors import MQClientError
from mqstore.client.message import MessageQueue
from mqstore.client.route import RouteTable
from mqstore.client.transport import Transport

log = logging.getLogger(__name__)


class RemoteOffsetStore:
    """Offsets committed to the broker. A commit answers its put status: on a SYNC_MASTER whose
    slave did not confirm it (SLAVE_NOT_AVAILABLE, FLUSH_SLAVE_TIMEOUT) the master stored it
    but a failover may bring back an older offset, and the messages after that one are
    delivered again. Such queues are kept in `unconfirmed` (queue -> status) until a later
    commit of theirs is confirmed, with one warning per queue and status."""

    def __init__(self, transport: Transport, routes: RouteTable, group: str):
        self.transport = transport
        self.routes = routes
        self.group = group
        self.table: dict[MessageQueue, int] = {}
        self._persisted: dict[MessageQueue, int] = {}
        self.unconfirmed: dict[MessageQueue, str] = {}

    def update(self, mq: MessageQueue, offset: int) -> None:
        self.table[mq] = offset

    async def read(self, mq: MessageQueue) -> int | None:
        """The broker's committed offset for the queue, or None if the group has none."""
        g = self.routes.group(mq.broker_name)
        doc = await self.transport.call(g, "GET", f"/groups/{self.group}/offsets", params={"topic": mq.topic})
        for row in doc.get("offsets", []):
            if int(row["queue_id"]) == mq.queue_id:
                self._persisted[mq] = int(row["offset"])
                return int(row["offset"])
        return None

    async def persist(self, queues: Any = None) -> int:
        """Commit changed offsets to the broker; returns how many were written."""
        n = 0
        for mq in list(self.table if queues is None else queues):
            off = self.table.get(mq)
            if off is None or self._persisted.get(mq) == off:
                continue
            g = self.routes.group(mq.broker_name)
            doc = await self.transport.call(g, "POST", f"/groups/{self.group}/offsets",
                                            {"topic": mq.topic, "queue_id": mq.queue_id, "offset": off})
            self._persisted[mq] = off
            self._note_status(mq, off, doc.get("status", "SEND_OK"))
            n += 1
        return n

    def _note_status(self, mq: MessageQueue, offset: int, status: str) -> None:
        if status == "SEND_OK":
            self.unconfirmed.pop(mq, None)
            return
        if self.unconfirmed.get(mq) != status:
            log.warning("offset %d of %s committed to the master of %s but not confirmed by a slave (%s): a "
                        "failover may bring back an older offset and deliver the messages after it again",
                        offset, mq, mq.broker_name, status)
        self.unconfirmed[mq] = status

    def remove(self, mq: MessageQueue) -> None:
        self.table.pop(mq, None)
        self._persisted.pop(mq, None)
        self.unconfirmed.pop(mq, None)


class LocalFileOffsetStore:
    def __init__(self, base_dir: str, client_id: str, group: str, aliases: dict[str, str] | None = None):
        safe = client_id.replace(os.sep, "_")
        self.path = os.path.join(base_dir, safe, group, "offsets.json")
        self.table: dict[MessageQueue, int] = {}
        self.aliases = {} if aliases is None else aliases   # RouteTable.aliases, filled as groups are named
        self._loaded = self._load()

    def _load(self) -> dict[MessageQueue, int]:
        try:
            with open(self.path, encoding="utf-8") as f:
                doc = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise MQClientError(f"offset file {self.path} is unreadable: {e}") from None
        out = {}
        for row in doc.get("offsets", []):
            out[MessageQueue(row["topic"], row["broker_name"], int(row["queue_id"]))] = int(row["offset"])
        return out

    def update(self, mq: MessageQueue, offset: int) -> None:
        self.table[mq] = offset

    async def read(self, mq: MessageQueue) -> int | None:
        got = self.table.get(mq, self._loaded.get(mq))
        if got is None:
            # A row written under the name the group had before its nodes named it: it moves
            # to the group's name (and the file keeps only that once persisted).
            for old in [o for o, new in self.aliases.items() if new == mq.broker_name]:
                got = self._loaded.pop(MessageQueue(mq.topic, old, mq.queue_id), None)
                if got is not None:
                    self._loaded[mq] = got
                    break
        return got

    async def persist(self, queues: Any = None) -> int:
        merged = {**self._loaded, **self.table}
        doc = {"offsets": [{"topic": q.topic, "broker_name": q.broker_name, "queue_id": q.queue_id, "offset": o}
                           for q, o in sorted(merged.items())]}
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".offsets.")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError:
            os.unlink(tmp)
            raise
        self._loaded = merged
        return len(doc["offsets"])

    def remove(self, mq: MessageQueue) -> None:
        pass   # broadcasting keeps every queue's offset
