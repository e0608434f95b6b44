"""Fuzz DLedger recovery over a data segment and an index segment (dledger/entry_store.py).

Input: bytes 0-1 (big-endian) split the rest into the data file (segment 4 KiB)
and the index file (segment 32 entries = 1 KiB); both are zero-padded to their
size. The store is recovered, then read back. Allowed errors: StoreFatal (the store
refuses to guess, e.g. a record that lands at the wrong offset). Recovery must
never fail any other way, and what it keeps must read back consistently.
"""

from __future__ import annotations

import os
import shutil

from fuzz._common import fast_filesystem, scratch_root

TARGET = "entry_store"
MODULES = ("dledger.entry_store",)
DATA_SEG, INDEX_SEG = 4096, 32 * 32
_state: dict = {}


def _fs():
    if "fs" not in _state:
        _state["fs"] = fast_filesystem()
    return _state["fs"]


def test_one_input(data: bytes) -> None:
    from dledger.entry_store import EntryStore
    from node.store.errors import StoreFatal

    if not _state:
        _state["root"] = scratch_root(TARGET)
    root = _state["root"]
    shutil.rmtree(os.path.join(root, "dledger-n0"), ignore_errors=True)
    split = int.from_bytes(data[:2], "big") if len(data) >= 2 else 0
    body = data[2:]
    data_part, index_part = body[:min(split, DATA_SEG)], body[min(split, DATA_SEG):][:INDEX_SEG]
    for sub, part, size in (("data", data_part, DATA_SEG), ("index", index_part, INDEX_SEG)):
        os.makedirs(os.path.join(root, "dledger-n0", sub))
        if part:
            with open(os.path.join(root, "dledger-n0", sub, "0" * 20), "wb") as f:
                f.write(part.ljust(size, b"\0"))
    store = EntryStore(_fs(), root, "n0", data_segment_size=DATA_SEG, index_segment_size=INDEX_SEG)
    try:
        try:
            report = store.recover()
        except StoreFatal:
            return
        first, last = store.first_index(), store.last_index()
        assert report.last_index == last
        entries = store.entries(first, last + 1, 1 << 20) if last >= first else []
        assert [e.index for e in entries] == list(range(first, first + len(entries)))
        for e in entries:
            assert store.term(e.index) == e.term
            rec = store.entry_at(e.index)
            assert rec.index == e.index and rec.term == e.term
    finally:
        store.close()


def main() -> None:
    from fuzz._common import run
    run(TARGET, test_one_input, MODULES)


if __name__ == "__main__":
    main()
