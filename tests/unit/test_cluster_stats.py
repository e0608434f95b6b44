"""What a node reports for mqadmin clusterList's #PCWait and #Hour columns.

Method: a real standalone broker (LocalLog, SYNC_FLUSH so an append waits for its fsync) in a
temp dir: before any message the log is empty (no earliest time, no wait); after sends the
earliest store time is the first record's and lies between the clocks read around the send;
the put wait is the longest append of the window; the CLI renders both from /cluster's shape.
"""

from __future__ import annotations

import asyncio
import time

from mqstore import cli
from node.broker import PUT_WAIT_WINDOW_S, OutgoingMessage
from node.config import BrokerConfig
from node.server import build_broker


def test_cluster_reports_put_wait_and_earliest_store_time(tmp_path, monkeypatch):
    cfg = BrokerConfig(store_path_root_dir=str(tmp_path), mapped_file_size_commit_log=72 * 1024,
                       max_message_size=4096, flush_disk_type="SYNC_FLUSH").validate()

    async def main():
        b = build_broker(cfg)
        await b.start()
        try:
            doc = b.cluster()
            assert doc["put_wait_ms"] == 0 and doc["earliest_store_timestamp"] is None
            await b.create_topic("T", 1)           # a system record: the log's first record
            t0 = int(time.time() * 1000)
            await b.send("T", [OutgoingMessage(body=b"x" * 100) for _ in range(20)])
            t1 = int(time.time() * 1000)
            doc = b.cluster()
            earliest = doc["earliest_store_timestamp"]
            assert earliest is not None and earliest <= t1
            first = b.log.scan(b.log.min_position, 1).records[0]
            assert earliest == int.from_bytes(first.data[56:64], "big")   # the oldest record's store time
            assert isinstance(doc["put_wait_ms"], int) and 0 <= doc["put_wait_ms"] <= t1 - t0 + 1
            b._put_wait = (0.25, time.monotonic())
            assert b.cluster()["put_wait_ms"] == 250
            b._put_wait = (0.25, time.monotonic() - PUT_WAIT_WINDOW_S - 1)   # older than the window
            assert b.cluster()["put_wait_ms"] == 0
            nodes = {"cluster": "c", "group": "g", "nodes": [
                {"node_id": "n", "api": "h:1", "reachable": True, "cluster": {**doc, "put_wait_ms": 12}}]}
            row = cli.cluster_list_table(nodes, now=earliest + 2 * 3_600_000 + 36_000).splitlines()[1].split()
            assert row[7:9] == ["12", "2.01"]
        finally:
            await b.stop()

    asyncio.run(main())
