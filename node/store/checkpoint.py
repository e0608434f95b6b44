"""The `checkpoint` file (RocketMQ's StoreCheckpoint plus our committed offset and crc).

`committed_offset` is the dispatcher's flushed *log position*: every record before
it is in consume queues and index files that were fsynced before this file was
written. Recovery re-dispatches from there; a missing or damaged checkpoint reads
as zeros, which means "re-dispatch everything" (slow, never wrong).
The file is replaced atomically (temp, fsync, rename, fsync dir), so a crash leaves
either the old or the new checkpoint, never a torn one.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from node.store.crc import crc32 as _crc32
from node.store import layout as L
from node.store.fileio import FileSystem

log = logging.getLogger(__name__)

FILE_NAME = "checkpoint"
_CRC_SPAN = L.CHECKPOINT.size - 4       # crc32 covers every field before it
assert _CRC_SPAN == 32


@dataclass
class CheckpointState:
    physic_msg_timestamp: int = 0   # store time (ms) of the last flushed commitlog message
    logics_msg_timestamp: int = 0   # ... of the last message whose CQ unit is flushed
    index_msg_timestamp: int = 0    # ... of the last message whose index entries are flushed
    committed_offset: int = 0       # dispatcher's flushed log position (see module doc)


class Checkpoint(CheckpointState):
    """The checkpoint of one store root. Fields are set by their owners; save() persists all."""

    def __init__(self, fs: FileSystem, store_root: str):
        super().__init__()
        self.fs = fs
        self.path = os.path.join(store_root, FILE_NAME)
        self.loaded_ok = False      # False after load(): missing or damaged file

    def encode(self) -> bytes:
        head = L.CHECKPOINT.pack(self.physic_msg_timestamp, self.logics_msg_timestamp,
                                 self.index_msg_timestamp, self.committed_offset, 0)[:_CRC_SPAN]
        return L.CHECKPOINT.pack(self.physic_msg_timestamp, self.logics_msg_timestamp,
                                 self.index_msg_timestamp, self.committed_offset, _crc32(head))

    def load(self) -> bool:
        """Read the file. Missing or damaged -> zeros (full re-dispatch); returns whether it was good."""
        self._reset()
        if not self.fs.exists(self.path):
            log.info("no checkpoint at %s: starting from zeros", self.path)
            return False
        raw = self.fs.read_file(self.path)
        problem = self._problem(raw)
        if problem:
            log.error("checkpoint %s is damaged (%s): ignoring it; consume queues and index will be "
                      "re-dispatched from the start of the log", self.path, problem)
            return False
        (self.physic_msg_timestamp, self.logics_msg_timestamp, self.index_msg_timestamp,
         self.committed_offset, _crc) = L.CHECKPOINT.unpack(raw)
        self.loaded_ok = True
        return True

    @staticmethod
    def _problem(raw: bytes) -> str | None:
        if len(raw) != L.CHECKPOINT.size:
            return f"{len(raw)} bytes, expected {L.CHECKPOINT.size}"
        *_fields, crc = L.CHECKPOINT.unpack(raw)
        if _crc32(raw[:_CRC_SPAN]) != crc:
            return "crc mismatch"
        if _fields[3] < 0:
            return f"negative committed offset {_fields[3]}"
        return None

    def _reset(self) -> None:
        self.physic_msg_timestamp = self.logics_msg_timestamp = self.index_msg_timestamp = 0
        self.committed_offset = 0
        self.loaded_ok = False

    def save(self) -> None:
        """Atomically replace the file (StoreFatal/OSError propagate: the caller must stop)."""
        assert self.committed_offset >= 0
        self.fs.makedirs(os.path.dirname(self.path) or ".")
        self.fs.write_atomic(self.path, self.encode())

    @property
    def min_timestamp(self) -> int:
        """RocketMQ's getMinTimestamp: the oldest of the three (0 if any is unknown)."""
        return min(self.physic_msg_timestamp, self.logics_msg_timestamp, self.index_msg_timestamp)
