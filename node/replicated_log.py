"""The seam between the broker and replication: `ReplicatedLog`.

The broker writes and reads messages through this interface and nothing else.
Three implementations:

- `node.local_log.LocalLog`      standalone: committed = written (and flushed per flush policy)
- `ha.ha_log.HALog`              classic master/slave: committed per SYNC/ASYNC_MASTER rule
- `dledger.dledger_log.DLedgerLog`  Raft: committed = stored on a majority

Two offset spaces meet here:
- a *log position* is where the log's own unit starts (a commitlog record in
  standalone/classic mode; a DLedger entry header in DLedger mode);
- a *physical offset* is where a message record starts. Consume queues,
  offsetMsgId and pulls only ever use physical offsets. In DLedger mode
  physical offset = entry pos + 48; otherwise they are equal.

Dispatch, pull, recovery and the pipeline only ever see committed data.

Two optional batched forms, used when a log has them (LocalLog and DLedgerLog do):
`append_packed(drafts) -> (PutStatus, store_timestamp, [(physical_offset, size,
queue_offset)])` is `append` with one status for the whole batch and no result object
per message; `scan_spans(position, max_bytes) -> ([(buffer, start, physical_offset,
size)], next_position)` is `scan` without a copy per record.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, Sequence

from node.store.message import MessageDraft


class PutStatus(enum.Enum):
    SEND_OK = "SEND_OK"
    FLUSH_DISK_TIMEOUT = "FLUSH_DISK_TIMEOUT"
    FLUSH_SLAVE_TIMEOUT = "FLUSH_SLAVE_TIMEOUT"
    SLAVE_NOT_AVAILABLE = "SLAVE_NOT_AVAILABLE"


@dataclass(frozen=True, slots=True)
class PutResult:
    status: PutStatus
    physical_offset: int        # where the message record starts (body offset in DLedger)
    size: int                   # record size in bytes
    queue_offset: int           # logical offset in (topic, queue_id); -1 if not dispatched (tx prepared)
    store_timestamp: int        # ms, stamped by the appending node


@dataclass(frozen=True, slots=True)
class ScannedRecord:
    physical_offset: int        # message record start
    data: bytes                 # the complete message record


@dataclass(frozen=True, slots=True)
class ScanBatch:
    records: tuple[ScannedRecord, ...]
    next_position: int          # log position to continue from


class ReplicatedLog(Protocol):
    """What the broker needs from a replicated commitlog."""

    mode: str                   # "standalone" | "dledger" | "classic"

    async def start(self) -> None:
        """Recover from disk and begin serving; returns once reads of committed data work."""

    async def stop(self) -> None:
        """Flush and close; a clean stop removes the abort marker."""

    def role(self) -> str:
        """STANDALONE, MASTER, SLAVE, LEADER, FOLLOWER or CANDIDATE."""

    def leader(self) -> str | None:
        """API address of the node that accepts writes, if known."""

    def members(self) -> dict[str, str]:
        """Node id -> API address of the members of this node's group known here (it may leave
        itself out): /cluster/nodes, mqadmin clusterList and the dashboard list them."""

    def status(self) -> dict:
        """Mode-specific facts for /health and /cluster (term, indexes, HA offsets, ...)."""

    async def append(self, drafts: Sequence[MessageDraft]) -> list[PutResult]:
        """Append sealed drafts as one batch; return once committed under the mode's rule.

        Assigns each message its queue offset, physical offset and store timestamp.
        Raises NotLeader (with a hint), DiskFull, StoreFatal. A result's status
        reports FLUSH_DISK_TIMEOUT / FLUSH_SLAVE_TIMEOUT / SLAVE_NOT_AVAILABLE.
        """

    @property
    def committed_position(self) -> int:
        """Log position up to which the log is committed (the dispatcher reads up to here)."""

    @property
    def min_position(self) -> int:
        """First retained log position."""

    @property
    def min_physical_offset(self) -> int:
        """First retained physical offset; consume-queue units below it are expired."""

    def scan(self, position: int, max_bytes: int) -> ScanBatch:
        """Committed message records from `position`, at most about `max_bytes` of them."""

    def read(self, physical_offset: int, size: int) -> bytes:
        """The committed record at `physical_offset`; raises KeyError if not (or no longer) there."""

    async def wait_committed(self, beyond_position: int, timeout_s: float) -> int:
        """Wait until committed_position > beyond_position or the timeout; return committed_position."""

    def queue_offset_of(self, topic: str, queue_id: int) -> int:
        """Next queue offset the log would assign to (topic, queue_id)."""
