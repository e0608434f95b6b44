"""Classic HA wire codec (pure: no asyncio, no sockets).

Two one-way byte streams share a TCP connection (RocketMQ HAConnection/HAClient):

    slave  -> master : report* ;   report = max_offset:int64                      (8 bytes)
    master -> slave  : push*   ;   push   = offset:int64 size:int32 data[size]    (12 + size)

`size == 0` is a heartbeat. `size` is capped (32 KiB by default) and the cap is
checked on the header, before any body byte is buffered, so a garbage or hostile
header cannot make the decoder allocate. Layouts come from node.store.layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from node.store import layout as L
from node.store.errors import StoreError

REPORT_SIZE = L.HA_SLAVE_REPORT.size
PUSH_HEADER_SIZE = L.HA_PUSH_HEADER.size
assert REPORT_SIZE == 8
assert PUSH_HEADER_SIZE == 12


class HAProtocolError(StoreError):
    """The peer sent bytes that are not a valid HA frame: drop the link (reconnecting may help)."""

    code = "HA_PROTOCOL"
    retriable = True


@dataclass(frozen=True, slots=True)
class Report:
    """Slave -> master: everything below `max_offset` is stored on the slave."""

    max_offset: int

    def __post_init__(self) -> None:
        if self.max_offset < 0:
            raise HAProtocolError(f"slave report with negative offset {self.max_offset}")


@dataclass(frozen=True, slots=True)
class Push:
    """Master -> slave: `data` is the master's commitlog bytes at [offset, offset+len(data))."""

    offset: int
    data: bytes

    def __post_init__(self) -> None:
        if self.offset < 0:
            raise HAProtocolError(f"push with negative offset {self.offset}")

    @property
    def is_heartbeat(self) -> bool:
        return not self.data

    @property
    def end(self) -> int:
        return self.offset + len(self.data)


def encode_report(max_offset: int) -> bytes:
    assert max_offset >= 0
    return L.HA_SLAVE_REPORT.pack(max_offset)


def encode_push(offset: int, data: bytes | memoryview, max_body_bytes: int = L.HA_MAX_TRANSFER_BYTES) -> bytes:
    assert offset >= 0
    assert len(data) <= max_body_bytes, "caller must split pushes at the transfer cap"
    return L.HA_PUSH_HEADER.pack(offset, len(data)) + bytes(data)


class ReportDecoder:
    """Incremental decoder of the slave's 8-byte reports. Buffers at most 7 bytes between feeds."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Report]:
        self._buf += data
        n = len(self._buf) // REPORT_SIZE
        out = [Report(L.HA_SLAVE_REPORT.unpack_from(self._buf, i * REPORT_SIZE)[0]) for i in range(n)]
        del self._buf[: n * REPORT_SIZE]
        assert len(self._buf) < REPORT_SIZE
        return out

    @property
    def pending(self) -> int:
        return len(self._buf)


class PushDecoder:
    """Incremental decoder of master pushes with a body-size cap.

    The buffer never holds more than one header, one capped body and the
    unconsumed rest of the last feed; a header claiming more than the cap (or a
    negative size/offset) raises HAProtocolError before its body is read.
    """

    def __init__(self, max_body_bytes: int = L.HA_MAX_TRANSFER_BYTES):
        assert max_body_bytes > 0
        self.max_body_bytes = max_body_bytes
        self._buf = bytearray()
        self._header: tuple[int, int] | None = None   # (offset, size) of the push being read

    def feed(self, data: bytes) -> list[Push]:
        self._buf += data
        out: list[Push] = []
        # Bounded: each pass consumes at least a 12-byte header from a finite buffer.
        while True:
            if self._header is None:
                if len(self._buf) < PUSH_HEADER_SIZE:
                    return out
                self._header = self._check_header(*L.HA_PUSH_HEADER.unpack_from(self._buf, 0))
                del self._buf[:PUSH_HEADER_SIZE]
            offset, size = self._header
            if len(self._buf) < size:
                return out
            out.append(Push(offset, bytes(self._buf[:size])))
            del self._buf[:size]
            self._header = None

    def _check_header(self, offset: int, size: int) -> tuple[int, int]:
        if size < 0 or size > self.max_body_bytes:
            raise HAProtocolError(f"push header claims {size} bytes; the cap is {self.max_body_bytes}")
        if offset < 0:
            raise HAProtocolError(f"push header with negative offset {offset}")
        return offset, size

    @property
    def pending(self) -> int:
        """Bytes received but not yet returned as a Push (a torn frame at connection close)."""
        return len(self._buf) + (PUSH_HEADER_SIZE if self._header is not None else 0)
