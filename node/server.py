"""Process wiring: config -> file system -> log -> store services -> Broker -> HTTP API.

`build_log(config, fs, checkpoint)` is the one place a replication mode is chosen:
standalone today; DLedger (`enableDLegerCommitLog=true`) and classic HA
(`brokerRole` + `haMasterAddress` / controller) plug in here when they exist.
Logging: one JSON object per line when stderr is not a terminal (containers,
integration tests), readable lines otherwise; every line names node and group.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from node.api_site import LimitedSite   # maxHttpConnections; TLS handshakes counted
from node.broker import Broker
from node.config import BrokerConfig, parse_delay_levels
from node.replicated_log import ReplicatedLog
from node.store.checkpoint import Checkpoint
from node.store.consume_queue import ConsumeQueueStore
from node.store.dispatcher import Dispatcher
from node.store.errors import StoreError, StoreFatal
from node.store.fileio import FileSystem
from node.store.index_file import IndexService
from node.store.json_config import ConsumerOffsetTable, TopicConfig, TopicConfigTable
from node.store.reaper import FileReaper
from node.store.retention import RetentionPolicy
from node.metrics import TimedFileSystem

if TYPE_CHECKING:    # imported where used: a classic or standalone node only
    from node.local_log import LocalLogConfig

log = logging.getLogger("node.server")
# A stop waits this long for API requests in flight (a send waits at most syncFlushTimeout for its
# ack, 5 s by default; later ones are cancelled), and at most STOP_STEP_S more for each service.
STOP_HTTP_GRACE_S = 5.0
STOP_STEP_S = 3.0
_STD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


# --- logging ----------------------------------------------------------------------------------
class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, node, group, and any `extra` fields."""

    def __init__(self, node_id: str, group: str):
        super().__init__()
        self.node_id = node_id
        self.group = group

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
                               "msg": record.getMessage(), "node": self.node_id, "group": self.group}
        for k, v in record.__dict__.items():
            if k not in _STD_ATTRS and not k.startswith("_"):
                out[k] = v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"))


def setup_logging(config: BrokerConfig, stream=None) -> None:
    stream = stream or sys.stderr
    handler = logging.StreamHandler(stream)
    if stream.isatty():
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s %(levelname)s [{config.node_id}/{config.group}] %(name)s: %(message)s"))
    else:
        handler.setFormatter(JsonFormatter(config.node_id, config.group))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(config.log_level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # one line per request is too much


class TermFilter(logging.Filter):
    """Adds the node's current Raft term to every record (`term` in JSON lines); cheap: one attribute read."""

    def __init__(self, rlog: Any):
        super().__init__()
        self.rlog = rlog

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "term"):
            record.term = getattr(self.rlog, "term", None)
        return True


def add_term_to_logs(broker: Broker) -> None:
    """DLedger nodes: every log line names the term it was written in."""
    if getattr(broker.log, "mode", None) != "dledger":
        return
    f = TermFilter(broker.log)
    for h in logging.getLogger().handlers:
        h.addFilter(f)


# --- snapshot adapters (broker's view of the config/ JSON files) ----------------------------------
class TopicSnapshots:
    """Broker topic dicts <-> TopicConfigTable (topics.json); writes only what changed."""

    def __init__(self, table: TopicConfigTable):
        self.table = table

    def load(self) -> dict[str, dict[str, int]]:
        self.table.load()
        return {name: {"read_queue_nums": c.readQueueNums, "write_queue_nums": c.writeQueueNums, "perm": c.perm}
                for name, c in self.table.all().items()}

    def save(self, topics: dict[str, dict[str, int]]) -> None:
        current = self.table.all()
        for name, c in topics.items():
            cfg = TopicConfig(name, c["read_queue_nums"], c["write_queue_nums"], c["perm"])
            if current.get(name) != cfg:
                self.table.put(cfg)
        for name in set(current) - set(topics):
            self.table.delete(name)


class OffsetSnapshots:
    """Broker offset dicts <-> ConsumerOffsetTable (consumerOffset.json)."""

    def __init__(self, table: ConsumerOffsetTable):
        self.table = table

    def load(self) -> dict[str, dict[int, int]]:
        self.table.load()
        return self.table.table()

    def save(self, offsets: dict[str, dict[int, int]]) -> None:
        current = self.table.table()
        for key, queues in offsets.items():
            topic, _, group = key.rpartition("@")
            for qid, off in queues.items():
                if current.get(key, {}).get(qid) != off:
                    self.table.commit(group, topic, qid, off)
        self.table.persist()


# --- building ----------------------------------------------------------------------------------
def build_log(config: BrokerConfig, fs: FileSystem, checkpoint: Checkpoint) -> ReplicatedLog:
    """The ReplicatedLog for this node's mode: DLedger, classic HA, or a standalone LocalLog."""
    if config.enable_dleger_commit_log:
        from dledger.factory import build_dledger_log
        return build_dledger_log(config, fs)
    from ha.wiring import build_ha_log
    halog = build_ha_log(config, fs, checkpoint)
    if halog is not None:
        return halog
    from node.local_log import LocalLog
    checkpoint.load()
    return LocalLog(fs, config.store_root, local_log_config(config),
                    checkpoint_committed_offset=checkpoint.committed_offset)


def retention_policy(config: BrokerConfig) -> RetentionPolicy:
    """fileReservedTime, deleteWhen and the disk ratios of a broker.conf (every mode)."""
    return RetentionPolicy(file_reserved_time_hours=config.file_reserved_time_hours,
                           delete_when=config.delete_when,
                           disk_max_used_space_ratio=config.disk_max_used_space_ratio_pct,
                           disk_space_warning_level_ratio=config.disk_space_warning_level_ratio_pct)


def local_log_config(config: BrokerConfig) -> "LocalLogConfig":
    """The single-node commitlog settings of a broker.conf (standalone and classic HA)."""
    from node.local_log import LocalLogConfig
    retention = retention_policy(config)
    return LocalLogConfig(segment_size_bytes=config.mapped_file_size_commit_log,
                          flush_disk_type=config.flush_disk_type,
                          flush_interval_ms=config.flush_interval_commit_log_ms,
                          sync_flush_timeout_ms=config.sync_flush_timeout_ms,
                          store_ip=config.broker_ip1, store_port=config.listen_port, retention=retention,
                          reserve_bytes=config.disk_reserve_bytes)


def build_broker(config: BrokerConfig, fs: FileSystem | None = None) -> Broker:
    if fs is None:
        fs = TimedFileSystem()     # the real file system, fsyncs timed for /metrics
        fs.reaper = FileReaper()   # retention's removals off the event loop (node/store/reaper.py)
    root = config.store_root
    fs.makedirs(root)
    checkpoint = Checkpoint(fs, root)
    rlog = build_log(config, fs, checkpoint)
    cq_store = ConsumeQueueStore(fs, root, config.cq_units_per_file)
    index = IndexService(fs, root, hash_slots=config.max_hash_slot_num, max_entries=config.max_index_num)
    dispatcher = Dispatcher(rlog, cq_store, index, checkpoint,
                            delay_levels_ms=parse_delay_levels(config.message_delay_level))
    broker = Broker(config, rlog, cq_store, index, dispatcher,
                    TopicSnapshots(TopicConfigTable(fs, root)), OffsetSnapshots(ConsumerOffsetTable(fs, root)))
    dispatcher.system_handlers.update(broker.system_handlers())
    broker.fs = fs
    from ha.wiring import attach_truncation
    attach_truncation(broker)
    follow_dledger_resets(broker)
    return broker


def follow_dledger_resets(broker: Broker) -> None:
    """DLedger mode: the base states retention stores carry the broker's topics and consumer
    offsets, and a replica reset to the leader's base (InstallBase) drops its consume queues
    of the old log (their data is gone) and dispatches from the new start."""
    rlog = broker.log
    if getattr(rlog, "mode", None) != "dledger":
        return
    rlog.export_broker_state = broker.export_replicated_state
    rlog.import_broker_state = broker.import_replicated_state

    def on_reset(start: int) -> None:
        def reset() -> None:
            broker.dispatcher.skip_to(start)
            cut = broker.dispatcher.cut_queues(0)   # the whole old log; files cut on a worker
            log.warning("log reset to the leader's base: dropped %d consume-queue units of the old log; dispatch "
                        "resumes at %d", cut, broker.dispatcher.position)
        broker.dispatcher.when_recovered(reset)    # not under the start's recovery of the queues

    rlog.reset_listeners.append(on_reset)


# --- running -----------------------------------------------------------------------------------
async def serve(config: BrokerConfig, stop_event: asyncio.Event | None = None) -> int:
    """Start the broker and API, run until SIGTERM/SIGINT (or stop_event), stop cleanly.
    Returns the process exit code: 0 after a clean stop, 1 after a fatal store error."""
    from node.api import make_app
    stop_event = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_event.set)
    t0 = time.monotonic()
    from node.store import cold_reads
    cold_reads.HOT_BYTES = config.cold_read_hot_bytes
    cold_reads.RETAIN_BYTES = config.page_cache_retain_bytes
    broker = build_broker(config)
    watchdog = None
    if config.loop_stall_warn_ms:
        # Started once the broker is built: building it imports the mode's modules and opens
        # files before anything is served (a "stall" of 220-275 ms there, in imports, on two
        # busy cores, blocked nobody).
        from node.loop_watchdog import LoopWatchdog
        watchdog = LoopWatchdog(warn_s=config.loop_stall_warn_ms / 1000,
                                beat_s=min(0.02, config.loop_stall_warn_ms / 4000))
        watchdog.start(loop)
    broker.loop_watchdog = watchdog
    add_term_to_logs(broker)
    await broker.start()
    from node import peer_auth, tls
    from node.api import REGISTRY_KEY
    app = make_app(broker)
    app[REGISTRY_KEY].register(peer_auth.PeerAuthCollector())
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=STOP_HTTP_GRACE_S)
    await runner.setup()
    await LimitedSite(runner, config.bind_address, config.listen_port, reuse_address=True,
                      max_connections=config.max_http_connections,
                      ssl_context=tls.count_failures(tls.api_server_context(config), "api")).start()
    stream = None
    if config.stream_listen_port:
        from node.produce_stream import StreamServer, gate_from_config
        stream = StreamServer(broker, gate_from_config(config),
                              tls.count_failures(tls.api_server_context(config), "stream"))
        await stream.start(config.bind_address, config.stream_listen_port)
    log.info("node serving", extra={"api": f"{config.bind_address}:{config.listen_port}", "mode": broker.log.mode,
                                    "stream": config.stream_listen_port or None,
                                    "store": config.store_root, "startup_s": round(time.monotonic() - t0, 3)})
    watcher = asyncio.create_task(_watch_fatal(broker, stop_event))
    from ha.wiring import start_controller_reporter
    reporter = await start_controller_reporter(broker, config)   # DLedger + controllerAddr: report the leader
    await stop_event.wait()
    watcher.cancel()
    log.info("stopping")
    if stream is not None:
        await _bounded_stop("the produce stream", stream.stop(), STOP_STEP_S)
    await _bounded_stop("the HTTP API", runner.cleanup(), STOP_HTTP_GRACE_S + STOP_STEP_S)
    if reporter is not None:
        await _bounded_stop("the controller reporter", reporter.stop(), STOP_STEP_S)
    log.info("stopping the broker and its log")   # a stop that hangs past here hangs in broker.stop()
    await broker.stop()
    if watchdog is not None:
        watchdog.stop()
    fatal = broker.fatal or _log_fatal(broker)
    log.info("stopped", extra={"fatal": str(fatal or "")})
    return 1 if fatal is not None else 0


async def _bounded_stop(what: str, step, timeout_s: float) -> None:
    """One step of a stop, bounded: a stop asked for ends in bounded time (the broker's own stop,
    which flushes the store, is not bounded); a step that overran is named in the log."""
    try:
        async with asyncio.timeout(timeout_s):
            await step
    except TimeoutError:
        log.error("stopping: %s did not stop within %.0f s; going on", what, timeout_s)


def _log_fatal(broker: Broker) -> BaseException | None:
    return getattr(broker.log, "fatal", None)


async def _watch_fatal(broker: Broker, stop_event: asyncio.Event) -> None:
    """A fatal store error (failed fsync, dead dispatcher) stops the process: recovery is a restart."""
    while not stop_event.is_set():
        await asyncio.sleep(0.5)
        fatal = broker.fatal or _log_fatal(broker)
        if fatal is not None:
            log.error("fatal store error, stopping: %s", fatal)
            stop_event.set()


def main(config: BrokerConfig) -> int:
    setup_logging(config)
    from node.config import ConfigError
    try:
        from node import peer_auth, tls   # bad secret or certificate files: refuse to start, exit 2
        peer_auth.peer_security_from_config(config)
        tls.api_server_context(config)
    except ConfigError as e:
        log.error("cannot start: %s", e)
        return 2
    try:
        return asyncio.run(serve(config))
    except StoreFatal as e:
        log.error("fatal store error at startup: %s", e)
        return 1
    except StoreError as e:
        log.error("cannot start: %s", e)
        return 2
    except OSError as e:
        log.error("cannot start: %s", e)
        return 2
