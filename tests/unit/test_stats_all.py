"""statsAll's figures on a node: per topic the messages sent to it, per topic and consumer group
the messages the group pulled from it, each as the last minute's TPS and the last day's count
(RocketMQ BrokerStatsManager's TOPIC_PUT_NUMS and GROUP_GET_NUMS), and each group's
accumulation.

Method: `Window` and `TrafficStats` on a hand-driven clock (slots expire, the current 10-second
period is not in the TPS, the day is 24 hourly slots); then a real standalone broker in a temp
dir (sends, pulls naming a group and not, a committed offset) and its `GET /stats` route.
"""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer

from node.api import make_app
from node.broker import OutgoingMessage
from node.config import BrokerConfig
from node.metrics import TrafficStats, Window
from node.server import build_broker

H = 3600.0


def test_window_tps_is_the_last_whole_minute_and_the_day_is_24_hours():
    w, t0 = Window(), 1_000_000 * H          # on an hour's start
    w.add(600, t0 + 5)
    assert w.tps(t0 + 9) == 0.0, "the current 10-second period is not counted yet"
    assert w.tps(t0 + 10) == 10.0 and w.tps(t0 + 69) == 10.0
    assert w.tps(t0 + 70) == 0.0, "older than a minute"
    w.add(40, t0 + 2 * H)
    assert w.day_sum(t0 + 2 * H) == 640
    assert w.day_sum(t0 + 23 * H + 1) == 640
    assert w.day_sum(t0 + 24 * H) == 40, "the first hour's slot is older than a day"
    w.add(1, t0 + 24 * H + 5)                  # reuses the first hour's slot
    assert w.day_sum(t0 + 24 * H + 5) == 41


def test_traffic_counts_puts_per_topic_and_gets_per_topic_and_group():
    now = [1_000_000 * H]
    t = TrafficStats(clock=lambda: now[0], wall_clock=lambda: now[0])
    t.sent("A", 30, 3000)
    t.pulled("A", 20, 2000, "g1")
    t.pulled("A", 5, 500)                       # a pull that named no group counts only in the totals
    t.pulled("A", 7, 700, "g2")
    now[0] += 10
    assert t.put_stats("A") == (0.5, 30) and t.put_stats("B") == (0.0, 0)
    tps, day = t.get_stats("A", "g1")
    assert abs(tps - 20 / 60) < 1e-9 and day == 20
    assert t.groups_pulling() == {"A": {"g1", "g2"}}
    assert t.out_messages["A"] == 32
    assert abs(t.group_tps("g1") - 20 / 60) < 1e-9


def _config(root: str) -> BrokerConfig:
    return BrokerConfig(store_path_root_dir=root, mapped_file_size_commit_log=72 * 1024,
                        max_message_size=4096).validate()


def test_stats_all_on_a_broker_and_its_route(tmp_path):
    async def main():
        b = build_broker(_config(str(tmp_path)))
        await b.start()
        client = TestClient(TestServer(make_app(b)))
        await client.start_server()
        try:
            await b.create_topic("Orders", 2)
            await b.create_topic("Quiet", 1)
            await b.send("Orders", [OutgoingMessage(f"m{i}".encode(), queue_id=0) for i in range(5)])
            for _ in range(200):
                if b.dispatcher.position >= b.log.committed_position:
                    break
                await asyncio.sleep(0.01)
            got = await b.pull("Orders", 0, 0, 3, group="g1")
            assert len(got.messages) == 3
            await b.commit_offset("g1", "Orders", 0, 3)
            await b.pull("Orders", 0, 0, 32, group="g2")           # pulls, never commits
            await b.pull("Orders", 0, 0, 32)                       # names no group
            rows = {r["topic"]: r for r in b.stats_all()}
            assert set(rows) == {"Orders", "Quiet"}, "no system, %RETRY% or %DLQ% topic"
            assert rows["Orders"]["in_msg_24h"] == 5 and rows["Quiet"] == {
                "topic": "Quiet", "in_tps": 0.0, "in_msg_24h": 0, "groups": []}
            groups = {g["group"]: g for g in rows["Orders"]["groups"]}
            assert groups["g1"]["accumulation"] == 2 and groups["g1"]["out_msg_24h"] == 3
            assert groups["g2"]["accumulation"] == 5 and groups["g2"]["out_msg_24h"] == 5
            resp = await client.get("/stats", params={"topic": "Orders"})
            assert resp.status == 200
            doc = await resp.json()
            assert [t["topic"] for t in doc["topics"]] == ["Orders"] and doc["topics"][0]["groups"] == \
                rows["Orders"]["groups"]
            resp = await client.get("/stats", params={"topic": "Nope"})
            assert resp.status == 404
            resp = await client.get("/topics/Orders/queues/0/messages", params={"offset": 0, "group": "bad group"})
            assert resp.status == 400, "a group name is checked as a commit's is"
        finally:
            await client.close()
            await b.stop()

    asyncio.run(main())
