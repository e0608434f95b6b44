"""RocketMQ `broker.conf` -> one frozen `BrokerConfig`, parsed once and validated at start.

The file uses Java properties syntax (`key=value`, `key: value`, `key value`,
`#`/`!` comments, `\\` line continuation, `\\uXXXX` escapes) and RocketMQ's key
names, spelling included (`mapedFileSizeConsumeQueue`, `dLegerPeers`). Containers
override any key with an environment variable `MQSTORE_<key>` (e.g.
`MQSTORE_listenPort=10921`); those are read here, at the edge, and nowhere else.
Unknown keys are logged as warnings, never fatal, so a stock RocketMQ broker.conf
starts a node. Anything invalid raises `ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

log = logging.getLogger(__name__)

ENV_PREFIX = "MQSTORE_"
BROKER_ROLES = ("ASYNC_MASTER", "SYNC_MASTER", "SLAVE")
FLUSH_DISK_TYPES = ("ASYNC_FLUSH", "SYNC_FLUSH")
CQ_UNIT_BYTES = 20
MIB = 1024 * 1024


class ConfigError(ValueError):
    """A config value is missing, malformed or out of range; the message names the key."""


def _key(name: str, default: Any) -> Any:
    """A dataclass field whose broker.conf key is `name`."""
    return field(default=default, metadata={"key": name})


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    # --- identity -------------------------------------------------------------------------
    # Cluster this broker group belongs to (routes are grouped by it).
    broker_cluster_name: str = _key("brokerClusterName", "DefaultCluster")
    # Broker group name; every replica of one group shares it.
    broker_name: str = _key("brokerName", "broker-a")
    # 0 = master in classic mode; > 0 = slave. Ignored in DLedger mode (Raft decides).
    broker_id: int = _key("brokerId", 0)
    # Classic replication rule: ASYNC_MASTER acks at once, SYNC_MASTER after a slave acks.
    broker_role: str = _key("brokerRole", "ASYNC_MASTER")

    # --- storage --------------------------------------------------------------------------
    # SYNC_FLUSH fsyncs before acking (group commit); ASYNC_FLUSH flushes every interval.
    flush_disk_type: str = _key("flushDiskType", "ASYNC_FLUSH")
    # ASYNC_FLUSH period in ms (RocketMQ flushIntervalCommitLog).
    flush_interval_commit_log_ms: int = _key("flushIntervalCommitLog", 500)
    # SYNC_FLUSH: how long a producer waits for the fsync before FLUSH_DISK_TIMEOUT, ms.
    sync_flush_timeout_ms: int = _key("syncFlushTimeout", 5000)
    # Root of the store directory (commitlog/, consumequeue/, index/, config/, checkpoint).
    store_path_root_dir: str = _key("storePathRootDir", os.path.join("~", "store"))
    # Commitlog segment size in bytes; a store must be reopened with the size it was written with.
    mapped_file_size_commit_log: int = _key("mappedFileSizeCommitLog", 1024 * MIB)
    # Consume-queue file size in bytes (RocketMQ's spelling); a multiple of the 20-byte unit.
    maped_file_size_consume_queue: int = _key("mapedFileSizeConsumeQueue", 300_000 * CQ_UNIT_BYTES)
    # Largest message body accepted, bytes.
    max_message_size: int = _key("maxMessageSize", 4 * MIB)
    # Index file geometry (IndexService): hash slots and entries per file.
    max_hash_slot_num: int = _key("maxHashSlotNum", 5_000_000)
    max_index_num: int = _key("maxIndexNum", 20_000_000)
    # Hours a commitlog segment is kept after its last write.
    file_reserved_time_hours: int = _key("fileReservedTime", 72)
    # Hours of day (00-23, ';'-separated) at which expired segments are deleted.
    delete_when: str = _key("deleteWhen", "04")
    # Percent of disk use above which expired files are deleted at once, whatever the hour.
    disk_max_used_space_ratio_pct: int = _key("diskMaxUsedSpaceRatio", 75)
    # (ours) Percent of disk use above which writes are refused (RocketMQ's 0.90 warning level).
    disk_space_warning_level_ratio_pct: int = _key("diskSpaceWarningLevelRatio", 90)
    # (ours) Bytes kept allocated in `<storePathRootDir>/reserve` and given up only when a disk
    # full to the last block would stop what frees it: the writes of a restart, a DLedger
    # retention cut's base state (node/store/reserve.py). 0 = no reserve.
    disk_reserve_bytes: int = _key("diskReserveBytes", 8 * MIB)
    # (ours) A call that blocks the node's event loop this long, ms, is counted and logged with
    # where the loop was (node/loop_watchdog.py); 0 turns the watchdog off.
    loop_stall_warn_ms: int = _key("loopStallWarnMs", 200)
    # (ours) Pulls and pushes read bytes more than this far behind the end of their files on a
    # worker thread, never on the event loop (node/store/cold_reads.py); newer bytes are taken
    # as in the page cache. Process-wide. 0: every such read goes through a worker.
    cold_read_hot_bytes: int = _key("coldReadHotBytes", 64 * MIB)
    # (ours) Flushed bytes of each file set (commitlog or DLedger entries, consume queues,
    # index) kept in the OS page cache behind its end; older flushed pages are dropped after
    # a flush (posix_fadvise DONTNEED) and read back from disk when asked for, on a worker.
    # Bounds the node's page cache, so its writes reuse the pages it frees instead of taking
    # new ones: on a VM whose host backs memory lazily, a new page costs ten times more
    # system CPU than a reused one (node/store/cold_reads.py). 0 (the default) keeps every
    # page, as RocketMQ does; otherwise at least coldReadHotBytes. Process-wide.
    page_cache_retain_bytes: int = _key("pageCacheRetainBytes", 0)
    # Period of the consumer-offset snapshot to config/consumerOffset.json, ms.
    flush_consumer_offset_interval_ms: int = _key("flushConsumerOffsetInterval", 5000)
    # (ours) Pause between two scrubber passes over the committed log, ms (node/store/scrub.py);
    # the first pass starts one interval after start.
    store_scrub_interval_ms: int = _key("storeScrubIntervalMs", 600_000)
    # (ours) Scrubber read rate, MB/s (CRC checks of old data); 0 turns the scrubber off.
    store_scrub_rate_mb: int = _key("storeScrubRateMb", 4)

    # --- network --------------------------------------------------------------------------
    # HTTP API port (RocketMQ's remoting port); /metrics is served here too.
    listen_port: int = _key("listenPort", 10911)
    # (ours) Produce stream port: a pipelined binary send channel beside the HTTP API
    # (node/produce_stream.py), what the client SDK sends on when /health names it; 0 = off.
    # RocketMQ's fast channel sits at listenPort - 2 (10909), a good choice here too.
    stream_listen_port: int = _key("streamListenPort", 0)
    # Address the API binds to (RocketMQ NettyServerConfig.bindAddress).
    bind_address: str = _key("bindAddress", "0.0.0.0")
    # Address this node advertises (in offsetMsgId, leader hints). IPv4.
    broker_ip1: str = _key("brokerIP1", "127.0.0.1")
    # Classic HA: master's listening port for slaves.
    ha_listen_port: int = _key("haListenPort", 10912)
    # Classic HA: slave's `host:port` of the master's HA port; empty = learn from the controller.
    ha_master_address: str = _key("haMasterAddress", "")
    # Whether a classic slave or a DLedger follower serves pulls; false: they answer NOT_LEADER
    # naming the master or leader (clients follow it). Queries by key or id are served anyway.
    slave_read_enable: bool = _key("slaveReadEnable", False)
    # Controller API addresses `host:port;host:port` (namesrvAddr is accepted as an alias).
    controller_addr: str = _key("controllerAddr", "")
    # Classic HA: a slave further behind than this many bytes is not in sync (SLAVE_NOT_AVAILABLE).
    ha_max_gap_not_in_sync_bytes: int = _key("haMaxGapNotInSync", 256 * MIB)
    # Classic HA: SYNC_MASTER waits this long for a slave's ack before FLUSH_SLAVE_TIMEOUT, ms.
    ha_slave_ack_timeout_ms: int = _key("haSlaveAckTimeout", 5000)
    # Classic HA: a slave that has not held everything the master held at some moment within
    # this many ms leaves the master's in-sync set (and so the SyncStateSet), ms.
    ha_max_time_slave_not_catchup_ms: int = _key("haMaxTimeSlaveNotCatchup", 15_000)
    # Classic HA with a controller (ours): a master that has not heard the leader controller
    # confirm it for this long stops writing. Keep it below the controller's heartbeat timeout
    # (3000 ms by default) so a cut-off master stops before another can be elected, ms.
    controller_lease_timeout_ms: int = _key("controllerLeaseTimeoutMills", 2000)
    # Classic HA: SYNC_MASTER acks only when every SyncStateSet member has the message.
    all_ack_in_sync_state_set: bool = _key("allAckInSyncStateSet", False)
    # Classic HA: fewest SyncStateSet members (master included) for a SYNC_MASTER write.
    min_in_sync_replicas: int = _key("minInSyncReplicas", 1)
    # Classic HA with a controller: among equally fresh replicas the LOWER value is elected first (RocketMQ); -1 = brokerId.
    broker_election_priority: int = _key("brokerElectionPriority", -1)

    # --- DLedger ----------------------------------------------------------------------------
    # True: the commitlog is a DLedger Raft log replicated over dLegerPeers.
    enable_dleger_commit_log: bool = _key("enableDLegerCommitLog", False)
    # Raft group name (usually the brokerName).
    dleger_group: str = _key("dLegerGroup", "")
    # `n0-host:port;n1-host:port;...`: every member's id and Raft address.
    dleger_peers: str = _key("dLegerPeers", "")
    # This node's id in dLegerPeers.
    dleger_self_id: str = _key("dLegerSelfId", "")
    # Member that leadership is transferred to when it is healthy; empty = none.
    preferred_leader_id: str = _key("preferredLeaderId", "")
    # DLedger's push quota: a follower more than peerPushThrottlePoint bytes behind the
    # leader's last entry is pushed at most peerPushQuota bytes a second, so that catching it
    # up leaves the leader to its producers; never while its acks are needed for a commit.
    # (ours) peerPushQuota is 0 (no quota) by default, as Kafka's replication throttle and
    # RocketMQ's haFlowControlEnable: at DLedger's 20 MiB a follower behind a group that
    # writes faster than that never catches up.
    peer_push_throttle_point: int = _key("peerPushThrottlePoint", 300 * 1024 * 1024)
    peer_push_quota: int = _key("peerPushQuota", 0)
    # (ours) `n0-host:port;...`: every member's API address, for not-leader hints;
    # empty = each Raft host with the Raft port - 30000 (40911 -> 10911).
    dleger_peer_apis: str = _key("dLegerPeerApis", "")

    # --- broker semantics -------------------------------------------------------------------
    # Create an unknown topic on first send. (ours) off by default: a typo should not
    # silently create a topic (RocketMQ defaults to true and advises false in production).
    auto_create_topic_enable: bool = _key("autoCreateTopicEnable", False)
    # Queues of a topic created without a count (auto-create, POST /topics without queues).
    default_topic_queue_nums: int = _key("defaultTopicQueueNums", 8)
    # Upper bound on messages returned by one pull (RocketMQ maxTransferCountOnMessageInMemory).
    max_transfer_count_on_message_in_memory: int = _key("maxTransferCountOnMessageInMemory", 32)
    # Upper bound on consume-queue units scanned by one filtered pull.
    max_filter_message_count: int = _key("maxFilterMessageCount", 16_000)
    # Long polling: hold a pull that found nothing until a message arrives or wait_ms ends.
    long_polling_enable: bool = _key("longPollingEnable", True)
    # (ours) Longest wait_ms honoured, ms (RocketMQ's brokerSuspendMaxTimeMillis is 15 s).
    long_polling_max_wait_ms: int = _key("longPollingMaxWaitMs", 30_000)
    # (ours) Most pulls held at once; beyond it a pull answers immediately (short polling).
    long_polling_max_waiters: int = _key("longPollingMaxWaiters", 10_000)
    # (ours) Most messages in one send request.
    max_batch_messages: int = _key("maxBatchMessages", 1024)
    # How long an ordered consumer's queue lock lives unrenewed, ms (RocketMQ rebalance lockMaxLiveTime);
    # a new leader grants no lock for this long after taking over.
    rebalance_lock_max_live_time_ms: int = _key("rebalanceLockMaxLiveTimeMs", 60_000)
    # (ours) Largest HTTP request body, bytes: room for one max-size message in base64 JSON.
    max_request_bytes: int = _key("maxRequestBytes", 32 * MIB)
    # --- hard limits (node/limits.py; each refusal counts in rocketmq_limit_rejections_total) ---
    # (ours) Most properties on one message (user properties; TAGS/KEYS are added after).
    max_properties_per_message: int = _key("maxPropertiesPerMessage", 256)
    # (ours) Longest property name / value, UTF-8 bytes.
    max_property_name_bytes: int = _key("maxPropertyNameBytes", 255)
    max_property_value_bytes: int = _key("maxPropertyValueBytes", 16_384)
    # (ours) Encoded properties of one message (name \x01 value \x02 each), bytes; the record
    # format caps it at 32,767.
    max_properties_bytes: int = _key("maxPropertiesBytes", 32_767)
    # (ours) Most keys on one message (each is indexed).
    max_keys_per_message: int = _key("maxKeysPerMessage", 64)
    # (ours) HTTP requests in flight from one client address; beyond it 429 (retriable).
    max_inflight_requests_per_client: int = _key("maxInflightRequestsPerClient", 4096)
    # (ours) Inbound Raft connections held at once; beyond it a new one is closed on accept.
    raft_max_inbound_connections: int = _key("raftMaxInboundConnections", 32)
    # (ours) Inbound HA (slave) connections held at once on the master; beyond it closed on accept.
    ha_max_connections: int = _key("haMaxConnections", 64)
    # (ours) Topics this node holds (retry and DLQ topics included); a client's create of one
    # more is refused. Topics arriving through the log or from the controller are always applied.
    max_topics: int = _key("maxTopics", 10_000)
    # (ours) Consumer groups this node tracks (with live members or committed offsets); a heartbeat or
    # an offset commit of one more group is refused, known groups keep working.
    max_consumer_groups: int = _key("maxConsumerGroups", 10_000)
    # (ours) Client HTTP connections open at once on the API port, TLS handshakes in progress included;
    # beyond it a new connection is closed on accept.
    max_http_connections: int = _key("maxHttpConnections", 4096)
    # (ours) Produce stream connections open at once; beyond it a new one gets an ERROR frame and is closed.
    max_stream_connections: int = _key("maxStreamConnections", 1024)
    # Delay levels for scheduled messages and retries (RocketMQ's messageDelayLevel).
    message_delay_level: str = _key("messageDelayLevel",
                                    "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h")
    # Access control: every API request but /health, /metrics and the dashboard page must be
    # signed by an account of aclFile and hold the route's permission (node/auth.py, docs/security.md).
    acl_enable: bool = _key("aclEnable", False)
    # JSON ACL file (plain_acl.yml's shape); required when aclEnable=true (checked by node/auth.py's
    # preflight at start, which reads it); re-read when it changes.
    acl_file: str = _key("aclFile", "")
    # A signed request's timestamp may differ from the node's clock by at most this, ms.
    acl_replay_window_ms: int = _key("aclReplayWindowMs", 300_000)
    # Most nonces remembered for replay detection; when full the replay window shrinks.
    acl_nonce_cache_size: int = _key("aclNonceCacheSize", 200_000)
    # How often a request checks the ACL file's mtime for changes, ms.
    acl_reload_interval_ms: int = _key("aclReloadIntervalMs", 1000)
    # (ours) Python logging level of the node.
    log_level: str = _key("logLevel", "INFO")

    # --- peer security (node/peer_auth.py, node/tls.py, docs/security.md) ------------------------
    # Shared secret every Raft / HA peer proves it knows (challenge-response) before any frame is
    # read; it also signs requests to the controller. Empty (and no file) = peer auth off.
    # At least 16 bytes. Never shown by GET /config or /cluster.
    cluster_secret: str = field(default="", metadata={"key": "clusterSecret", "secret": True})
    # File holding the cluster secret (trailing whitespace dropped); preferred over clusterSecret.
    cluster_secret_file: str = _key("clusterSecretFile", "")
    # TLS on every listener: mutual TLS on Raft/HA ports, server-auth TLS on the HTTP API.
    tls_enable: bool = _key("tlsEnable", False)
    # PEM certificate (chain) and private key of this node; its names/IPs must match how peers dial it.
    tls_cert_file: str = _key("tlsCertFile", "")
    tls_key_file: str = _key("tlsKeyFile", "")
    # PEM CA bundle that peer certificates must chain to (required with tlsEnable=true).
    tls_ca_file: str = _key("tlsCaFile", "")

    # --- derived ----------------------------------------------------------------------------
    @property
    def cq_units_per_file(self) -> int:
        return self.maped_file_size_consume_queue // CQ_UNIT_BYTES

    @property
    def store_root(self) -> str:
        return os.path.abspath(os.path.expanduser(self.store_path_root_dir))

    @property
    def node_id(self) -> str:
        """Name used in logs and /health: the DLedger self id, else brokerName-brokerId."""
        return self.dleger_self_id or f"{self.broker_name}-{self.broker_id}"

    @property
    def group(self) -> str:
        return self.dleger_group or self.broker_name

    @property
    def api_address(self) -> str:
        return f"{self.broker_ip1}:{self.listen_port}"

    def validate(self) -> "BrokerConfig":
        """Raise ConfigError naming the first bad key; return self for chaining."""
        for check in _CHECKS:
            check(self)
        return self


# --- key table -----------------------------------------------------------------------------
FIELDS_BY_KEY: dict[str, dataclasses.Field] = {f.metadata["key"]: f for f in dataclasses.fields(BrokerConfig)}
KEY_OF: dict[str, str] = {f.name: k for k, f in FIELDS_BY_KEY.items()}
# Other spellings RocketMQ users write, mapped to ours.
ALIASES = {"namesrvAddr": "controllerAddr", "mappedFileSizeConsumeQueue": "mapedFileSizeConsumeQueue"}


def _fail(attr: str, why: str) -> None:
    raise ConfigError(f"{KEY_OF[attr]}: {why}")


def _in_range(attr: str, lo: int, hi: int):
    def check(c: BrokerConfig) -> None:
        v = getattr(c, attr)
        if not lo <= v <= hi:
            _fail(attr, f"must be {lo}..{hi}, got {v}")
    return check


def _one_of(attr: str, allowed: tuple[str, ...]):
    def check(c: BrokerConfig) -> None:
        v = getattr(c, attr)
        if v not in allowed:
            _fail(attr, f"must be one of {', '.join(allowed)}, got {v!r}")
    return check


def _check_cq_size(c: BrokerConfig) -> None:
    if c.maped_file_size_consume_queue % CQ_UNIT_BYTES:
        _fail("maped_file_size_consume_queue", f"must be a multiple of {CQ_UNIT_BYTES}, "
              f"got {c.maped_file_size_consume_queue}")


def _check_segment_fits_message(c: BrokerConfig) -> None:
    # A record never spans two files, so the largest record must fit one segment.
    if c.mapped_file_size_commit_log < c.max_message_size + 64 * 1024:
        _fail("mapped_file_size_commit_log", f"must exceed maxMessageSize ({c.max_message_size}) "
              f"by 64 KiB, got {c.mapped_file_size_commit_log}")


def _check_request_fits_message(c: BrokerConfig) -> None:
    need = c.max_message_size * 4 // 3 + 64 * 1024   # base64 body in JSON plus envelope
    if c.max_request_bytes < need:
        _fail("max_request_bytes", f"must be >= {need} to carry one maxMessageSize message, "
              f"got {c.max_request_bytes}")


def _check_delete_when(c: BrokerConfig) -> None:
    for part in c.delete_when.split(";"):
        if not (part.isdigit() and 0 <= int(part) <= 23):
            _fail("delete_when", f"must be hours 00-23 separated by ';', got {c.delete_when!r}")


def _check_page_cache_retain(c: BrokerConfig) -> None:
    v = c.page_cache_retain_bytes
    if v and not c.cold_read_hot_bytes <= v <= 1 << 50:
        _fail("page_cache_retain_bytes", f"must be 0 or coldReadHotBytes ({c.cold_read_hot_bytes}) to 2^50, got {v}: "
                                         f"bytes that close to a file's end are read on the event loop, taken as cached")


def _check_ip(c: BrokerConfig) -> None:
    if not re.fullmatch(r"(\d{1,3}\.){3}\d{1,3}", c.broker_ip1) or \
            any(int(p) > 255 for p in c.broker_ip1.split(".")):
        _fail("broker_ip1", f"must be an IPv4 address (it is stored in every record), got {c.broker_ip1!r}")


def _check_dledger(c: BrokerConfig) -> None:
    if not c.enable_dleger_commit_log:
        return
    peers = parse_dleger_peers(c.dleger_peers)
    if not peers:
        _fail("dleger_peers", "must list the group as id-host:port;... when enableDLegerCommitLog=true")
    if c.dleger_self_id not in peers:
        _fail("dleger_self_id", f"must be one of the dLegerPeers ids {sorted(peers)}, got {c.dleger_self_id!r}")
    if c.preferred_leader_id and c.preferred_leader_id not in peers:
        _fail("preferred_leader_id", f"must be one of {sorted(peers)}, got {c.preferred_leader_id!r}")
    for name, key in (("peer_push_throttle_point", "peerPushThrottlePoint"), ("peer_push_quota", "peerPushQuota")):
        if not 0 <= getattr(c, name) <= 1 << 50:
            _fail(name, f"{key} must be 0 to 2^50 bytes, got {getattr(c, name)}")
    if c.dleger_peer_apis:
        apis = parse_dleger_peers(c.dleger_peer_apis, key="dLegerPeerApis")
        if set(apis) != set(peers):
            _fail("dleger_peer_apis", f"must name the same ids as dLegerPeers {sorted(peers)}, got {sorted(apis)}")


def parse_delay_levels(text: str) -> list[int]:
    """`1s 5s 1m 2h` -> delays in ms; raises ConfigError naming messageDelayLevel."""
    units = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
    out = []
    for part in text.split():
        m = re.fullmatch(r"(\d+)([smhd])", part)
        if not m or int(m.group(1)) <= 0:
            raise ConfigError(f"messageDelayLevel: {part!r} is not a positive number with s, m, h or d")
        out.append(int(m.group(1)) * units[m.group(2)])
    if not out:
        raise ConfigError("messageDelayLevel: must list at least one level")
    return out


def _check_delay_levels(c: BrokerConfig) -> None:
    parse_delay_levels(c.message_delay_level)


def _check_names(c: BrokerConfig) -> None:
    for attr in ("broker_cluster_name", "broker_name"):
        v = getattr(c, attr)
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", v):
            _fail(attr, f"must be 1..64 chars of [A-Za-z0-9_.-], got {v!r}")
    if c.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        _fail("log_level", f"must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {c.log_level!r}")


def _check_peer_security(c: BrokerConfig) -> None:
    if c.cluster_secret and c.cluster_secret_file:
        _fail("cluster_secret", "give clusterSecret or clusterSecretFile, not both")
    if c.cluster_secret and not 16 <= len(c.cluster_secret.encode("utf-8")) <= 4096:
        _fail("cluster_secret", "must be 16..4096 bytes (generate one: "
              "python3 -c 'import secrets; print(secrets.token_urlsafe(32))')")
    if c.tls_enable:
        for attr in ("tls_cert_file", "tls_key_file", "tls_ca_file"):
            if not getattr(c, attr):
                _fail(attr, "required when tlsEnable=true")


_CHECKS = (
    _check_names,
    _check_peer_security,
    _one_of("broker_role", BROKER_ROLES),
    _one_of("flush_disk_type", FLUSH_DISK_TYPES),
    _in_range("broker_id", 0, 1_000),
    _in_range("listen_port", 1, 65535),
    _in_range("ha_listen_port", 1, 65535),
    _in_range("stream_listen_port", 0, 65535),
    _in_range("max_stream_connections", 1, 1_000_000),
    _in_range("flush_interval_commit_log_ms", 1, 60_000),
    _in_range("sync_flush_timeout_ms", 1, 600_000),
    _in_range("mapped_file_size_commit_log", 4096, 1 << 40),
    _in_range("disk_reserve_bytes", 0, 1 << 30),
    _in_range("maped_file_size_consume_queue", CQ_UNIT_BYTES, 1 << 34),
    _check_cq_size,
    _in_range("max_message_size", 1, 256 * MIB),
    _check_segment_fits_message,
    _check_request_fits_message,
    _in_range("max_hash_slot_num", 1, 1 << 28),
    _in_range("max_index_num", 1, 1 << 28),
    _in_range("file_reserved_time_hours", 0, 24 * 365 * 10),
    _check_delete_when,
    _in_range("disk_max_used_space_ratio_pct", 10, 95),
    _in_range("disk_space_warning_level_ratio_pct", 10, 99),
    _in_range("flush_consumer_offset_interval_ms", 100, 600_000),
    _in_range("loop_stall_warn_ms", 0, 600_000),
    _in_range("cold_read_hot_bytes", 0, 1 << 50),
    _check_page_cache_retain,
    _in_range("store_scrub_interval_ms", 10, 86_400_000),
    _in_range("store_scrub_rate_mb", 0, 10_000),
    _check_ip,
    _check_dledger,
    _in_range("default_topic_queue_nums", 1, 1024),
    _in_range("max_transfer_count_on_message_in_memory", 1, 1024),
    _in_range("max_filter_message_count", 1, 1_000_000),
    _in_range("long_polling_max_wait_ms", 0, 600_000),
    _in_range("long_polling_max_waiters", 0, 1_000_000),
    _in_range("max_batch_messages", 1, 100_000),
    _in_range("rebalance_lock_max_live_time_ms", 100, 600_000),
    _in_range("max_request_bytes", 1, 1 << 31),
    _in_range("max_properties_per_message", 1, 4096),
    _in_range("max_property_name_bytes", 1, 32_767),
    _in_range("max_property_value_bytes", 1, 32_767),
    _in_range("max_properties_bytes", 1, 32_767),
    _in_range("max_keys_per_message", 1, 1024),
    _in_range("max_inflight_requests_per_client", 1, 1_000_000),
    _in_range("raft_max_inbound_connections", 1, 4096),
    _in_range("ha_max_connections", 1, 4096),
    _in_range("max_topics", 1, 1_000_000),
    _in_range("max_consumer_groups", 1, 1_000_000),
    _in_range("max_http_connections", 1, 1_000_000),
    _in_range("ha_max_gap_not_in_sync_bytes", 0, 1 << 40),
    _in_range("ha_slave_ack_timeout_ms", 1, 600_000),
    _in_range("ha_max_time_slave_not_catchup_ms", 100, 3_600_000),
    _in_range("controller_lease_timeout_ms", 100, 600_000),
    _in_range("min_in_sync_replicas", 1, 16),
    _in_range("broker_election_priority", -1, 1 << 30),
    _check_delay_levels,
    _in_range("acl_replay_window_ms", 1000, 86_400_000),
    _in_range("acl_nonce_cache_size", 1000, 10_000_000),
    _in_range("acl_reload_interval_ms", 10, 600_000),
)


def parse_dleger_peers(text: str, key: str = "dLegerPeers") -> dict[str, str]:
    """`n0-host:port;n1-host:port` -> {id: host:port}; raises ConfigError naming `key` if malformed."""
    peers: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        ident, sep, addr = part.partition("-")
        host, colon, port = addr.rpartition(":")
        if not (sep and ident and colon and host and port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(f"{key}: entry {part!r} is not id-host:port")
        if ident in peers:
            raise ConfigError(f"{key}: id {ident!r} appears twice")
        peers[ident] = addr
    return peers


# --- Java properties syntax ---------------------------------------------------------------
_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}


def _logical_lines(text: str):
    """Yield (line_number, logical line): comments dropped, continuations joined."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        start, line = i + 1, lines[i].lstrip(" \t\f")
        i += 1
        if not line or line[0] in "#!":
            continue
        # An odd number of trailing backslashes continues onto the next line.
        while (len(line) - len(line.rstrip("\\"))) % 2 == 1 and i < len(lines):
            line = line[:-1] + lines[i].lstrip(" \t\f")
            i += 1
        if (len(line) - len(line.rstrip("\\"))) % 2 == 1:
            line = line[:-1]  # continuation at end of file: Java drops the backslash
        yield start, line


def _unescape(s: str, line_no: int) -> str:
    out: list[str] = []
    i = 0
    while i < len(s):
        ch = s[i]
        if ch != "\\" or i + 1 == len(s):
            out.append(ch)
            i += 1
            continue
        nxt = s[i + 1]
        if nxt == "u":
            hexpart = s[i + 2:i + 6]
            if len(hexpart) != 4 or not all(c in "0123456789abcdefABCDEF" for c in hexpart):
                raise ConfigError(f"line {line_no}: malformed \\uXXXX escape {s[i:i + 6]!r}")
            out.append(chr(int(hexpart, 16)))
            i += 6
        else:
            out.append(_ESCAPES.get(nxt, nxt))
            i += 2
    return "".join(out)


def _split_key_value(line: str) -> tuple[str, str]:
    """Key ends at the first unescaped '=', ':' or whitespace; one separator is consumed."""
    i = 0
    while i < len(line) and line[i] not in "=: \t\f":
        i += 2 if line[i] == "\\" else 1
    key, rest = line[:i], line[i:].lstrip(" \t\f")
    if rest[:1] in ("=", ":"):
        rest = rest[1:].lstrip(" \t\f")
    return key, rest


def parse_properties(text: str) -> dict[str, str]:
    """Java `Properties.load` semantics; later duplicates win, as in Java."""
    props: dict[str, str] = {}
    for line_no, line in _logical_lines(text):
        key, value = _split_key_value(line)
        props[_unescape(key, line_no)] = _unescape(value, line_no)
    return props


# --- typed conversion -------------------------------------------------------------------------
def _convert(key: str, raw: str, kind: type) -> Any:
    raw = raw.strip()
    if kind is bool:
        if raw.lower() in ("true", "false"):
            return raw.lower() == "true"
        raise ConfigError(f"{key}: must be true or false, got {raw!r}")
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{key}: must be an integer, got {raw!r}") from None
    return raw


def _field_type(f: dataclasses.Field) -> type:
    return {"int": int, "bool": bool, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]


def from_properties(props: Mapping[str, str]) -> tuple[BrokerConfig, list[str]]:
    """Typed, validated config plus warnings (unknown keys). Raises ConfigError."""
    values: dict[str, Any] = {}
    warnings: list[str] = []
    for raw_key, raw in props.items():
        key = ALIASES.get(raw_key, raw_key)
        f = FIELDS_BY_KEY.get(key)
        if f is None:
            warnings.append(f"unknown config key {raw_key!r} ignored")
            continue
        values[f.name] = _convert(raw_key, raw, _field_type(f))
    return BrokerConfig(**values).validate(), warnings


def env_overrides(environ: Mapping[str, str]) -> dict[str, str]:
    """`MQSTORE_<key>=value` pairs, keyed by the broker.conf key."""
    return {k[len(ENV_PREFIX):]: v for k, v in environ.items() if k.startswith(ENV_PREFIX) and len(k) > len(ENV_PREFIX)}


def load_config(path: str | None, environ: Mapping[str, str] | None = None) -> BrokerConfig:
    """Read `path` (None = defaults only), apply environment overrides, validate; log warnings."""
    props: dict[str, str] = {}
    if path is not None:
        try:
            with open(path, encoding="latin-1") as f:  # Java reads .properties as ISO-8859-1
                props = parse_properties(f.read())
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    props.update(env_overrides(os.environ if environ is None else environ))
    config, warnings = from_properties(props)
    for w in warnings:
        log.warning(w)
    return config


def to_properties(config: BrokerConfig) -> dict[str, str]:
    """The config as broker.conf key -> text (for /cluster, brokerStatus and round-trip tests)."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        if f.metadata.get("secret"):
            v = "<redacted>" if v else ""   # secrets never leave the node through the API
        out[f.metadata["key"]] = str(v).lower() if isinstance(v, bool) else str(v)
    return out
