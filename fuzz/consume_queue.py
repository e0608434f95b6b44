"""Fuzz the consume-queue unit decoder and recovery (node/store/consume_queue.py).

Input: the bytes of a queue's first file (64 units = 1,280 bytes; shorter input
is zero-padded). `count_valid_units` is checked against a plain loop; then the
queue is recovered from that file and read back. Allowed errors: none (recovery
cuts what is not a valid unit and must not fail on any content).
"""

from __future__ import annotations

import os
import shutil
import struct

from fuzz._common import fast_filesystem, scratch_root

TARGET = "consume_queue"
MODULES = ("node.store.consume_queue",)
UNITS = 64
_UNIT = struct.Struct(">qiq")
_state: dict = {}


def _fs():
    if "fs" not in _state:
        _state["fs"] = fast_filesystem()
    return _state["fs"]


def _reference_valid_units(buf: bytes) -> int:
    n = 0
    for off in range(0, len(buf) - len(buf) % 20, 20):
        offset, size, _tags = _UNIT.unpack_from(buf, off)
        if offset < 0 or size <= 0:
            break
        n += 1
    return n


def test_one_input(data: bytes) -> None:
    from node.store.consume_queue import UNIT_SIZE, ConsumeQueue, count_valid_units

    assert count_valid_units(data) == _reference_valid_units(data)
    if not _state:
        _state["root"] = scratch_root(TARGET)
    root = _state["root"]
    shutil.rmtree(os.path.join(root, "consumequeue"), ignore_errors=True)
    d = os.path.join(root, "consumequeue", "T", "0")
    os.makedirs(d)
    capacity = UNITS * UNIT_SIZE
    with open(os.path.join(d, "0" * 20), "wb") as f:
        f.write(data[:capacity].ljust(capacity, b"\0"))
    cq = ConsumeQueue(_fs(), root, "T", 0, units_per_file=UNITS)
    try:
        end = cq.recover()
        assert 0 <= cq.min_offset <= end <= UNITS
        units = cq.get_range(cq.min_offset, UNITS)
        assert len(units) == end - cq.min_offset
        assert all(u[1] > 0 and u[0] >= 0 for u in units)
        cq.truncate_past_physical(1 << 20)
    finally:
        cq.close()


def main() -> None:
    from fuzz._common import run
    run(TARGET, test_one_input, MODULES)


if __name__ == "__main__":
    main()
