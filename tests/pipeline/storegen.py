"""Store generators for the pipeline tests and benchmark.

Commitlog stores are written by the node's own `CommitLog` (the real append path:
headers, blanks, rolls). DLedger stores are written here, entry by entry, from the
layouts in `node.store.layout` (header + body, chain CRC, end-of-file blank, the
32-byte index file) until the DLedger entry store can be driven directly.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

from node.store import layout as L
from node.store.commitlog import CommitLog
from node.store.fileio import FileSystem
from node.store.message import MessageDraft, encode_record
from node.store.queue_offsets import QueueOffsetTable
from node.store.segment import segment_name
from dledger.entry import encode_blank, encode_entry

STORE_IP = bytes([10, 0, 0, 7])
STORE_PORT = 10911
BORN_IP = bytes([192, 168, 1, 20])


@dataclass
class Spec:
    """Knobs for a generated workload."""

    topics: tuple[str, ...] = ("orders", "audit")
    queues: int = 4
    body_min: int = 0
    body_max: int = 300
    tags: tuple[str | None, ...] = ("TagA", "TagB", None)
    keys_per_msg: int = 1
    tx_every: int = 0            # every n-th message is a prepared (even) / rolled-back (odd) tx message
    delay_every: int = 0         # every n-th message goes to SCHEDULE_TOPIC_XXXX with a DELAY level
    start_ms: int = 1_700_000_000_000
    step_ms: int = 7


def make_draft(rng: random.Random, spec: Spec, i: int) -> MessageDraft:
    topic = spec.topics[i % len(spec.topics)]
    props: dict[str, str] = {"UNIQ_KEY": f"U{i:012X}"}
    tag = spec.tags[rng.randrange(len(spec.tags))]
    if tag:
        props["TAGS"] = tag
    if spec.keys_per_msg:
        props["KEYS"] = " ".join(f"k{rng.randrange(1000)}" for _ in range(spec.keys_per_msg))
    sys_flag = 0
    if spec.tx_every and i % spec.tx_every == spec.tx_every - 1:
        odd = (i // spec.tx_every) % 2
        sys_flag = L.SYSFLAG_TRANSACTION_ROLLBACK_TYPE if odd else L.SYSFLAG_TRANSACTION_PREPARED_TYPE
    queue_id = rng.randrange(spec.queues)
    if spec.delay_every and i % spec.delay_every == spec.delay_every - 1:
        level = 1 + i % 20          # beyond 18 on purpose: the dispatcher clamps to the table
        topic, queue_id = "SCHEDULE_TOPIC_XXXX", level - 1
        props["DELAY"] = str(level)
    body = rng.randbytes(rng.randint(spec.body_min, spec.body_max))
    return MessageDraft(topic=topic, queue_id=queue_id, body=body, properties=props,
                        sys_flag=sys_flag, born_timestamp=spec.start_ms + i * spec.step_ms - 3,
                        born_ip=BORN_IP, born_port=50000 + i % 7, reconsume_times=i % 3).seal()


def write_commitlog_store(root: str, n: int, segment_size: int, *, seed: int = 1, spec: Spec | None = None,
                          batch: int = 16) -> list[tuple[int, int, int]]:
    """n messages through the node's CommitLog into root/commitlog; returns (phys, size, qoff)."""
    spec = spec or Spec()
    rng = random.Random(seed)
    cl = CommitLog(FileSystem(), os.path.join(root, "commitlog"), segment_size, STORE_IP, STORE_PORT)
    cl.load()
    table = QueueOffsetTable()
    out: list[tuple[int, int, int]] = []
    for start in range(0, n, batch):
        drafts = [make_draft(rng, spec, i) for i in range(start, min(n, start + batch))]
        out += cl.append_batch(drafts, table, spec.start_ms + start * spec.step_ms)
    cl.flush()
    cl.close()
    return out


@dataclass
class Entry:
    index: int
    term: int
    pos: int
    magic: int
    body: bytes


class DLedgerWriter:
    """Minimal DLedger entry store writer: data segments + index file, per the layouts."""

    def __init__(self, root: str, self_id: str, segment_size: int, index_segment_size: int = 32 * 4096):
        self.data_dir = os.path.join(root, f"dledger-{self_id}", "data")
        self.index_dir = os.path.join(root, f"dledger-{self_id}", "index")
        os.makedirs(self.data_dir, exist_ok=True)
        os.makedirs(self.index_dir, exist_ok=True)
        self.segment_size = segment_size
        self.index_segment_size = index_segment_size
        self.pos = 0
        self.next_index = 1           # a fresh Raft log has base (0, 0): entries start at 1
        self.chain = 0
        self.entries: list[Entry] = []
        self.queues = QueueOffsetTable()

    def _pwrite(self, directory: str, seg_size: int, abs_pos: int, data: bytes) -> None:
        base = abs_pos - abs_pos % seg_size
        path = os.path.join(directory, segment_name(base))
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size < seg_size:
                os.ftruncate(fd, seg_size)
            os.pwrite(fd, data, abs_pos - base)
        finally:
            os.close(fd)

    def append(self, term: int, body_fn, magic: int = L.ENTRY_MAGIC_NORMAL) -> Entry:
        """Append one entry; body_fn(pos) returns the body (it needs the entry position)."""
        body = body_fn(self.pos)
        size = L.ENTRY_HEADER.size + len(body)
        remaining = self.segment_size - self.pos % self.segment_size
        if size + L.ENTRY_BLANK.size > remaining:
            self._pwrite(self.data_dir, self.segment_size, self.pos, encode_blank(remaining))
            self.pos += remaining
            body = body_fn(self.pos)
        data = encode_entry(self.next_index, term, self.pos, magic, body, self.chain)
        self.chain = L.ENTRY_HEADER.unpack_from(data)[6]
        self._pwrite(self.data_dir, self.segment_size, self.pos, data)
        self._pwrite(self.index_dir, self.index_segment_size, self.next_index * L.ENTRY_INDEX.size,
                     L.ENTRY_INDEX.pack(magic, self.pos, size, self.next_index, term))
        e = Entry(self.next_index, term, self.pos, magic, body)
        self.entries.append(e)
        self.pos += size
        self.next_index += 1
        return e

    def append_message(self, term: int, draft: MessageDraft, store_ts: int) -> Entry:
        qoff = self.queues.assign(draft)
        return self.append(term, lambda pos: encode_record(draft, qoff, pos + L.ENTRY_HEADER.size, store_ts,
                                                           STORE_IP, STORE_PORT))


def write_dledger_store(root: str, self_id: str, n: int, segment_size: int, *, seed: int = 1,
                        spec: Spec | None = None, term_every: int = 50) -> DLedgerWriter:
    """n messages as DLedger entries; a new term (opened by a no-op) every `term_every`."""
    spec = spec or Spec()
    rng = random.Random(seed)
    w = DLedgerWriter(root, self_id, segment_size)
    term = 1
    w.append(term, lambda pos: b"", magic=L.ENTRY_MAGIC_NOOP)
    for i in range(n):
        if term_every and i and i % term_every == 0:
            term += 1
            w.append(term, lambda pos: b"", magic=L.ENTRY_MAGIC_NOOP)
        w.append_message(term, make_draft(rng, spec, i), spec.start_ms + i * spec.step_ms)
    return w


# --- Node-written stores (LocalLog + the node's Dispatcher) ---------------------------------
@dataclass(frozen=True)
class NodeGeometry:
    """Small CQ / index geometry so tests roll files; the rebuild must be given the same."""

    units_per_file: int = 1000
    index_hash_slots: int = 4099
    index_max_entries: int = 3000


def write_node_store(root: str, n: int, segment_size: int, *, seed: int = 1, spec: Spec | None = None,
                     batch: int = 32, geometry: NodeGeometry = NodeGeometry(), dispatch: bool = True) -> dict:
    """n messages appended through a real LocalLog; then (optionally) the node's Dispatcher
    builds consumequeue/ and index/ under root. Returns timing facts."""
    import asyncio

    from node.local_log import LocalLog, LocalLogConfig

    spec = spec or Spec()
    rng = random.Random(seed)

    async def produce() -> None:
        llog = LocalLog(FileSystem(), root, LocalLogConfig(segment_size_bytes=segment_size,
                                                           store_ip="10.0.0.7", store_port=STORE_PORT))
        await llog.start()
        for start in range(0, n, batch):
            await llog.append([make_draft(rng, spec, i) for i in range(start, min(n, start + batch))])
        await llog.stop()

    asyncio.run(produce())
    out = {"messages": n}
    if dispatch:
        out["dispatched"], out["dispatch_s"] = dispatch_store(root, segment_size, geometry)
    return out


dispatch_cpu_s: list[float] = []     # CPU seconds of each dispatch_store catch-up (benchmarks read it)


def dispatch_store(root: str, segment_size: int, geometry: NodeGeometry) -> tuple[int, float]:
    """Run the node's single-process Dispatcher over a standalone store's committed log.

    Returns (records dispatched, seconds spent in Dispatcher.catch_up, final flush included;
    the log's own recovery at start is not counted)."""
    import asyncio
    import time

    from node.local_log import LocalLog, LocalLogConfig
    from node.store.checkpoint import Checkpoint
    from node.store.consume_queue import ConsumeQueueStore
    from node.store.dispatcher import Dispatcher
    from node.store.index_file import IndexService

    async def run() -> int:
        fs = FileSystem()
        llog = LocalLog(fs, root, LocalLogConfig(segment_size_bytes=segment_size, store_ip="10.0.0.7",
                                                 store_port=STORE_PORT))
        await llog.start()
        d = Dispatcher(llog, ConsumeQueueStore(fs, root, geometry.units_per_file),
                       IndexService(fs, root, hash_slots=geometry.index_hash_slots,
                                    max_entries=geometry.index_max_entries),
                       Checkpoint(fs, root))
        d.startup_recover(llog.commitlog.max_offset)
        t, c = time.perf_counter(), time.process_time()
        n = d.catch_up()
        elapsed = time.perf_counter() - t
        dispatch_cpu_s.append(time.process_time() - c)
        d.index.close()
        d.cq_store.close()
        await llog.stop()
        return n, elapsed

    return asyncio.run(run())


class DLedgerScanLog:
    """The slice of ReplicatedLog the node's Dispatcher uses, over a DLedgerWriter's entries.

    Independent of pipeline.parsers on purpose: positions and bodies come from what the
    writer recorded, so the dispatcher's output is a reference for the pipeline's rebuild.
    """

    def __init__(self, writer: DLedgerWriter, committed_index: int):
        import bisect
        self._bisect = bisect
        committed = [e for e in writer.entries if e.index <= committed_index]
        self._entries = committed
        self._positions = [e.pos for e in committed]
        last = committed[-1] if committed else None
        self.committed_position = last.pos + L.ENTRY_HEADER.size + len(last.body) if last else 0
        self.min_position = 0
        self.min_physical_offset = 0

    def scan(self, position: int, max_bytes: int):
        from node.replicated_log import ScanBatch, ScannedRecord
        i = self._bisect.bisect_left(self._positions, position)
        out, used = [], 0
        nxt = position
        while i < len(self._entries) and used < max_bytes:
            e = self._entries[i]
            if e.magic == L.ENTRY_MAGIC_NORMAL:
                out.append(ScannedRecord(e.pos + L.ENTRY_HEADER.size, e.body))
                used += len(e.body)
            nxt = e.pos + L.ENTRY_HEADER.size + len(e.body)
            i += 1
        return ScanBatch(tuple(out), nxt)


def dispatch_dledger(root: str, writer: DLedgerWriter, committed_index: int, geometry: NodeGeometry) -> int:
    """The node's Dispatcher over the committed entries of a generated DLedger store."""
    from node.store.checkpoint import Checkpoint
    from node.store.consume_queue import ConsumeQueueStore
    from node.store.dispatcher import Dispatcher
    from node.store.index_file import IndexService

    fs = FileSystem()
    log_ = DLedgerScanLog(writer, committed_index)
    d = Dispatcher(log_, ConsumeQueueStore(fs, root, geometry.units_per_file),
                   IndexService(fs, root, hash_slots=geometry.index_hash_slots,
                                max_entries=geometry.index_max_entries),
                   Checkpoint(fs, root))
    d.startup_recover(log_.committed_position + L.ENTRY_HEADER.size)
    n = d.catch_up()
    d.index.close()
    d.cq_store.close()
    return n


def write_entry_store(root: str, self_id: str, n: int, segment_size: int, committed: int, *, seed: int = 1,
                      spec: Spec | None = None) -> list[int]:
    """n messages (after a no-op) through the DLedger EntryStore itself; meta records
    `committed` via checkpoint(). Returns the entry positions (index 1 first)."""
    from dledger.entry_store import EntryStore
    from dledger.messages import Entry as RaftEntry, EntryType

    spec = spec or Spec()
    rng = random.Random(seed)
    store = EntryStore(FileSystem(), root, self_id, data_segment_size=segment_size)
    store.recover()
    positions = store.append([RaftEntry(1, 1, EntryType.NOOP, b"")])
    table = QueueOffsetTable()
    for i in range(n):
        d = make_draft(rng, spec, i)
        pos = store.next_pos_for(d.total_size)
        body = encode_record(d, table.assign(d), pos + L.ENTRY_HEADER.size, spec.start_ms + i, STORE_IP, STORE_PORT)
        positions += store.append([RaftEntry(i + 2, 1, EntryType.NORMAL, body)])
    store.flush()
    store.checkpoint(committed)
    store.close()
    return positions
