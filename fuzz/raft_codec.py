"""Fuzz the Raft message codec (dledger/codec.py).

Input: a frame payload. Allowed error: CodecError (a ValueError). A payload that
decodes must survive encode -> decode unchanged. The same bytes are also tried as
the entries blob of an Append.
"""

from __future__ import annotations

TARGET = "raft_codec"
MODULES = ("dledger.codec",)


def test_one_input(data: bytes) -> None:
    from dledger import codec

    try:
        msg = codec.decode(data)
    except codec.CodecError:
        msg = None
    if msg is not None:
        assert codec.decode(codec.encode(msg)) == msg, "message does not round-trip"
    try:
        entries = codec.decode_append_entries(data, 0)
    except codec.CodecError:
        return
    assert [e.index for e in entries] == list(range(1, len(entries) + 1))


def main() -> None:
    from fuzz._common import run
    run(TARGET, test_one_input, MODULES)


if __name__ == "__main__":
    main()
