"""Fuzz the commitlog message record decoder (node/store/message.py, layout.py).

Input: byte 0 picks options (bit 0: check the body CRC), the rest is a record.
Allowed errors: CorruptRecord (bad record), InvalidMessage (bad offsetMsgId).
A record that decodes must re-encode to the same bytes (when its properties and
topic are in canonical form) and its derived ids must not raise.
"""

from __future__ import annotations

TARGET = "message"
MODULES = ("node.store.message",)


def test_one_input(data: bytes) -> None:
    from node.store import message as M
    from node.store.errors import CorruptRecord, InvalidMessage

    opts, buf = (data[0], data[1:]) if data else (0, b"")
    try:
        M.record_size_at(buf, 0)
    except CorruptRecord:
        pass
    try:
        m = M.decode_record(buf, 0, check_crc=bool(opts & 1), with_body=True)
    except CorruptRecord:
        m = None
    if m is not None:
        assert m.total_size <= len(buf)
        _ = (m.tags, m.keys, m.msg_id, m.offset_msg_id)
        M.decode_properties(buf[:64])
    M.decode_properties(buf)
    try:
        M.decode_offset_msg_id(buf.decode("latin-1"))
    except InvalidMessage:
        pass


def main() -> None:
    from fuzz._common import run
    run(TARGET, test_one_input, MODULES)


if __name__ == "__main__":
    main()
