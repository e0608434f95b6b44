"""DLedger repair counters on /metrics: repaired entries, failed fetches, entries waiting.

Goal: what dledger/repair.py's Repairer did shows in a scrape of the node's registry as
rocketmq_store_repaired_entries_total, rocketmq_store_repair_failures_total,
rocketmq_store_repair_pending_entries and rocketmq_store_repair_served_fetches_total; a
node without a repairer (standalone, classic) has none of them. Method: the test_broker
harness; its log is given a real Repairer whose peers refuse, then answer with an entry
whose write is stubbed, driven through Repairer._repair_one; the registry is read with
prometheus_client's parser. The end-to-end count after a real repair is asserted in
tests/integration/test_dledger_repair.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dledger import repair as R
from node.metrics import node_registry
from node.store.scrub import CorruptRange
from tests.unit.test_broker import make_broker


def scrape(broker) -> dict[str, float]:
    text = generate_latest(node_registry(broker)).decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


def test_repair_counters_follow_the_repairer(tmp_path, monkeypatch):
    async def go():
        h = make_broker(str(tmp_path))
        await h.broker.start()
        try:
            assert "rocketmq_store_repaired_entries_total" not in scrape(h.broker)   # no repairer here
            registry = h.broker.corruption
            rec = SimpleNamespace(index=5, size=100, pos=1000)
            gate = asyncio.Lock()
            dlog = SimpleNamespace(store=SimpleNamespace(entry_at=lambda i: rec), _leader_id="n1",
                                   on_repaired=lambda r, rec, raw, how: registry.clear(r.start, how),
                                   node=SimpleNamespace(flushes_held=lambda: gate))
            repairer = R.Repairer(dlog, registry, ["n1", "n2"])
            h.log.repairer = repairer
            registry.report(CorruptRange("seg", 1000, 1100, 1, 2, "scrub", "entry body crc mismatch", 5))
            registry.report(CorruptRange("seg", 5000, 9000, None, None, "scrub", "entry framing lost"))

            async def refuse(peer, index, count=1):
                raise R.RepairError("peer refused: busy")
            repairer.fetch = refuse
            assert not await repairer._repair_one(registry.ranges()[0])
            s = scrape(h.broker)
            assert s["rocketmq_store_repair_failures_total"] == 2          # both peers refused
            assert s["rocketmq_store_repaired_entries_total"] == 0
            assert s["rocketmq_store_repair_pending_entries"] == 1         # the framing range names no entry
            assert s["rocketmq_store_corrupt_ranges"] == 2

            async def answer(peer, index, count=1):
                return b"\0" * rec.size
            repairer.fetch = answer
            monkeypatch.setattr(R, "check_fetched", lambda raw, rec: None)
            monkeypatch.setattr(R, "write_in_place", lambda store, rec, raw: None)
            assert await repairer._repair_one(registry.ranges()[0])
            repairer.metrics["serve_entries_answers"] += 3                 # as _serve counts its answers
            s = scrape(h.broker)
            assert s["rocketmq_store_repaired_entries_total"] == 1
            assert s["rocketmq_store_repair_failures_total"] == 2
            assert s["rocketmq_store_repair_pending_entries"] == 0
            assert s["rocketmq_store_repair_served_fetches_total"] == 3
            assert s["rocketmq_store_corrupt_repaired_total"] == 1
        finally:
            await h.broker.stop()
    asyncio.run(go())


def test_an_entry_every_peer_has_cut_is_asked_for_again_only_after_a_long_pause(caplog):
    """Damage in an entry whose file every peer's retention has deleted: no copy is left. The
    repair asked every peer every second, forever, with a warning each time. Now one ERROR says
    so, and the peers are asked again only every GONE_RETRY_S; a refusal for another reason
    is retried at the usual pace."""
    from node.store.scrub import CorruptionRegistry

    async def go():
        registry = CorruptionRegistry()
        rec = SimpleNamespace(index=5, size=100, pos=1000)
        gate = asyncio.Lock()
        dlog = SimpleNamespace(store=SimpleNamespace(entry_at=lambda i: rec), _leader_id="n1",
                               on_repaired=lambda r, rec, raw, how: None,
                               node=SimpleNamespace(flushes_held=lambda: gate))
        repairer = R.Repairer(dlog, registry, ["n1", "n2"], retry_s=0.02)
        asked = []

        async def gone(peer, index, count=1):
            asked.append((peer, index))
            if index == 5:
                raise R.GoneAtPeer(f"peer refused: {R.GONE_HERE} entry 5 is below this replica's first entry 40")
            raise R.RepairError("peer refused: busy")
        repairer.fetch = gone
        registry.report(CorruptRange("seg", 1000, 1100, 1, 2, "recovery", "entry body crc mismatch", 5))
        task = asyncio.create_task(repairer.run())
        await asyncio.sleep(0.3)
        assert sorted(asked) == [("n1", 5), ("n2", 5)], "asked once, not every retry_s"
        assert repairer.metrics["gone_everywhere"] == 1 and len(registry) == 1
        registry.report(CorruptRange("seg", 5000, 5100, 1, 2, "scrub", "entry body crc mismatch", 9))
        repairer.wake()
        await asyncio.sleep(0.3)
        assert sum(1 for _, i in asked if i == 9) >= 8, "another refusal is retried at retry_s"
        assert sum(1 for _, i in asked if i == 5) == 2
        task.cancel()
    with caplog.at_level("INFO", logger="dledger.repair"):
        asyncio.run(go())
    assert sum("every peer has cut it" in r.getMessage() for r in caplog.records if r.levelname == "ERROR") == 1
