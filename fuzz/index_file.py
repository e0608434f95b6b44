"""Fuzz the index file reader (node/store/index_file.py).

Input: bytes 0-7 are the recovered log end handed to load() (big-endian, signed);
the rest is the content of one index file of 16 hash slots and 32 entries (744
bytes; shorter input is zero-padded, longer is cut). The file is loaded, repaired
against the log end and queried by hash. Allowed errors: none (a file of the right
size is readable whatever its content; a query walks a bounded chain).
"""

from __future__ import annotations

import os
import shutil

from fuzz._common import fast_filesystem, scratch_root

TARGET = "index_file"
MODULES = ("node.store.index_file",)
SLOTS, ENTRIES = 16, 32
_state: dict = {}


def _fs():
    if "fs" not in _state:
        _state["fs"] = fast_filesystem()
    return _state["fs"]


def test_one_input(data: bytes) -> None:
    from node.store.index_file import IndexFile, IndexService

    if not _state:
        _state["root"] = scratch_root(TARGET)
    root = _state["root"]
    shutil.rmtree(os.path.join(root, "index"), ignore_errors=True)
    os.makedirs(os.path.join(root, "index"))
    log_end = int.from_bytes(data[:8], "big", signed=True) if len(data) >= 8 else None
    size = IndexFile.file_size(SLOTS, ENTRIES)
    with open(os.path.join(root, "index", "20260101000000000"), "wb") as f:
        f.write(data[8:8 + size].ljust(size, b"\0"))
    svc = IndexService(_fs(), root, hash_slots=SLOTS, max_entries=ENTRIES)
    try:
        svc.load(log_end)
        for f in svc.files:
            assert 1 <= f.index_count <= ENTRIES
            for h in range(SLOTS):
                out: list[int] = []
                f.query(h, -(1 << 62), 1 << 62, 64, out, set())
                assert len(out) <= min(64, f.entries)
        svc.query("T", "k", 0, 1 << 62, 16)
    finally:
        svc.close()


def main() -> None:
    from fuzz._common import run
    run(TARGET, test_one_input, MODULES)


if __name__ == "__main__":
    main()
