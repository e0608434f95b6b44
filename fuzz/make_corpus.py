"""Write the committed seed corpus `fuzz/corpus/<target>/` from the real encoders.

Run `python -m fuzz.make_corpus` after a format change; the seeds are a few KB per
target: valid encodings plus a few edge cases (empty, truncated, blank, oversize).
Each file is named by the sha1 of its content, so rerunning adds no duplicates.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile

import msgpack

from fuzz._common import CORPUS_ROOT


def _write(target: str, seeds: list[bytes]) -> None:
    d = os.path.join(CORPUS_ROOT, target)
    os.makedirs(d, exist_ok=True)
    for name in os.listdir(d):
        os.remove(os.path.join(d, name))
    for s in seeds:
        with open(os.path.join(d, hashlib.sha1(s).hexdigest()), "wb") as f:
            f.write(s)


def _records() -> list[bytes]:
    from node.store import message as M
    out = []
    for i, (body, props) in enumerate([(b"hello", {}), (b"x" * 40, {"TAGS": "paid", "KEYS": "k1 k2"}),
                                       (b"\xff\x00", {"UNIQ_KEY": "ABC", "DELAY": "3"})]):
        d = M.MessageDraft("Orders", i, body, props, born_timestamp=1_700_000_000_000).seal()
        out.append(M.encode_record(d, i, 4096 * i, 1_700_000_000_123, b"\x7f\x00\x00\x01", 10911))
    return out


def message() -> list[bytes]:
    from node.store import layout as L
    recs = _records()
    seeds = [b"\x01" + r for r in recs] + [b"\x00" + recs[1]]
    seeds += [b"", b"\x01", b"\x01" + recs[0][:50], b"\x00" + L.BLANK.pack(64, L.BLANK_MAGIC),
              b"\x00" + "7F00000100002A9F0000000000001000".encode()]
    return seeds


def _entries() -> list[bytes]:
    from dledger import entry as E
    from node.store import layout as L
    out, pos, chain = [], 0, 0
    for i, body in enumerate([b"", *_records()[:2]], start=1):
        magic = L.ENTRY_MAGIC_NOOP if not body else L.ENTRY_MAGIC_NORMAL
        raw = E.encode_entry(i, 1, pos, magic, body, chain)
        chain = E.decode_entry(raw, pos, chain).chain_crc
        out.append(raw)
        pos += len(raw)
    return out


def dledger_entry() -> list[bytes]:
    from dledger import entry as E
    first = E.encode_entry(1, 1, 0, 1, _records()[0], 0)
    later = _entries()[1]
    return [b"\x01" + first, b"\x00" + later, b"\x01" + E.encode_entry(1, 2, 0, 2, b"", 0),
            b"\x00" + E.encode_blank(64), b"", b"\x01" + first[:47], b"\x01" + first[:60]]


def ha_protocol() -> list[bytes]:
    from ha import protocol as P
    recs = b"".join(_records())
    pushes = P.encode_push(0, recs[:300]) + P.encode_push(300, b"") + P.encode_push(300, recs[300:600])
    reports = P.encode_report(0) + P.encode_report(4096) + P.encode_report(1 << 40)
    return [b"\x00" + pushes, b"\x05" + pushes, b"\x02" + reports, b"\x00" + P.encode_push(0, b"") * 3,
            b"\x00" + struct.pack(">qi", 0, 1 << 30), b"\x00" + struct.pack(">qi", -1, 0), b""]


def _raft_messages() -> list[object]:
    from dledger import messages as M
    e = [M.Entry(5, 2, M.EntryType.NORMAL, r) for r in _records()[:1]]
    e.append(M.Entry(6, 2, M.EntryType.NOOP, b""))
    return [M.RequestVote(3, "n1", 10, 2, True), M.VoteResponse(3, True, False), M.Heartbeat(2, "n0", 7),
            M.Compare(2, "n0", 4, 2, 3), M.Truncate(2, "n0", 4, 6, 2, 3),
            M.Append(2, "n0", 4, 2, tuple(e), 4), M.AppendResponse(2, True, 6, 6),
            M.CompareResponse(2, 4, False, 3, 1, 3, 2, 1), M.TimeoutNow(4, "n0")]


def raft_codec() -> list[bytes]:
    from dledger import codec
    seeds = [codec.encode(m) for m in _raft_messages()]
    return seeds + [msgpack.packb(["Append", 1, "n0", 0, 0, b"\x00" * 17, 0]), msgpack.packb(["Nope", 1]),
                    msgpack.packb([[1] * 3]), b"\x91\x91\x91\x91\x91\x91\x91\x91\xc0", b""]


def raft_transport() -> list[bytes]:
    from dledger import codec
    from dledger.transport import HANDSHAKE_MAGIC, PROTOCOL_VERSION, frame
    hello = frame(msgpack.packb([HANDSHAKE_MAGIC, PROTOCOL_VERSION, "g", "n1"]))
    frames = b"".join(frame(codec.encode(m)) for m in _raft_messages()[:4])
    return [hello + frames, hello + frame(codec.encode(_raft_messages()[5])), hello,
            frame(msgpack.packb([HANDSHAKE_MAGIC, PROTOCOL_VERSION, "other", "n1"])),
            frame(msgpack.packb([HANDSHAKE_MAGIC, PROTOCOL_VERSION, "g", ["n1"]])),
            hello + struct.pack(">I", 1 << 31), hello + frames[:30], b""]


def consume_queue() -> list[bytes]:
    from node.store import layout as L
    from node.store.consume_queue import BLANK_UNIT
    units = b"".join(L.CQ_UNIT.pack(i * 200, 150 + i, i * 7919) for i in range(20))
    return [units, BLANK_UNIT * 3 + units[:200], units[:100] + b"\xff" * 20 + units[120:200],
            units[:10], units + b"\x00" * 40 + units[:40], b""]


def index_file() -> list[bytes]:
    from node.store.fileio import FileSystem
    from node.store.index_file import IndexService
    root = tempfile.mkdtemp(prefix="mqstore-corpus-")
    try:
        svc = IndexService(FileSystem(), root, hash_slots=16, max_entries=32)
        svc.load()
        for i in range(20):
            svc.put("T", f"k{i % 7}", 1000 + i * 200, 1_700_000_000_000 + i * 1500)
        svc.flush()
        path = svc.files[0].path
        svc.close()
        with open(path, "rb") as f:
            raw = f.read()
    finally:
        shutil.rmtree(root)
    end = struct.pack(">q", 1 << 40)
    return [end + raw, struct.pack(">q", 2500) + raw, b"\x00" * 8 + raw[:40], end + raw[:300], b""]


def entry_store() -> list[bytes]:
    from dledger.entry_store import EntryStore
    from dledger.messages import Entry, EntryType
    from node.store.fileio import FileSystem
    root = tempfile.mkdtemp(prefix="mqstore-corpus-")
    try:
        store = EntryStore(FileSystem(), root, "n0", data_segment_size=4096, index_segment_size=1024)
        store.recover()
        store.append([Entry(1, 1, EntryType.NOOP, b"")] +
                     [Entry(i, 1 + i // 4, EntryType.NORMAL, b"body-%d" % i * 20) for i in range(2, 12)])
        store.flush()
        store.close()
        base = os.path.join(root, "dledger-n0")
        with open(os.path.join(base, "data", "0" * 20), "rb") as f:
            data = f.read().rstrip(b"\0")
        with open(os.path.join(base, "index", "0" * 20), "rb") as f:
            index = f.read().rstrip(b"\0")
    finally:
        shutil.rmtree(root)
    pad = data + b"\0" * (-len(data) % 16)
    return [struct.pack(">H", len(pad)) + pad + index, struct.pack(">H", len(pad)) + pad,
            struct.pack(">H", len(pad)) + pad + index[:100], struct.pack(">H", 300) + pad[:300] + index,
            struct.pack(">H", 4096) + b"\xff" * 16, b""]


def rest_api() -> list[bytes]:
    send = {"messages": [{"body": "hello", "tags": "a", "keys": ["k1"], "queue_id": 0},
                         {"body_b64": "aGk=", "properties": {"p": "v"}, "born_timestamp": 5}]}
    bin_send = {"messages": [{"body": b"\x00\x01", "keys": "k1 k2"}, {"body": "x", "queue_id": True}]}
    return [b"\x00" + json.dumps(send).encode(), b"\x01" + msgpack.packb(bin_send, use_bin_type=True),
            b"\x00" + b'{"topic": "T", "queues": 4}', b"\x00[1,2]", b"\x00{\"messages\": 3}",
            b"\x01" + msgpack.packb({"messages": [{"body": "a", "keys": [1]}]}), b"\x00", b""]


def rest_app() -> list[bytes]:
    from node.api import ROUTES
    routes = sorted((m, p) for m, p, _h in ROUTES if p not in ("/metrics", "/cluster/nodes"))

    def at(method: str, path: str) -> int:
        return routes.index((method, path))
    send = json.dumps({"messages": [{"body": "hi", "tags": "a", "keys": ["k1"], "properties": {"p": "v"}}]})
    seeds = [bytes([at("POST", "/topics/{topic}/messages"), 0]) + send.encode(),
             bytes([at("POST", "/topics/{topic}/messages"), 1]) + msgpack.packb(
                 {"messages": [{"body": b"\x00\x01", "queue_id": 1}]}, use_bin_type=True),
             bytes([at("POST", "/topics"), 0]) + b'{"topic": "U", "queues": 2}',
             bytes([at("POST", "/groups/{group}/offsets"), 0]) + b'{"topic": "T", "queue_id": 0, "offset": 1}',
             bytes([at("GET", "/topics/{topic}/queues/{queue_id}/messages"), 0]) + b"offset=0&max=4&tags=a",
             bytes([at("GET", "/topics/{topic}/messages"), 2]) + b"key=k&begin=0&max=2",
             bytes([at("POST", "/groups/{group}/heartbeat"), 0]) + b'{"client_id": "c1", "topics": ["T"]}',
             bytes([at("POST", "/groups/{group}/lock"), 0]) + b'{"client_id": "c1", "queues": [{"topic": "T", "queue_id": 0}]}',
             bytes([at("POST", "/transactions/end"), 0]) + b'{"producer_group": "P", "offset_msg_id": "00", "action": "COMMIT"}',
             bytes([at("GET", "/topics/{topic}"), 4]) + b"bad.name/x",
             bytes([at("GET", "/health"), 2])]
    return seeds


def produce_stream() -> list[bytes]:
    from node import stream_frames as F
    send = F.encode(F.SEND, 1, {"topic": "T", "messages": [{"body": b"hello", "tags": "a"}]})
    batch = F.encode(F.SEND, 2, {"topic": "T", "messages": [{"body": b"x" * 100, "queue_id": i,
                                                              "keys": ["k"], "properties": {"p": "v"}}
                                                             for i in range(8)]})
    hello = F.encode(F.HELLO, 0, {})
    return [b"\x00" + hello + send + batch, b"\x07" + send * 3, b"\x00" + F.encode(F.SEND, 3, {"topic": "bad name"}),
            b"\x00" + F.HEADER.pack(1 << 30, F.SEND, 1), b"\x00" + F.HEADER.pack(3, 99, 1) + b"abc",
            b"\x02" + F.HEADER.pack(2, F.SEND, 4) + b"\xc1\xc1", b""]


TARGETS = {f.__name__: f for f in (message, dledger_entry, ha_protocol, raft_codec, raft_transport,
                                    consume_queue, index_file, entry_store, rest_api, rest_app, produce_stream)}


def main() -> None:
    for name, make in TARGETS.items():
        seeds = make()
        _write(name, seeds)
        print(f"{name}: {len(seeds)} seeds, {sum(map(len, seeds))} bytes")


if __name__ == "__main__":
    main()
