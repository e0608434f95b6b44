"""The one CRC-32 every record uses (zlib polynomial, the value zlib.crc32 returns).

`crc32(data, value=0)` is python-isal's ISA-L implementation when it imports (about
twice as fast per KiB as zlib here) and zlib's otherwise. Both give the same value for
the same bytes and seed, including the running form `crc32(more, crc32(first))`, so the
choice changes no byte on disk or on the wire. `IMPLEMENTATION` names the one in use.
"""

from __future__ import annotations

import zlib

try:
    from isal.isal_zlib import crc32
    IMPLEMENTATION = "isal"
except ImportError:  # pragma: no cover - exercised only without python-isal installed
    crc32 = zlib.crc32
    IMPLEMENTATION = "zlib"

__all__ = ["crc32", "IMPLEMENTATION"]
