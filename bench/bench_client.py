"""Client SDK benchmark: producer throughput through the SDK vs raw HTTP, and produce->consume latency.

    python -m bench.bench_client [--quick]

One standalone `python -m node` process (ASYNC_FLUSH) on a free loopback port, store in a
temp dir (removed at the end). Cases, each bounded in seconds and messages:

- producer_raw      aiohttp posting a pre-encoded msgpack batch (`BATCH` messages of
                    `BODY_BYTES`, the same fields the SDK sends: body, queue_id, UNIQ_KEY),
                    `INFLIGHT` requests in flight: the floor the SDK is measured against
- producer_sdk      `AsyncProducer.send_batch` of `BATCH` fresh `Message`s, `INFLIGHT` in flight,
                    to the same node in the same run; `sdk_vs_raw` = sdk / raw msg/s (target >= 0.9)
- e2e_latency       one producer sending one message every `LATENCY_GAP_S`, an `AsyncConsumer`
                    (push, long polling) in the same process: send start -> listener call,
                    p50 / p99 in ms

Raw and SDK alternate (raw, sdk, raw, sdk) so a change in the machine's other load hits both;
each figure is the better of its rounds. Every figure carries the 1-minute load average and
the client CPU microseconds per message (CPU moves less with other load than msg/s does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import msgpack

from bench.bench_dledger import free_ports, load1, pct_ms
from bench.bench_store import figure
from mqstore.client.message import PROPERTY_UNIQ_KEY, UNIQ_IDS

REPO_ROOT = Path(__file__).resolve().parent.parent
MSGPACK = "application/x-msgpack"
TOPIC = "BenchClient"
QUEUES = 8
BODY_BYTES = 1024
BATCH = 32
INFLIGHT = 8
START_TIMEOUT_S = 20.0
LATENCY_GAP_S = 0.005
TARGET_SDK_VS_RAW = 0.9


def _conf(work: Path, port: int) -> Path:
    path = work / "broker.conf"
    path.write_text("\n".join([
        "brokerClusterName=BenchCluster", "brokerName=bench-client", "brokerId=0", "brokerIP1=127.0.0.1",
        "bindAddress=127.0.0.1", f"listenPort={port}", f"storePathRootDir={work / 'store'}",
        "flushDiskType=ASYNC_FLUSH", "mappedFileSizeCommitLog=268435456", "autoCreateTopicEnable=true",
        "logLevel=WARNING", "longPollingMaxWaitMs=2000"]) + "\n")
    return path


async def _wait_up(session: aiohttp.ClientSession, addr: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"node exited with {proc.returncode}")
        try:
            async with session.get(f"http://{addr}/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                if r.status == 200:
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"node on {addr} not healthy within {START_TIMEOUT_S}s")


async def _raw(session: aiohttp.ClientSession, addr: str, seconds: float, max_msgs: int) -> dict:
    body = os.urandom(BODY_BYTES)
    url = f"http://{addr}/topics/{TOPIC}/messages"
    headers = {"Content-Type": MSGPACK, "Accept": MSGPACK}
    payloads = [msgpack.packb({"messages": [{"body": body, "queue_id": q,
                                             "properties": {PROPERTY_UNIQ_KEY: UNIQ_IDS.next()}}
                                            for _ in range(BATCH)]}, use_bin_type=True) for q in range(QUEUES)]
    state = {"acked": 0, "sent": 0, "errors": 0}
    deadline = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        i = w
        while time.perf_counter() < deadline and state["sent"] + BATCH <= max_msgs:
            state["sent"] += BATCH
            async with session.post(url, data=payloads[i % QUEUES], headers=headers) as r:
                raw = await r.read()
            i += 1
            if r.status != 200:
                state["errors"] += 1
                continue
            res = msgpack.unpackb(raw, raw=False)["results"]
            state["acked"] += sum(1 for x in res if x["status"] == "SEND_OK")
    return await _timed(state, [worker(w) for w in range(INFLIGHT)])


async def _sdk(producer, seconds: float, max_msgs: int) -> dict:
    from mqstore import Message
    body = os.urandom(BODY_BYTES)
    state = {"acked": 0, "sent": 0, "errors": 0}
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline and state["sent"] + BATCH <= max_msgs:
            state["sent"] += BATCH
            msgs = [Message(TOPIC, body) for _ in range(BATCH)]
            try:
                res = await producer.send_batch(msgs)          # the SDK picks the queue (round-robin)
            except Exception:  # noqa: BLE001 - counted; the case reports errors
                state["errors"] += 1
                continue
            state["acked"] += sum(1 for r in res if r.status.value == "SEND_OK")
    return await _timed(state, [worker() for _ in range(INFLIGHT)])


async def _timed(state: dict, workers: list) -> dict:
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*workers)
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    return {"msgs": state["acked"], "errors": state["errors"], "seconds": round(elapsed, 3),
            "msgs_per_s": state["acked"] / elapsed if elapsed else 0.0,
            "client_cpu_us_per_msg": round(cpu * 1e6 / state["acked"], 1) if state["acked"] else None,
            "load1": load1()}


async def _latency(addr: str, count: int) -> dict:
    from mqstore import AsyncConsumer, AsyncProducer, ConsumeStatus, Message
    topic = TOPIC + "Lat"
    sent: dict[str, float] = {}
    lat: list[float] = []
    done = asyncio.Event()

    async def listener(msgs):
        now = time.perf_counter()
        for m in msgs:
            t = sent.get(m.body.decode())
            if t is not None:
                lat.append(now - t)
        if len(lat) >= count:
            done.set()
        return ConsumeStatus.CONSUME_SUCCESS

    async with AsyncProducer(brokers=addr) as p:
        await p.send(Message(topic, b"warm"))               # creates the topic before the consumer routes it
        consumer = await AsyncConsumer("BenchLatG", brokers=addr, topics=topic, listener=listener,
                                       long_poll_ms=1000, heartbeat_interval_s=1.0).start()
        try:
            await asyncio.sleep(1.0)                           # the consumer's long polls are waiting
            for i in range(count):
                key = f"m{i}"
                sent[key] = time.perf_counter()
                await p.send(Message(topic, key))
                await asyncio.sleep(LATENCY_GAP_S)
            try:
                await asyncio.wait_for(done.wait(), 10.0)
            except asyncio.TimeoutError:
                pass
        finally:
            await consumer.close()
    lat.sort()
    return {"sent": count, "received": len(lat), "p50_ms": pct_ms(lat, 0.50), "p99_ms": pct_ms(lat, 0.99),
            "max_ms": pct_ms(lat, 1.0), "load1": load1()}


async def _cases(addr: str, proc: subprocess.Popen, quick: bool) -> dict:
    from mqstore import AsyncAdmin, AsyncProducer
    seconds, max_msgs, rounds = (3.0, 60_000, 2) if quick else (8.0, 400_000, 3)
    out: dict = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        await _wait_up(session, addr, proc)
        async with AsyncAdmin(brokers=addr) as admin:
            await admin.create_topic(TOPIC, QUEUES)
        raw_runs, sdk_runs = [], []
        async with AsyncProducer(brokers=addr) as producer:
            await _sdk(producer, 0.5, 2_000)                   # warm-up: routes, connections
            await _raw(session, addr, 0.5, 2_000)
            for _ in range(rounds):
                raw_runs.append(await _raw(session, addr, seconds, max_msgs))
                sdk_runs.append(await _sdk(producer, seconds, max_msgs))
    raw = max(raw_runs, key=lambda r: r["msgs_per_s"])
    sdk = max(sdk_runs, key=lambda r: r["msgs_per_s"])
    out["producer_raw"] = figure(raw["msgs_per_s"], "msg/s", None, None, None, runs=raw_runs)
    ratio = sdk["msgs_per_s"] / raw["msgs_per_s"] if raw["msgs_per_s"] else 0.0
    out["producer_sdk"] = figure(sdk["msgs_per_s"], "msg/s", None, None, None, runs=sdk_runs)
    out["sdk_vs_raw"] = {"value": round(ratio, 3), "unit": "ratio", "target": TARGET_SDK_VS_RAW,
                         "meets_target": ratio >= TARGET_SDK_VS_RAW, "load1": load1(),
                         "batch": BATCH, "inflight": INFLIGHT, "body_bytes": BODY_BYTES}
    lat = await _latency(addr, 300 if quick else 1500)
    out["e2e_latency"] = {**lat, "unit": "ms", "consumer": "AsyncConsumer push, long polling",
                          "gap_between_sends_ms": LATENCY_GAP_S * 1000}
    return out


def run(quick: bool = False, anchors: dict | None = None) -> dict:
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="mqbench-client-"))
    (port,) = free_ports(1)
    out: dict = {"load1_start": load1(), "node": "standalone, ASYNC_FLUSH", "processes": True}
    proc = None
    try:
        with open(work / "node.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "node", "--config", str(_conf(work, port))],
                                    cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        out.update(asyncio.run(_cases(f"127.0.0.1:{port}", proc, quick)))
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        shutil.rmtree(work, ignore_errors=True)
    out["elapsed_s"] = round(time.monotonic() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_client")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    print(json.dumps(run(args.quick), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
