"""Bulk index-file writer for a fresh rebuild: the node's IndexService result, in one pass.

`IndexService.put_hash` adds one entry at a time (pack, slot update, dirty-page set,
header fields): about 2 µs per entry, and a rebuild feeds every entry through one
process because hash chains link entries across the whole file. For a rebuild into an
empty directory the final bytes of each file are a function of its entries alone, so
this module computes them directly: slot chains with one tight loop, entries packed by
`map(INDEX_ENTRY.pack, ...)`, header, then one pwrite per region.

The rules reproduced from node.store.index_file (the tests hold the two byte-identical
against the node's Dispatcher, including file rolls):
- a file holds max_entries - 1 entries (entry 0 is never used; full at index_count == max_entries);
- slot = key_hash % hash_slots; an entry's prev_index is the slot's previous head (0 = none);
  hash_slot_count counts entries that found their slot empty;
- time_diff = 0 for the first entry (begin_timestamp is still 0 then), else
  clamp((ts - begin_timestamp) // 1000, 0, INT_MAX), and 0 whenever begin_timestamp <= 0;
- header: begin/end timestamp and phy offset of the first/last entry, slot count, entries + 1;
- a file is named by file_name_for(first entry's store time), kept strictly increasing
  (previous name + 1 ms) so names sort.
If the node grows a bulk API (e.g. `IndexFile.put_many`), this module should give way to it.

With numpy installed (the `pipeline` extra lists it) the per-entry work runs
vectorised: each entry's prev_index is the previous entry of the same slot, found by a
stable sort on the slot; the slot table takes each slot's last entry. Without numpy the
same rules run as plain loops. Both are held byte-identical to the node's IndexService.
"""

from __future__ import annotations

import os
import sys
from array import array

from node.store import layout as L
from node.store.fileio import FileSystem
from node.store.index_file import IndexFile, file_name_for

try:
    import numpy as _np
except ImportError:  # pragma: no cover - the plain-loop writer below needs nothing
    _np = None

_HEADER = L.INDEX_HEADER
_ENTRY = L.INDEX_ENTRY
_SLOT = L.INDEX_SLOT
INT_MAX = 0x7FFFFFFF
_PACK_CHUNK = 65_536            # entries packed per join: bounds the temporary bytes list


def _name_ms(prev_ms: int | None, first_ts: int) -> int:
    return first_ts if prev_ms is None else max(first_ts, prev_ms + 1)


def _chain(hashes, hash_slots: int) -> tuple[array, array, int]:
    """(slot table, prev_index per entry, slots used) for entries numbered 1..n in order."""
    slots = array("i", [0]) * hash_slots
    prevs = array("i", [0]) * len(hashes)
    used = 0
    number = 0
    for h in hashes:
        s = h % hash_slots
        p = slots[s]
        if p == 0:
            used += 1
        prevs[number] = p
        number += 1
        slots[s] = number
    return slots, prevs, used


def _diffs(tss, begin: int) -> list[int]:
    if begin <= 0:
        return [0] * len(tss)
    out = [min(max((t - begin) // 1000, 0), INT_MAX) for t in tss]
    out[0] = 0   # the first entry is packed before begin_timestamp is set
    return out


def write_file(fs: FileSystem, path: str, hashes, phys, tss, hash_slots: int, max_entries: int) -> None:
    """One index file holding entries 1..n (n <= max_entries - 1), flushed."""
    n = len(hashes)
    assert 0 < n <= max_entries - 1
    slots, prevs, used = _chain(hashes, hash_slots)
    diffs = _diffs(tss, tss[0])
    if sys.byteorder == "little":
        slots.byteswap()
    handle = fs.open(path)
    try:
        handle.truncate(IndexFile.file_size(hash_slots, max_entries))   # sparse, full size, like create()
        entries_base = _HEADER.size + hash_slots * _SLOT.size
        pos = entries_base + _ENTRY.size   # entry 1
        for lo in range(0, n, _PACK_CHUNK):
            hi = min(n, lo + _PACK_CHUNK)
            data = b"".join(map(_ENTRY.pack, hashes[lo:hi], phys[lo:hi], diffs[lo:hi], prevs[lo:hi]))
            handle.pwrite(data, pos)
            pos += len(data)
        handle.pwrite(slots.tobytes(), _HEADER.size)
        handle.pwrite(_HEADER.pack(tss[0], tss[-1], phys[0], phys[-1], used, n + 1), 0)
        handle.fsync()
    finally:
        handle.close()


# --- numpy path ---------------------------------------------------------------------------
_NP_CODES = {"i": "i4", "q": "i8"}
_NP_WRITE_CHUNK = 1 << 20       # entries per pwrite: bounds the temporary bytes


def _np_dtype(st):
    """The numpy record dtype of a big-endian layout, read off the layout's own format."""
    assert st.format[0] == ">", st.format
    dt = _np.dtype([(f"f{k}", ">" + _NP_CODES[c]) for k, c in enumerate(st.format[1:])])
    assert dt.itemsize == st.size, (st.format, dt.itemsize)
    return dt


def write_file_np(fs: FileSystem, path: str, hashes, phys, tss, hash_slots: int, max_entries: int) -> None:
    """write_file with numpy arrays (int64) of the entries 1..n of one file."""
    n = len(hashes)
    assert 0 < n <= max_entries - 1
    slot = hashes % hash_slots
    order = _np.argsort(slot, kind="stable")          # entries grouped by slot, in entry order
    by_slot = slot[order]
    same = by_slot[1:] == by_slot[:-1]
    prevs = _np.zeros(n, dtype=_np.int64)
    prevs[order[1:][same]] = order[:-1][same] + 1     # entry numbers start at 1
    last = _np.ones(n, dtype=bool)
    last[:-1] = ~same
    table = _np.zeros(hash_slots, dtype=_np_dtype(_SLOT))
    table["f0"][by_slot[last]] = order[last] + 1
    used = int(last.sum())
    begin = int(tss[0])
    entries = _np.empty(n, dtype=_np_dtype(_ENTRY))
    entries["f0"] = hashes
    entries["f1"] = phys
    if begin <= 0:
        entries["f2"] = 0
    else:
        entries["f2"] = _np.clip((tss - begin) // 1000, 0, INT_MAX)
        entries["f2"][0] = 0      # the first entry is packed before begin_timestamp is set
    entries["f3"] = prevs
    handle = fs.open(path)
    try:
        handle.truncate(IndexFile.file_size(hash_slots, max_entries))   # sparse, full size, like create()
        pos = _HEADER.size + hash_slots * _SLOT.size + _ENTRY.size      # entry 1
        for lo in range(0, n, _NP_WRITE_CHUNK):
            data = entries[lo:lo + _NP_WRITE_CHUNK].tobytes()
            handle.pwrite(data, pos)
            pos += len(data)
        handle.pwrite(table.tobytes(), _HEADER.size)
        handle.pwrite(_HEADER.pack(begin, int(tss[-1]), int(phys[0]), int(phys[-1]), used, n + 1), 0)
        handle.fsync()
    finally:
        handle.close()


def write_index(target_dir: str, flat: array, hash_slots: int, max_entries: int,
                fs: FileSystem | None = None, use_numpy: bool | None = None) -> list[str]:
    """Index files under target_dir/index/ from (key_hash, phy, ts) triples in commitlog order.

    use_numpy: None = when numpy is importable; False forces the plain loops."""
    fs = fs or FileSystem()
    use_numpy = (_np is not None) if use_numpy is None else use_numpy
    directory = os.path.join(target_dir, "index")
    fs.makedirs(directory)
    per_file = max_entries - 1
    n = len(flat) // 3
    triples = _np.frombuffer(flat, dtype=_np.int64).reshape(n, 3) if use_numpy and n else None
    names: list[str] = []
    prev_ms: int | None = None
    for lo in range(0, n, per_file):    # bounded: one pass per file
        hi = min(n, lo + per_file)
        if triples is not None:
            hashes, phys, tss = triples[lo:hi, 0], triples[lo:hi, 1], triples[lo:hi, 2]
        else:
            hashes, phys, tss = flat[3 * lo:3 * hi:3], flat[3 * lo + 1:3 * hi:3], flat[3 * lo + 2:3 * hi:3]
        prev_ms = _name_ms(prev_ms, int(tss[0]))
        name = file_name_for(prev_ms)
        writer = write_file_np if triples is not None else write_file
        writer(fs, os.path.join(directory, name), hashes, phys, tss, hash_slots, max_entries)
        names.append(name)
    fs.fsync_dir(directory)
    return names
