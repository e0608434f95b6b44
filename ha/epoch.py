"""The epoch file (`epochFileCheckpoint`) and the consistent-point search.

Each time a broker becomes master it appends <epoch, startOffset>: the first
commitlog offset it wrote in that epoch. A returning replica compares its epochs
with the master's to find where their logs stop agreeing, and truncates there.

File format (RocketMQ `CheckpointFile` + `EpochFileCache`, byte-compatible):

    file    = count LF crc LF entry*
    count   = decimal number of entries
    crc     = decimal CRC32 (zlib) of the concatenated entry lines, LF included,
              masked with 0x7FFFFFFF (RocketMQ UtilAll.crc32)
    entry   = epoch "-" startOffset LF          (both decimal)

Example: "2\n773307083\n7-7000\n8-8000\n". An empty list is written as "0\n0\n"
**(ours)**: RocketMQ skips writing an empty list, which would let a truncated epoch
come back after a crash; we always write. Writes are atomic (temp, fsync, rename,
fsync dir) through `FileSystem.write_atomic`, so the file is the old or the new list.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from node.store.crc import crc32 as _crc32
from node.store.errors import CorruptRecord
from node.store.fileio import FileSystem

FILE_NAME = "epochFileCheckpoint"


@dataclass(frozen=True, slots=True)
class EpochEntry:
    epoch: int              # master epoch from the controller, > 0, strictly rising along the file
    start_offset: int       # first commitlog offset written by that epoch's master
    end_offset: int = -1    # derived, never stored: next entry's start, or the log's max offset


def _crc(body: bytes) -> int:
    return _crc32(body) & 0x7FFFFFFF


def encode(entries: list[EpochEntry]) -> bytes:
    body = "".join(f"{e.epoch}-{e.start_offset}\n" for e in entries).encode("ascii")
    return f"{len(entries)}\n{_crc(body)}\n".encode("ascii") + body


def decode(raw: bytes, path: str = FILE_NAME) -> list[EpochEntry]:
    """Parse the file; raise CorruptRecord (offset 0) on any inconsistency."""
    lines = raw.decode("ascii", "replace").split("\n")
    if len(lines) < 2 or not lines[0].isdigit() or not lines[1].isdigit():
        raise CorruptRecord(0, f"{path}: bad header")
    count, crc = int(lines[0]), int(lines[1])
    entry_lines = lines[2:2 + count]
    if len(entry_lines) != count or any(not ln for ln in entry_lines):
        raise CorruptRecord(0, f"{path}: expected {count} entries")
    body = "".join(ln + "\n" for ln in entry_lines).encode("ascii")
    if _crc(body) != crc:
        raise CorruptRecord(0, f"{path}: crc mismatch")
    entries = []
    for ln in entry_lines:
        epoch, sep, start = ln.partition("-")
        if not sep or not epoch.isdigit() or not start.isdigit():
            raise CorruptRecord(0, f"{path}: bad entry {ln!r}")
        entries.append(EpochEntry(int(epoch), int(start)))
    _check_order(entries, path)
    return entries


def _check_order(entries: list[EpochEntry], path: str) -> None:
    for a, b in zip(entries, entries[1:]):
        if not (b.epoch > a.epoch and b.start_offset >= a.start_offset):
            raise CorruptRecord(0, f"{path}: entries out of order: {a} then {b}")


def with_ends(entries: list[EpochEntry], max_offset: int) -> list[EpochEntry]:
    """Fill end offsets: each epoch ends where the next starts; the last at `max_offset`."""
    out = []
    for i, e in enumerate(entries):
        end = min(entries[i + 1].start_offset, max_offset) if i + 1 < len(entries) else max_offset
        # An epoch that starts past the log's end (history learned, bytes not yet received) is empty.
        out.append(EpochEntry(e.epoch, e.start_offset, max(end, e.start_offset)))
    return out


def find_consistent_point(local: list[EpochEntry], master: list[EpochEntry]) -> int:
    """Where the local log must be truncated to agree with the master's; -1 if no epoch is shared.

    Both lists carry end offsets (`with_ends`). Walk local epochs newest first; the first
    one the master has with the same start offset is the newest shared history, and both
    logs agree up to the smaller of the two ends of that epoch (RocketMQ
    EpochFileCache.findConsistentPoint).
    """
    by_epoch = {m.epoch: m for m in master}
    for e in reversed(local):
        m = by_epoch.get(e.epoch)
        if m is not None and m.start_offset == e.start_offset:
            assert e.end_offset >= 0 and m.end_offset >= 0, "call with_ends first"
            return min(e.end_offset, m.end_offset)
    return -1


class EpochFile:
    """The broker's epoch list, persisted atomically on every change."""

    def __init__(self, fs: FileSystem, directory: str):
        self.fs = fs
        self.path = os.path.join(directory, FILE_NAME)
        self.entries: list[EpochEntry] = []

    def load(self) -> list[EpochEntry]:
        self.entries = decode(self.fs.read_file(self.path), self.path) if self.fs.exists(self.path) else []
        return self.entries

    def _store(self, entries: list[EpochEntry]) -> None:
        self.fs.write_atomic(self.path, encode(entries))
        self.entries = entries

    @property
    def last_epoch(self) -> int:
        return self.entries[-1].epoch if self.entries else 0

    def append(self, epoch: int, start_offset: int) -> None:
        """Record that this broker is master of `epoch` from `start_offset` on (durable on return)."""
        last = self.entries[-1] if self.entries else None
        if last is not None and last.epoch == epoch and last.start_offset == start_offset:
            return  # idempotent: the same promotion seen twice
        assert epoch > self.last_epoch, f"epoch {epoch} must exceed {self.last_epoch}"
        assert last is None or start_offset >= last.start_offset
        self._store(self.entries + [EpochEntry(epoch, start_offset)])

    def truncate_suffix(self, offset: int) -> None:
        """Drop epochs that start at or past `offset` (their bytes were truncated). Durable."""
        keep = [e for e in self.entries if e.start_offset < offset]
        if keep != self.entries:
            self._store(keep)

    def replace(self, entries: list[EpochEntry]) -> None:
        """Adopt another broker's history (a slave takes its master's epochs). Durable."""
        plain = [EpochEntry(e.epoch, e.start_offset) for e in entries]
        _check_order(plain, self.path)
        if plain != self.entries:
            self._store(plain)

    def drop_beyond(self, max_offset: int) -> None:
        """After recovery: epochs starting past the log's end lost their bytes in a crash
        between a commitlog truncation and this file's rewrite; drop them. Durable."""
        keep = [e for e in self.entries if e.start_offset <= max_offset]
        if keep != self.entries:
            self._store(keep)

    def with_ends(self, max_offset: int) -> list[EpochEntry]:
        return with_ends(self.entries, max_offset)
