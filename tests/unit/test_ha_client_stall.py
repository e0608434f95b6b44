"""Goal: a slave's HA client never stops replicating without a word. Regression (docker drill
disk_full): after an in-process demotion the old master's HA client task ended on an error no
handler expected and the slave replicated nothing, with no log line, until restarted.
Method: a fake master on loopback (handshake, then heartbeats) and a fake sink whose
reconcile fails as told; the client must log each kind of failure and keep retrying."""

from __future__ import annotations

import asyncio
import errno
import logging

from ha.replication import HATimings
from ha.shell import HAClient, encode_frame, read_frame

FAST = HATimings(heartbeat_interval_ms=200, housekeeping_ms=2000)


class Sink:
    segment_size = 1 << 20

    def __init__(self, failures: list[BaseException]):
        self.failures = failures
        self.reconciles = 0

    def ha_max_offset(self) -> int:
        return 0

    async def ha_reconcile(self, master_epochs, master_max, master_min) -> None:
        self.reconciles += 1
        if self.failures:
            raise self.failures.pop(0)

    async def ha_append(self, verdict, offset, data) -> None:
        raise AssertionError("no data is pushed in this test")

    async def ha_after_batch(self) -> None:
        return None

    async def ha_settle(self) -> None:
        return None


async def fake_master() -> tuple[asyncio.base_events.Server, int]:
    async def serve(reader, writer):
        try:
            await read_frame(reader)
            writer.write(encode_frame({"epochs": [[1, 0]], "max_offset": 0, "min_offset": 0}))
            await writer.drain()
            while await reader.read(1 << 16):   # the slave's reports, until it hangs up
                pass
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_client_survives_and_logs_unexpected_and_local_io_errors(caplog):
    async def main():
        server, port = await fake_master()
        sink = Sink([RuntimeError("listener bug"), OSError(errno.ENOSPC, "No space left on device")])
        client = HAClient(f"127.0.0.1:{port}", sink, broker_id=1, timings=FAST)
        with caplog.at_level(logging.WARNING, logger="ha.shell"):
            client.start()
            for _ in range(1000):               # reconnect backoff: 1 s, then 2 s
                if client.connected:
                    break
                await asyncio.sleep(0.01)
            assert client.connected, client.status()
            await client.stop()
        server.close()
        assert sink.reconciles == 3                      # failed twice, then the third session works
        assert client.unexpected_errors == 1 and client.status()["unexpected_errors"] == 1
        msgs = [r.getMessage() for r in caplog.records]
        assert any("failed unexpectedly" in m and "listener bug" in m for m in msgs), msgs
        assert any("dropped" in m and "No space left" in m for m in msgs), msgs
        assert any("ended before any byte arrived" in m for m in msgs), msgs
    asyncio.run(main())



def test_refused_push_is_logged_and_the_client_reconciles_again(caplog):
    """A push that does not start at the slave's max offset is refused: the client says so and
    starts a new session, which reconciles with the master's epochs again before it reports."""
    from node.store import layout as L

    class AtHundred(Sink):
        def ha_max_offset(self) -> int:
            return 100

    async def main():
        async def serve(reader, writer):
            try:
                await read_frame(reader)
                writer.write(encode_frame({"epochs": [[1, 0]], "max_offset": 200, "min_offset": 0}))
                writer.write(L.HA_PUSH_HEADER.pack(50, 4) + b"abcd")    # not at the slave's offset 100
                await writer.drain()
                while await reader.read(1 << 16):
                    pass
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        sink = AtHundred([])
        client = HAClient(f"127.0.0.1:{server.sockets[0].getsockname()[1]}", sink, broker_id=1, timings=FAST)
        with caplog.at_level(logging.WARNING, logger="ha.shell"):
            client.start()
            for _ in range(300):
                if sink.reconciles >= 2:
                    break
                await asyncio.sleep(0.01)
            await client.stop()
        server.close()
        assert sink.reconciles >= 2, "the client must come back and reconcile again"
        assert any("dropped" in r.getMessage() and "push at 50" in r.getMessage() for r in caplog.records)
    asyncio.run(main())
