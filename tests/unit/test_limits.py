"""Hard limits (node/limits.py): every limit is a validated broker.conf key, every violation
is a clear 4xx (or a closed connection) and a count in rocketmq_limit_rejections_total.

Method: the real aiohttp app over the test_broker harness (tests/unit/test_api.py's
api_test), driven with aiohttp's TestClient; the connection gates and checks directly.
Each test reads the rejection counter before and after, so tests running in the same
process do not disturb each other.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from node import limits
from node.config import BrokerConfig, ConfigError, from_properties
from node.limits import REJECTIONS, ConnectionGate, Inflight, Limits, LimitExceeded
from tests.unit.test_api import api_test, setup_topic

SMALL = dataclasses.replace(BrokerConfig(), max_message_size=1024, max_request_bytes=1024 * 4 // 3 + 64 * 1024,
                            max_batch_messages=4, max_properties_per_message=3, max_property_name_bytes=8,
                            max_property_value_bytes=32, max_properties_bytes=60, max_keys_per_message=2)


class Counted:
    """Context: the rejections of `limit` during the block must grow by exactly `n`."""

    def __init__(self, limit: str, n: int = 1):
        self.limit, self.n = limit, n

    def __enter__(self):
        self.before = REJECTIONS.get(self.limit)

    def __exit__(self, *exc):
        if exc[0] is None:
            assert REJECTIONS.get(self.limit) - self.before == self.n, self.limit


async def send(client, messages, topic="T"):
    r = await client.post(f"/topics/{topic}/messages", json={"messages": messages})
    return r.status, await r.json()


# --- config --------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,bad", [("maxPropertiesPerMessage", "0"), ("maxPropertyNameBytes", "40000"),
                                     ("maxPropertyValueBytes", "0"), ("maxPropertiesBytes", "32768"),
                                     ("maxKeysPerMessage", "0"), ("maxInflightRequestsPerClient", "0"),
                                     ("raftMaxInboundConnections", "0"), ("haMaxConnections", "-1")])
def test_every_limit_key_is_validated_and_named(key, bad):
    with pytest.raises(ConfigError, match=key):
        from_properties({key: bad})


def test_limits_are_read_from_the_config():
    lim = Limits.from_config(SMALL)
    assert (lim.max_batch_messages, lim.max_keys_per_message, lim.max_property_value_bytes) == (4, 2, 32)


# --- HTTP: each violation a 4xx with the LIMIT_EXCEEDED shape and a count --------------------------------
@api_test(SMALL)
async def test_batch_over_max_batch_messages_is_400_and_counted(client, h):
    await setup_topic(client, h)
    with Counted("batch_messages"):
        status, doc = await send(client, [{"body": "x"}] * 5)
    assert status == 400 and doc["error"] == "LIMIT_EXCEEDED" and "maxBatchMessages" in doc["message"]
    assert (await send(client, [{"body": "x"}] * 4))[0] == 200


@api_test(SMALL)
async def test_body_over_max_message_size_is_413_and_counted(client, h):
    await setup_topic(client, h)
    with Counted("message_size"):
        status, doc = await send(client, [{"body": "x" * 1025}])
    assert status == 413 and doc["error"] == "MESSAGE_TOO_LARGE"


@api_test(SMALL)
async def test_content_length_over_max_request_bytes_is_413_before_the_body_is_read(client, h):
    await setup_topic(client, h)
    with Counted("request_bytes"):
        r = await client.post("/topics/T/messages", data=b"{" + b" " * SMALL.max_request_bytes + b"}",
                              headers={"Content-Type": "application/json"})
    assert r.status == 413 and (await r.json())["error"] == "LIMIT_EXCEEDED"


@api_test(SMALL)
async def test_chunked_body_over_max_request_bytes_is_cut_at_the_limit_and_counted(client, h):
    await setup_topic(client, h)

    async def chunks():
        for _ in range(SMALL.max_request_bytes // 4096 + 2):
            yield b" " * 4096
    with Counted("request_bytes"):
        r = await client.post("/topics/T/messages", data=chunks(), headers={"Content-Type": "application/json"})
    assert r.status == 413 and (await r.json())["error"] == "REQUEST_TOO_LARGE"


@api_test(SMALL)
async def test_property_limits_count_name_value_total(client, h):
    await setup_topic(client, h)
    cases = [("properties_count", {"a": "1", "b": "2", "c": "3", "d": "4"}),
             ("property_name_bytes", {"n" * 9: "v"}),
             ("property_value_bytes", {"k": "v" * 33}),
             ("properties_bytes", {"a": "v" * 30, "b": "w" * 30})]
    for limit, props in cases:
        with Counted(limit):
            status, doc = await send(client, [{"body": "x", "properties": props}])
        assert status == 400 and doc["error"] == "LIMIT_EXCEEDED", (limit, doc)
    assert (await send(client, [{"body": "x", "properties": {"a": "1", "b": "2"}}]))[0] == 200


@api_test(SMALL)
async def test_keys_over_max_keys_per_message_is_400_and_counted(client, h):
    await setup_topic(client, h)
    with Counted("keys_count"):
        status, doc = await send(client, [{"body": "x", "keys": ["a", "b", "c"]}])
    assert status == 400 and "maxKeysPerMessage" in doc["message"]


@api_test(SMALL)
async def test_topic_and_group_names_in_the_path_are_checked_first(client, h):
    with Counted("topic_name"):
        r = await client.get("/topics/" + "t" * 128)
    assert r.status == 400 and (await r.json())["error"] == "LIMIT_EXCEEDED"
    with Counted("topic_name"):
        r = await client.get("/topics/bad.name")
    assert r.status == 400
    with Counted("group_name"):
        r = await client.get("/groups/" + "g" * 121 + "/offsets")
    assert r.status == 400
    r = await client.get("/groups/" + "g" * 120 + "/offsets")
    assert r.status == 200


@api_test(dataclasses.replace(SMALL, max_inflight_requests_per_client=2, long_polling_max_wait_ms=5000))
async def test_inflight_requests_per_client_beyond_the_cap_get_429(client, h):
    await setup_topic(client, h, queues=1)
    polls = [asyncio.create_task(client.get("/topics/T/queues/0/messages?offset=0&wait_ms=3000"))
             for _ in range(2)]
    await asyncio.sleep(0.3)   # both are parked in long polling
    with Counted("inflight_per_client"):
        r = await client.get("/health")
    assert r.status == 429
    doc = await r.json()
    assert doc["error"] == "LIMIT_EXCEEDED" and doc["retriable"] is True
    await send(client, [{"body": "wake", "queue_id": 0}])       # wakes the polls
    for t in polls:
        assert (await t).status == 200
    assert (await client.get("/health")).status == 200      # the slots were given back


@api_test(dataclasses.replace(SMALL, long_polling_max_waiters=1, long_polling_max_wait_ms=5000))
async def test_long_poll_beyond_max_waiters_answers_at_once_and_is_counted(client, h):
    await setup_topic(client, h, queues=1)
    held = asyncio.create_task(client.get("/topics/T/queues/0/messages?offset=0&wait_ms=3000"))
    await asyncio.sleep(0.3)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with Counted("long_poll_waiters"):
        r = await client.get("/topics/T/queues/0/messages?offset=0&wait_ms=3000")
    assert r.status == 200 and (await r.json())["status"] == "NO_NEW_MSG"
    assert loop.time() - t0 < 1.5       # short polling: not held
    await send(client, [{"body": "wake", "queue_id": 0}])
    assert (await held).status == 200


@api_test(SMALL)
async def test_rejections_are_exported_as_a_prometheus_counter(client, h):
    await setup_topic(client, h)
    await send(client, [{"body": "x"}] * 5)
    text = await (await client.get("/metrics")).text()
    line = [ln for ln in text.splitlines() if ln.startswith('rocketmq_limit_rejections_total{limit="batch_messages"}')]
    assert line and float(line[0].split()[-1]) >= 1
    assert 'rocketmq_limit_rejections_total{limit="raft_connections"}' in text


# --- pieces ------------------------------------------------------------------------------------------
def test_connection_gate_refuses_beyond_cap_and_counts():
    gate = ConnectionGate(2, "raft_connections")
    with Counted("raft_connections"):
        assert gate.try_enter() and gate.try_enter()
        assert not gate.try_enter()
    gate.leave()
    assert gate.try_enter()


def test_inflight_table_forgets_idle_clients():
    t = Inflight(1)
    assert t.enter("a") and not t.enter("a") and t.enter("b")
    t.leave("a")
    t.leave("b")
    assert t.count("a") == 0 and not t._by_client


def test_check_properties_counts_utf8_bytes_not_chars():
    lim = Limits(max_property_value_bytes=4)
    limits.check_properties({"k": "éé"}, "m", lim)
    with pytest.raises(LimitExceeded) as e:
        limits.check_properties({"k": "ééé"}, "m", lim)
    assert e.value.limit == "property_value_bytes"


# --- peer listeners: a bounded number of accepted connections ---------------------------------------------
async def _held_and_refused(port: int, cap: int) -> tuple[list, bool]:
    """Open cap connections that stay silent (held in the handshake), then one more; True if it was closed."""
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(cap)]
    await asyncio.sleep(0.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        closed = await asyncio.wait_for(reader.read(1), 1.5) == b""
    except (asyncio.TimeoutError, ConnectionError):
        closed = False
    writer.close()
    return held, closed


def test_raft_listener_closes_connections_beyond_raft_max_inbound_connections():
    from dledger.transport import Transport, TransportConfig

    async def go():
        t = Transport("n0", "g", ("127.0.0.1", 0), {"n1": ("127.0.0.1", 1)}, lambda s, m: None,
                      TransportConfig(max_inbound_connections=2, handshake_timeout_ms=5000,
                                      reconnect_backoff_min_ms=1000, reconnect_backoff_max_ms=1000))
        await t.start()
        try:
            with Counted("raft_connections"):
                held, closed = await _held_and_refused(t.bound_port, 2)
            assert closed and t.metrics["refused_connections"] == 1
            for _, w in held:
                w.close()
        finally:
            await t.stop()
    asyncio.run(go())


def test_ha_listener_closes_connections_beyond_ha_max_connections(tmp_path):
    from ha.replication import HATimings
    from tests.integration.test_ha_loopback import master_log

    async def go():
        m = master_log(tmp_path, timings=HATimings(heartbeat_interval_ms=200, housekeeping_ms=5000,
                                                   max_connections=1))
        await m.start()
        try:
            with Counted("ha_connections"):
                held, closed = await _held_and_refused(m.ha_port, 1)
            assert closed
            for _, w in held:
                w.close()
        finally:
            await m.stop()
    asyncio.run(go())


def test_ha_max_connections_reaches_the_ha_service_from_broker_conf(tmp_path):
    from ha.ha_log import ha_log_from_broker_config
    from node.local_log import LocalLogConfig
    from node.store.fileio import FileSystem
    config = dataclasses.replace(BrokerConfig(), ha_max_connections=3, store_path_root_dir=str(tmp_path))
    log = ha_log_from_broker_config(config.validate(), FileSystem(), LocalLogConfig(segment_size_bytes=64 * 1024))
    assert log.cfg.timings.max_connections == 3


def test_raft_max_inbound_connections_reaches_the_transport_from_broker_conf(tmp_path):
    from dledger.factory import build_dledger_log
    config = dataclasses.replace(BrokerConfig(), raft_max_inbound_connections=5, store_path_root_dir=str(tmp_path),
                                 enable_dleger_commit_log=True, dleger_group="g", dleger_self_id="n0",
                                 dleger_peers="n0-127.0.0.1:40911;n1-127.0.0.1:40912;n2-127.0.0.1:40913",
                                 mapped_file_size_commit_log=8 * 1024 * 1024)
    log = build_dledger_log(config.validate())    # built, not started: nothing listens
    assert log.node.transport_config.max_inbound_connections == 5
