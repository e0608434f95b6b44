"""Fuzz the DLedger entry codec (dledger/entry.py).

Input: byte 0 picks options (bit 0: check the chain CRC, seeded with 0), the rest
is an entry. The position passed in is the one the header records, so the decoder
gets past that check. Allowed error: CorruptRecord. An entry that decodes must
re-encode to the same bytes (channel field aside, which the decoder ignores).
"""

from __future__ import annotations

TARGET = "dledger_entry"
MODULES = ("dledger.entry",)


def test_one_input(data: bytes) -> None:
    from dledger import entry as E
    from node.store import layout as L
    from node.store.errors import CorruptRecord

    opts, buf = (data[0], data[1:]) if data else (0, b"")
    try:
        E.peek_magic_size(buf, 0)
    except CorruptRecord:
        pass
    pos = int.from_bytes(buf[24:32], "big", signed=True) if len(buf) >= 32 else 0
    chained = bool(opts & 1)
    try:
        d = E.decode_entry(buf, pos, 0 if chained else None, 0)
    except CorruptRecord:
        return
    assert d.size == E.HEADER_SIZE + len(d.body) <= len(buf)
    if chained and d.pos >= 0:
        again = E.encode_entry(d.index, d.term, d.pos, d.magic, d.body, 0)
        chan = L.ENTRY_FIELD_OFFSET["channel"]
        original = bytes(buf[:d.size])
        assert again[:chan] + again[chan + 4:] == original[:chan] + original[chan + 4:], "entry does not round-trip"


def main() -> None:
    from fuzz._common import run
    run(TARGET, test_one_input, MODULES)


if __name__ == "__main__":
    main()
