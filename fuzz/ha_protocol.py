"""Fuzz the classic-HA stream decoders (ha/protocol.py).

Input: byte 0 is the number of chunks the rest is fed in (1..16, equal cuts) to
both PushDecoder (cap 1 KiB) and ReportDecoder. Allowed error: HAProtocolError.
Checks: the buffered bytes stay within one header + one capped body + the last
feed, every push is within the cap, and reports are exactly the 8-byte words.
"""

from __future__ import annotations

TARGET = "ha_protocol"
MODULES = ("ha.protocol",)
CAP = 1024


def _chunks(buf: bytes, n: int) -> list[bytes]:
    step = max(1, -(-len(buf) // n))
    return [buf[i:i + step] for i in range(0, len(buf), step)] or [b""]


def test_one_input(data: bytes) -> None:
    from ha import protocol as P

    n, buf = ((data[0] % 16) + 1, data[1:]) if data else (1, b"")
    pushes = P.PushDecoder(max_body_bytes=CAP)
    try:
        for chunk in _chunks(buf, n):
            for p in pushes.feed(chunk):
                assert len(p.data) <= CAP and p.offset >= 0
            assert pushes.pending <= P.PUSH_HEADER_SIZE + CAP + len(chunk)
    except P.HAProtocolError:
        pass
    reports = P.ReportDecoder()
    got = []
    for chunk in _chunks(buf, n):
        try:
            got += [r.max_offset for r in reports.feed(chunk)]
        except P.HAProtocolError:
            break   # a negative offset: the link is dropped
        assert reports.pending < P.REPORT_SIZE
    else:
        words = len(buf) // P.REPORT_SIZE
        assert got == [int.from_bytes(buf[i * 8:i * 8 + 8], "big", signed=True) for i in range(words)]


def main() -> None:
    from fuzz._common import run
    run(TARGET, test_one_input, MODULES)


if __name__ == "__main__":
    main()
