"""Leader fence: before a leader acts on state derived from the log, it proves it has all of it.

The delay service's progress and the transaction service's decided set are rebuilt from
consume queues. A node that has just become leader (or restarted) may not yet have
dispatched every committed record of the previous term. `LeaderFence.ensure()` appends a
small record in the current term and waits until the dispatcher has passed it: every
record committed before it is then in the consume queues (Raft commits in log order).
The fence is per (role, term); a new term or a role change asks for a new fence.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgpack

from node.store.errors import NotLeader, StoreError
from node.store.message import MessageDraft

SYS_FENCE = "RMQ_SYS_FENCE"
WRITABLE_ROLES = frozenset({"LEADER", "MASTER", "STANDALONE"})
FENCE_TIMEOUT_S = 10.0
FENCE_POLL_S = 0.01


class FenceTimeout(StoreError):
    code = "SYSTEM_BUSY"
    retriable = True
    http_status = 503


class LeaderFence:
    def __init__(self, broker: Any):
        self.broker = broker
        self._fenced: tuple | None = None
        self._lock = asyncio.Lock()

    def key(self) -> tuple:
        rlog = self.broker.log
        return (rlog.role(), rlog.status().get("term"))

    def writable(self) -> bool:
        return self.broker.log.role() in WRITABLE_ROLES

    @property
    def fenced_key(self) -> tuple | None:
        return self._fenced

    async def ensure(self) -> tuple:
        """Return the fence key once this node's consume queues hold everything committed before now."""
        key = self.key()
        if key[0] not in WRITABLE_ROLES:
            raise NotLeader(leader=self.broker.log.leader())
        if self._fenced == key:
            return key
        async with self._lock:
            if self._fenced == key:
                return key
            b = self.broker
            draft = MessageDraft(topic=SYS_FENCE, queue_id=0, body=msgpack.packb({"node": b.config.node_id}),
                                 properties={}, born_timestamp=int(time.time() * 1000)).seal()
            (result,) = await b.log.append([draft])
            if result.status.value != "SEND_OK":
                raise FenceTimeout(f"fence record not acknowledged ({result.status.value}); retry")
            deadline = time.monotonic() + FENCE_TIMEOUT_S
            while b.dispatcher.position <= result.physical_offset:
                if time.monotonic() > deadline:
                    raise FenceTimeout(f"fence record not dispatched within {FENCE_TIMEOUT_S}s; retry")
                await asyncio.sleep(FENCE_POLL_S)
            self._fenced = key
            return key
