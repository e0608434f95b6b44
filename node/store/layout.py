"""Every binary record mqstore writes, declared once.

One `struct.Struct` per record, one field per line, offsets derived with
`calcsize`, sizes asserted at import. Integers are big-endian (RocketMQ's
ByteBuffer order). No other module holds a format string: the node, the
DLedger entry store, the HA protocol and the Spark pipeline all import this.
See docs/formats.md for the grammar of each file.
"""

from __future__ import annotations

import struct


def _layout(*fields: tuple[str, str]) -> tuple[struct.Struct, dict[str, int]]:
    """Build a big-endian Struct from (name, code) pairs; return it with field offsets."""
    fmt = ">"
    offsets: dict[str, int] = {}
    for name, code in fields:
        offsets[name] = struct.calcsize(fmt)
        fmt += code
    return struct.Struct(fmt), offsets


# --- Commitlog message record (RocketMQ MessageDecoder V1, IPv4 hosts) -----------------
# The fixed part; BODY, TOPICLEN(1)+TOPIC, PROPERTIESLEN(2)+PROPERTIES follow.
MESSAGE_HEADER, MESSAGE_FIELD_OFFSET = _layout(
    ("total_size", "i"),        # whole record, this field included
    ("magic", "I"),             # MESSAGE_MAGIC
    ("body_crc", "I"),          # zlib.crc32(body)
    ("queue_id", "i"),
    ("flag", "i"),              # user flag, opaque
    ("queue_offset", "q"),      # logical offset in its consume queue
    ("physical_offset", "q"),   # where this record starts in the commitlog (body offset in DLedger)
    ("sys_flag", "i"),          # SYSFLAG_* bits below
    ("born_timestamp", "q"),    # ms, producer clock
    ("born_ip", "4s"),          # IPv4 of the producer
    ("born_port", "I"),
    ("store_timestamp", "q"),   # ms, stamped by the (leader) broker before append
    ("store_ip", "4s"),         # IPv4 of the storing broker
    ("store_port", "I"),
    ("reconsume_times", "i"),
    ("prepared_tx_offset", "q"),
    ("body_len", "i"),
)
assert MESSAGE_HEADER.size == 88
TOPIC_LEN = struct.Struct(">B")
PROPERTIES_LEN = struct.Struct(">H")
# A view of the header from queue_id through body_len (fields between skipped as pad bytes):
# queue_id, queue_offset, sys_flag, body_len in one unpack, for code walking many records.
MESSAGE_QUEUE_FIELDS = struct.Struct(">i{}xq{}xi{}xi".format(
    MESSAGE_FIELD_OFFSET["queue_offset"] - MESSAGE_FIELD_OFFSET["queue_id"] - 4,
    MESSAGE_FIELD_OFFSET["sys_flag"] - MESSAGE_FIELD_OFFSET["queue_offset"] - 8,
    MESSAGE_FIELD_OFFSET["body_len"] - MESSAGE_FIELD_OFFSET["sys_flag"] - 4))
assert MESSAGE_QUEUE_FIELDS.size == MESSAGE_FIELD_OFFSET["body_len"] + 4 - MESSAGE_FIELD_OFFSET["queue_id"]


def view(layout: dict[str, int], codes: dict[str, str], fields: tuple[str, ...]) -> struct.Struct:
    """A Struct reading only `fields` (in layout order) of a record, the bytes between skipped."""
    fmt, at = ">", 0
    for name in fields:
        gap = layout[name] - at
        assert gap >= 0, name
        fmt += f"{gap}x" if gap else ""
        fmt += codes[name]
        at = layout[name] + struct.calcsize(">" + codes[name])
    return struct.Struct(fmt)


# The fields the dispatcher reads per record, in one unpack from the record's start:
# total_size, magic, queue_id, queue_offset, physical_offset, sys_flag, store_timestamp, body_len.
MESSAGE_DISPATCH_FIELDS = view(MESSAGE_FIELD_OFFSET, {
    "total_size": "i", "magic": "I", "queue_id": "i", "queue_offset": "q", "physical_offset": "q",
    "sys_flag": "i", "store_timestamp": "q", "body_len": "i"}, (
    "total_size", "magic", "queue_id", "queue_offset", "physical_offset", "sys_flag", "store_timestamp",
    "body_len"))
assert MESSAGE_DISPATCH_FIELDS.size == MESSAGE_HEADER.size
# 88 fixed + 1 topic length + 2 properties length.
MESSAGE_OVERHEAD = MESSAGE_HEADER.size + TOPIC_LEN.size + PROPERTIES_LEN.size
assert MESSAGE_OVERHEAD == 91

MESSAGE_MAGIC = 0xDAA320A7       # MessageDecoder.MESSAGE_MAGIC_CODE (V1)
BLANK_MAGIC = 0xCBD43194         # CommitLog.BLANK_MAGIC_CODE: end-of-file filler

# End-of-file blank: TOTALSIZE = bytes left in the file, then BLANK_MAGIC.
BLANK, _ = _layout(
    ("total_size", "i"),
    ("magic", "I"),
)
assert BLANK.size == 8
END_FILE_MIN_BLANK_LENGTH = BLANK.size

# SYSFLAG bits (MessageSysFlag).
SYSFLAG_COMPRESSED = 0x1
SYSFLAG_MULTI_TAGS = 0x2
SYSFLAG_TRANSACTION_NOT_TYPE = 0x0
SYSFLAG_TRANSACTION_PREPARED_TYPE = 0x1 << 2
SYSFLAG_TRANSACTION_COMMIT_TYPE = 0x2 << 2
SYSFLAG_TRANSACTION_ROLLBACK_TYPE = 0x3 << 2
SYSFLAG_TRANSACTION_MASK = 0x3 << 2

# Properties: name \x01 value \x02, repeated.
NAME_VALUE_SEPARATOR = "\x01"
PROPERTY_SEPARATOR = "\x02"

# --- DLedger entry (header + body) ----------------------------------------------------
ENTRY_HEADER, ENTRY_FIELD_OFFSET = _layout(
    ("magic", "i"),             # ENTRY_MAGIC_*; -1 marks an end-of-file blank
    ("size", "i"),              # header + body
    ("index", "q"),             # Raft index, consecutive from the log's first
    ("term", "q"),              # Raft term, non-decreasing along the log
    ("pos", "q"),               # absolute offset of this entry in the data segments
    ("channel", "i"),           # reserved, 0
    ("chain_crc", "I"),         # crc32(header[0:36] + body_crc), seeded with the previous chain_crc
    ("body_crc", "I"),          # crc32(body)
    ("body_size", "i"),
)
assert ENTRY_HEADER.size == 48
ENTRY_CHAIN_CRC_SPAN = ENTRY_FIELD_OFFSET["chain_crc"]   # header bytes covered by chain_crc
assert ENTRY_CHAIN_CRC_SPAN == 36
ENTRY_MAGIC_NORMAL = 1
ENTRY_MAGIC_NOOP = 2
ENTRY_MAGIC_CONFIG = 3
ENTRY_MAGIC_BLANK = -1

# End-of-file blank in DLedger data segments: magic -1, size = bytes left.
ENTRY_BLANK, _ = _layout(
    ("magic", "i"),
    ("size", "i"),
)
assert ENTRY_BLANK.size == 8

# DLedger index file: one entry per Raft index at (index - first) * 32.
ENTRY_INDEX, _ = _layout(
    ("magic", "i"),
    ("pos", "q"),
    ("size", "i"),
    ("index", "q"),
    ("term", "q"),
)
assert ENTRY_INDEX.size == 32

# DLedger base state: dledger-<id>/base-<20-digit base index>.state, and InstallBase.state
# on the wire. This header, then the broker's state as of the base (its queue-offset table).
ENTRY_BASE_STATE, _ = _layout(
    ("base_pos", "q"),          # where entry base_index + 1 starts
    ("base_chain", "I"),        # chain CRC of entry base_index: entry base_index + 1 chains from it
    ("state_crc", "I"),         # crc32 of the state bytes that follow
)
assert ENTRY_BASE_STATE.size == 16
# The header as written before base_chain was added (read only; its chain is taken as 0).
ENTRY_BASE_STATE_V1, _ = _layout(
    ("base_pos", "q"),
    ("state_crc", "I"),
)
assert ENTRY_BASE_STATE_V1.size == 12

# --- Consume queue unit -----------------------------------------------------------------
CQ_UNIT, _ = _layout(
    ("commitlog_offset", "q"),  # body offset of the message record
    ("size", "i"),              # record size
    ("tags_code", "q"),         # Java String.hashCode of TAGS (delivery time for delay msgs)
)
assert CQ_UNIT.size == 20
CQ_UNITS_PER_FILE = 300_000

# --- Index file (IndexService) ------------------------------------------------------------
INDEX_HEADER, _ = _layout(
    ("begin_timestamp", "q"),
    ("end_timestamp", "q"),
    ("begin_phy_offset", "q"),
    ("end_phy_offset", "q"),
    ("hash_slot_count", "i"),   # slots in use
    ("index_count", "i"),       # entries written + 1 (entry 0 is never used)
)
assert INDEX_HEADER.size == 40
INDEX_SLOT, _ = _layout(
    ("index_no", "i"),          # newest entry number in this slot, 0 = empty
)
assert INDEX_SLOT.size == 4
INDEX_ENTRY, _ = _layout(
    ("key_hash", "i"),          # abs(java hashCode of "topic#key")
    ("phy_offset", "q"),
    ("time_diff", "i"),         # seconds since begin_timestamp
    ("prev_index", "i"),        # previous entry in the same slot, 0 = end of chain
)
assert INDEX_ENTRY.size == 20
INDEX_SLOTS_DEFAULT = 5_000_000
INDEX_ENTRIES_DEFAULT = 20_000_000

# --- Checkpoint ---------------------------------------------------------------------------
CHECKPOINT, _ = _layout(
    ("physic_msg_timestamp", "q"),  # store time of the last flushed commitlog message
    ("logics_msg_timestamp", "q"),  # ... of the last flushed consume-queue unit
    ("index_msg_timestamp", "q"),   # ... of the last flushed index file
    ("committed_offset", "q"),      # (ours) log offset known committed at flush time
    ("crc", "I"),                   # (ours) crc32 of the bytes above
)
assert CHECKPOINT.size == 36

# --- offsetMsgId: store ip 4 + port 4 + commit offset 8 -> 32 hex chars -------------------
MSG_ID, _ = _layout(
    ("ip", "4s"),
    ("port", "I"),
    ("offset", "q"),
)
assert MSG_ID.size == 16

# --- Classic HA wire ----------------------------------------------------------------------
HA_PUSH_HEADER, _ = _layout(
    ("offset", "q"),            # master commitlog offset of the first byte that follows
    ("size", "i"),              # bytes that follow; 0 = heartbeat
)
assert HA_PUSH_HEADER.size == 12
HA_SLAVE_REPORT, _ = _layout(
    ("max_offset", "q"),        # slave's max commitlog offset
)
assert HA_SLAVE_REPORT.size == 8
HA_MAX_TRANSFER_BYTES = 32 * 1024

# --- Length-prefixed peer frames (Raft, controller) -----------------------------------------
FRAME_LEN, _ = _layout(
    ("length", "I"),            # bytes of payload that follow; checked against a cap before reading
)
assert FRAME_LEN.size == 4

# --- Produce stream frames (the client's pipelined send channel, streamListenPort) -----------
STREAM_FRAME_HEADER, _ = _layout(
    ("length", "I"),            # bytes of msgpack payload that follow; checked against a cap first
    ("kind", "B"),              # node/stream_frames.py: HELLO, HELLO_OK, SEND, RESULT, ERROR
    ("request_id", "I"),        # chosen by the client; a RESULT or ERROR names the request it answers
)
assert STREAM_FRAME_HEADER.size == 9

# --- Limits (DESIGN section 3) ---------------------------------------------------------------
MAX_BODY_BYTES_DEFAULT = 4 * 1024 * 1024
MAX_PROPERTIES_BYTES = 32_767
MAX_TOPIC_CHARS = 127
MAX_GROUP_CHARS = 120
