"""Corrupt committed entries: find them, refuse them, repair them in place from a peer.

Committed entries are identical on every replica, byte for byte and at the same
positions (entry_store's placement rule). So a replica whose copy of a committed entry
fails its body CRC can fetch the entry from a healthy peer and write it back over the
damaged bytes: same bytes, same position, no truncation, and the chain CRCs of every
later entry stay valid. Until then the node:
- serves nothing from the range (reads fail with the retriable CorruptData; the
  dispatcher's scan stops before it),
- does not campaign (RaftCore.campaign_blocked): a leader must be able to serve and
  push every committed entry. It still votes: votes compare last index and term, which
  the damage does not change (docs/raft.md, "Corruption and repair"),
- and, when it is the leader, hands leadership to a healthy peer.

Finding: recovery (body CRC mismatch with an intact header and chain, at or below the
durable mark: kept and marked instead of cut), the read path (DLedgerLog.read checks the
entry's bodyCrc) and the scrubber (`EntryScrubSource`).

Fetching: over the Raft peer channel (dledger/transport.py: cluster secret and mutual TLS
when configured), never over the client API. The repairing node sends
`FetchEntries(request_id, index, count)`; the peer answers `FetchEntriesResponse` with the raw
committed entries (header + body), each re-verified by the peer before it is sent, at most
MAX_FETCH_ENTRIES / MAX_FETCH_BYTES, or with an error. The shell (RaftNode._on_message)
routes both messages to `Repairer.on_message`; the Raft core never sees them. An answer is
matched by request id and sender, and waited for at most `fetch_timeout_s`. The repairing
node checks magic, size, index, term and pos against its own index record and the body CRC
before writing, fsyncs, reads the bytes back and verifies them again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from node.store.crc import crc32 as _crc32
from dledger import entry as E
from dledger import messages as M
from node.store import layout as L
from node.store.errors import CorruptRecord, StoreError
from node.store.scrub import CorruptData, CorruptionRegistry, CorruptRange

if TYPE_CHECKING:
    from dledger.dledger_log import DLedgerLog

log = logging.getLogger(__name__)

HEADER = E.HEADER_SIZE
_BODY_CRC_AT = L.ENTRY_FIELD_OFFSET["body_crc"]
MAX_FETCH_ENTRIES = M.MAX_FETCH_ENTRIES  # entries per FetchEntriesResponse
MAX_FETCH_BYTES = M.MAX_FETCH_BYTES      # bytes per answer (a single larger entry is sent alone)
FETCH_TIMEOUT_S = 3.0
RETRY_S = 1.0                           # pause after a round that left damage unrepaired
GONE_RETRY_S = 60.0                     # an entry every peer has cut: asked again this much later
GONE_HERE = "gone:"                     # how a refusal says the entry is below the replica's first one
SERVE_BYTES_PER_S = 32 << 20            # answers to one peer per second; beyond, it is told "busy"


@dataclass(frozen=True, slots=True)
class DamagedEntry:
    """A committed entry whose header and chain verify but whose body does not."""

    magic: int
    index: int
    term: int
    pos: int
    size: int
    chain_crc: int
    expected_crc: int
    actual_crc: int

    @property
    def end(self) -> int:
        return self.pos + self.size


def damaged_body(buf: bytes | memoryview, at: int, pos: int, prev_chain: int, want_index: int,
                 durable_mark: int, err: CorruptRecord) -> DamagedEntry | None:
    """Recovery: the entry at buf[at:] failed `err`; is it a committed entry with body-only damage?

    Yes when the body CRC alone failed (decode_entry checked magic, sizes and pos first), the
    index is the next one, it is at or below the durable mark (committed here), and the chain
    CRC, which covers the header and the *recorded* body CRC but not the body, verifies.
    Anything else stays recovery's business (cut a torn tail, or catch up)."""
    if err.reason != "entry body crc mismatch":
        return None
    magic, size, index, term, _pos, _ch, chain, body_crc, _bs = L.ENTRY_HEADER.unpack_from(buf, at)
    if index != want_index or index > durable_mark:
        return None
    if E.chain_crc_of(buf[at:at + HEADER], body_crc, prev_chain) != chain:
        return None
    actual = _crc32(buf[at + HEADER:at + size])
    return DamagedEntry(magic, index, term, pos, size, chain, body_crc, actual)


def body_crc_problem(raw: bytes | memoryview, at: int = 0) -> tuple[int, int] | None:
    """(expected, actual) when the entry at raw[at:] fails its body CRC, else None."""
    size = int.from_bytes(raw[at + 4:at + 8], "big", signed=True)
    expected = int.from_bytes(raw[at + _BODY_CRC_AT:at + _BODY_CRC_AT + 4], "big")
    actual = _crc32(memoryview(raw)[at + HEADER:at + size])   # no copy of the body
    return None if actual == expected else (expected, actual)


def damage_range(store: Any, d: DamagedEntry, found_by: str) -> CorruptRange:
    seg = store.data.segment_for(d.pos)
    return CorruptRange(seg.path if seg is not None else store.data.directory, d.pos, d.end, d.expected_crc,
                        d.actual_crc, found_by, "entry body crc mismatch", d.index)


# --- scrubbing ---------------------------------------------------------------------------------
class EntryScrubSource:
    """Scrubber source over a DLedger entry store's committed entries (node/store/scrub.py)."""

    def __init__(self, dlog: "DLedgerLog"):
        self.dlog = dlog
        self.store = dlog.store
        self._expect: tuple[int, int] | None = None     # (position, index expected there)

    def bounds(self) -> tuple[int, int]:
        return self.store.start_pos, self.dlog._committed_pos   # the real end, not the dispatch hold

    def verify(self, position: int, max_bytes: int) -> tuple[int, list[CorruptRange]]:
        store = self.store
        seg_size = store.segment_size
        seg_end = position - position % seg_size + seg_size
        stop = min(self.dlog._committed_pos, seg_end)
        seg = store.data.segment_for(position)
        if seg is None or position >= stop:   # file gone (retention) or the committed end reached
            return (seg_end if seg is None else max(position + 1, stop)), []
        buf = store.data.read(position, min(stop - position, max_bytes))
        index = self._expect[1] if self._expect and self._expect[0] == position else None
        out: list[CorruptRange] = []
        i = 0
        while i + E.BLANK_SIZE <= len(buf):
            at = position + i
            magic, size = L.ENTRY_BLANK.unpack_from(buf, i)
            if magic == L.ENTRY_MAGIC_BLANK:
                self._expect = (seg_end, index) if index is not None else None
                return seg_end, out
            if i + HEADER <= len(buf):
                _m, _s, idx, term, rpos = L.ENTRY_HEADER.unpack_from(buf, i)[:5]
            else:
                idx = term = rpos = -1
            ok_frame = (magic in E.VALID_MAGICS and HEADER <= size and size + E.BLANK_SIZE <= seg_end - at
                        and rpos == at and (index is None or idx == index) and self._term_ok(idx, term))
            if not ok_frame:
                out.append(self._framing_damage(seg.path, at, seg_end, index, magic, size))
                nxt = out[-1].end
                self._expect = (nxt, index + 1) if index is not None and nxt < seg_end else None
                return nxt, out
            if i + size > len(buf):
                if i == 0 and len(buf) < size:
                    buf = store.data.read(at, size)
                    if len(buf) == size:
                        continue
                break
            problem = body_crc_problem(buf, i)
            if problem is not None:
                out.append(CorruptRange(seg.path, at, at + size, problem[0], problem[1], "scrub",
                                        "entry body crc mismatch", idx))
            index = idx + 1
            i += size
        if i == 0:
            out.append(CorruptRange(seg.path, position, seg_end, None, None, "scrub", "no whole entry here"))
            self._expect = None
            return seg_end, out
        self._expect = (position + i, index)
        return position + i, out

    def _term_ok(self, index: int, term: int) -> bool:
        try:
            return index >= self.store.first_index() and self.store.term(index) == term
        except (IndexError, KeyError, StoreError):
            return False

    def _framing_damage(self, path: str, at: int, seg_end: int, index: int | None, magic: int,
                        size: int) -> CorruptRange:
        """A damaged header: if the index record says which entry sits here, the range is that entry
        (repairable); otherwise the rest of the file, which can no longer be walked."""
        if index is not None:
            try:
                rec = self.store.entry_at(index)
            except (KeyError, StoreError):
                rec = None
            if rec is not None and rec.pos == at:
                return CorruptRange(path, at, rec.end, None, None, "scrub",
                                    f"entry header damaged (magic {magic}, size {size})", index)
        return CorruptRange(path, at, seg_end, None, None, "scrub",
                            f"entry framing lost (magic {magic}, size {size})")


# --- serving peers -------------------------------------------------------------------------------
def committed_entries_raw(dlog: "DLedgerLog", index: int, count: int) -> bytes:
    """Raw committed entries index.. (at most count / MAX_FETCH_BYTES), each verified here first."""
    store = dlog.store
    if index < store.first_index():
        raise KeyError(f"{GONE_HERE} entry {index} is below this replica's first entry {store.first_index()} "
                       f"(retention cut it)")
    if index > dlog.commit_index:
        raise KeyError(f"entry {index} is not a committed entry here ({store.first_index()}..{dlog.commit_index})")
    parts: list[bytes] = []
    used = 0
    for i in range(index, min(index + min(count, MAX_FETCH_ENTRIES), dlog.commit_index + 1)):
        rec = store.entry_at(i)
        if parts and used + rec.size > MAX_FETCH_BYTES:
            break
        if dlog.corruption.overlapping(rec.pos, rec.end) is not None:
            break
        raw = store.data.read(rec.pos, rec.size)
        if len(raw) != rec.size or body_crc_problem(raw) is not None \
                or L.ENTRY_HEADER.unpack_from(raw, 0)[2:5] != (rec.index, rec.term, rec.pos):
            break   # damaged here too: never hand out bytes that do not verify
        parts.append(raw)
        used += rec.size
    if not parts:
        raise CorruptData(index, "this replica's copy does not verify either")
    return b"".join(parts)


# --- repairing -------------------------------------------------------------------------------------
class RepairError(Exception):
    """A peer's answer could not be used (remote fault); another peer or a later round may do."""


class GoneAtPeer(RepairError):
    """The peer no longer keeps the entry: its retention cut the file holding it."""


def check_fetched(raw: bytes, rec: Any) -> None:
    """The fetched entry must be the one our index record names, with a body that verifies."""
    if len(raw) < rec.size:
        raise RepairError(f"peer sent {len(raw)} bytes for an entry of {rec.size}")
    raw = raw[:rec.size]
    try:
        d = E.decode_entry(raw, rec.pos)
    except CorruptRecord as e:
        raise RepairError(f"peer's copy of entry {rec.index} does not verify: {e.reason}") from None
    if (d.magic, d.size, d.index, d.term, d.pos) != (rec.magic, rec.size, rec.index, rec.term, rec.pos):
        raise RepairError(f"peer's entry {d.index}/term {d.term} at {d.pos} (+{d.size}) is not our "
                          f"{rec.index}/term {rec.term} at {rec.pos} (+{rec.size})")


def write_in_place(store: Any, rec: Any, raw: bytes) -> None:
    """Overwrite the entry's bytes at its own position, fsync, read back and verify. Runs on
    a worker thread, under `flush_lock` (no truncation meanwhile) and the data files' own
    lock (no cut, reset or close of the file meanwhile), as a flush does; a committed entry's
    position and bytes never change."""
    raw = raw[:rec.size]
    with store.flush_lock:
        try:
            back = store.data.rewrite(rec.pos, raw)
        except OSError as e:
            from node.store.errors import StoreFatal
            raise StoreFatal(f"repairing {store.data.directory} at {rec.pos}: {e}") from e
    if back is None:
        raise RepairError(f"the file holding {rec.pos} is gone")
    if back != raw:
        raise RepairError(f"entry {rec.index} reads back different after the repair write")


class Repairer:
    """Repairs the registry's index-bearing ranges from peers, one entry at a time, bounded;
    and answers peers' FetchEntries from this node's verified committed entries."""

    def __init__(self, dlog: "DLedgerLog", registry: CorruptionRegistry, peers: Iterable[str],
                 fetch_timeout_s: float = FETCH_TIMEOUT_S, retry_s: float = RETRY_S,
                 serve_bytes_per_s: int = SERVE_BYTES_PER_S):
        self.dlog = dlog
        self.registry = registry
        self.peers = list(peers)        # peer node ids (this node excluded); a dict gives its keys
        self.fetch_timeout_s = fetch_timeout_s
        self.retry_s = retry_s
        self.serve_bytes_per_s = serve_bytes_per_s
        self.repaired = 0               # entries rewritten in place (rocketmq_store_repaired_entries_total)
        self.metrics: collections.Counter = collections.Counter()
        self._wake = asyncio.Event()
        self._next_request_id = 0
        # request id -> (peer asked, index asked, future of the answer); one fetch at a time.
        self._waiting: dict[int, tuple[str, int, asyncio.Future]] = {}
        self._served: dict[str, list[float]] = {}     # peer -> [window start, bytes sent in it]
        # Entries every peer has cut (no copy left anywhere): index -> monotonic time of the next try.
        self._gone: dict[int, float] = {}

    def wake(self) -> None:
        self._wake.set()

    def pending_entries(self) -> int:
        """Known corrupt entries waiting for a repair (ranges naming an entry; the others cannot be fetched)."""
        return sum(1 for r in self.registry.ranges() if r.index is not None)

    @property
    def failures(self) -> int:
        """Repair attempts that failed: a peer refused, did not answer in time or sent bytes that do not verify."""
        return self.metrics["fetch_failed"]

    # --- peer messages (RaftNode.side_handler) ---------------------------------------------------
    def on_message(self, sender: str, msg: object) -> None:
        if type(msg) is M.FetchEntries:
            self._serve(sender, msg)
        elif type(msg) is M.FetchEntriesResponse:
            self._answered(sender, msg)

    def _serve(self, sender: str, req: M.FetchEntries) -> None:
        node = self.dlog.node
        now = time.monotonic()
        window = self._served.setdefault(sender, [now, 0])
        if now - window[0] >= 1.0:
            window[0], window[1] = now, 0
        raw = b""
        if window[1] >= self.serve_bytes_per_s:
            error = f"busy: {window[1]} bytes served to {sender} in the last second; retry"
            self.metrics["serve_busy"] += 1
        else:
            try:
                raw = committed_entries_raw(self.dlog, req.index, req.count)
                error = ""
            except (KeyError, CorruptData, StoreError) as e:
                error = (str(e) or type(e).__name__)[:M.MAX_FETCH_ERROR_CHARS]
                self.metrics["serve_refused"] += 1
        window[1] += len(raw)
        if raw:
            self.metrics["serve_entries_answers"] += 1
        try:
            node.send_side(sender, M.FetchEntriesResponse(req.request_id, req.index, raw, error))
        except ConnectionError:
            pass   # stopping

    def _answered(self, sender: str, resp: M.FetchEntriesResponse) -> None:
        waiting = self._waiting.get(resp.request_id)
        if waiting is None or waiting[0] != sender or waiting[1] != resp.index or waiting[2].done():
            self.metrics["fetch_unmatched"] += 1     # late (timed out), duplicated or not ours
            log.debug("repair: unmatched answer %d for entry %d from %s dropped", resp.request_id, resp.index, sender)
            return
        waiting[2].set_result(resp)

    # --- repairing -----------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            ranges = [r for r in self.registry.ranges() if r.index is not None]
            for index in set(self._gone) - {r.index for r in ranges}:
                del self._gone[index]           # repaired, or gone with its file
            now = time.monotonic()
            pending = [r for r in ranges if self._gone.get(r.index, 0.0) <= now]   # not waiting out GONE_RETRY_S
            if not ranges:
                self._wake.clear()
                await self._wake.wait()
                continue
            for r in pending[:MAX_FETCH_ENTRIES]:
                await self._repair_one(r)
            left = [r for r in self.registry.ranges() if r.index is not None]
            if left:
                now = time.monotonic()      # until the first range due again (RETRY_S at least)
                pause = max(self.retry_s, min(self._gone.get(r.index, now) - now for r in left))
                try:
                    async with asyncio.timeout(pause):
                        await self._wake.wait()
                except TimeoutError:
                    pass
                self._wake.clear()

    def peer_order(self) -> list[str]:
        """The leader first (it has every committed entry), the others shuffled."""
        order = list(self.peers)
        random.shuffle(order)
        leader = getattr(self.dlog, "_leader_id", None)
        order.sort(key=lambda p: p != leader)
        return order

    async def _repair_one(self, r: CorruptRange) -> bool:
        store = self.dlog.store
        try:
            rec = store.entry_at(r.index)
        except (KeyError, StoreError) as e:
            log.warning("repair of entry %s: no index record (%s); left reported", r.index, e)
            return False
        peers, gone = self.peer_order(), 0
        for peer in peers:
            try:
                raw = await self.fetch(peer, r.index)
                if len(raw) > max(rec.size, MAX_FETCH_BYTES):
                    raise RepairError(f"answer of {len(raw)} bytes for one entry of {rec.size}")
                check_fetched(raw, rec)
            except GoneAtPeer as e:
                self.metrics["fetch_failed"] += 1
                gone += 1
                log.info("repair of entry %d from %s failed: %s", r.index, peer, e)
                if gone == len(peers):
                    self._every_copy_gone(r)
                continue
            except (RepairError, ConnectionError) as e:
                self.metrics["fetch_failed"] += 1
                log.warning("repair of entry %d from %s failed: %s", r.index, peer, e)
                continue
            # On a worker: the write waits for `flush_lock`, which a flush holds across its
            # fsync (2.3 s on the loop once, on a slow disk), and fsyncs itself. Under the
            # shell's disk gate, as a flush is: a reset's switch or a retention cut on the loop
            # never waits for this fsync.
            try:
                async with self.dlog.node.flushes_held():
                    await asyncio.to_thread(write_in_place, store, rec, raw)
            except RepairError as e:     # the file was cut or reset meanwhile
                log.warning("repair of entry %d: %s; left reported", r.index, e)
                return False
            self.dlog.on_repaired(r, rec, raw[:rec.size], f"entry {r.index} rewritten in place from {peer}, "
                                                          f"fsynced and verified")
            self.repaired += 1
            return True
        return False

    def _every_copy_gone(self, r: CorruptRange) -> None:
        """Every peer has cut the entry: asked again only every GONE_RETRY_S, with one ERROR."""
        if r.index not in self._gone:
            self.metrics["gone_everywhere"] += 1
            log.error("entry %d at %d in %s is damaged and every peer has cut it (retention): no copy is "
                      "left to repair it from. It stays reported and refused to readers until this "
                      "node's retention deletes its file; the peers are asked again every %.0f s",
                      r.index, r.start, r.path, GONE_RETRY_S)
        self._gone[r.index] = time.monotonic() + GONE_RETRY_S

    async def fetch(self, peer: str, index: int, count: int = 1) -> bytes:
        """Raw entries index.. from `peer` over the Raft channel; RepairError on a refusal or timeout."""
        self._next_request_id += 1
        rid = self._next_request_id
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiting[rid] = (peer, index, fut)
        try:
            self.dlog.node.send_side(peer, M.FetchEntries(rid, index, count))
            async with asyncio.timeout(self.fetch_timeout_s):
                resp: M.FetchEntriesResponse = await fut
        except TimeoutError:
            self.metrics["fetch_timeouts"] += 1
            raise RepairError(f"no answer within {self.fetch_timeout_s:g} s (peer down, unreachable "
                              "or refusing our peer authentication)") from None
        finally:
            self._waiting.pop(rid, None)
        if resp.error:
            raise (GoneAtPeer if GONE_HERE in resp.error else RepairError)(f"peer refused: {resp.error}")
        return resp.entries
