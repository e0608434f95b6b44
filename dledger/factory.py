"""Build a DLedgerLog from the broker's config (node.server.build_log calls it).

Keys read: dLegerGroup (default brokerName), dLegerPeers `n0-host:port;...` (Raft
addresses), dLegerSelfId, preferredLeaderId, flushDiskType, flushIntervalCommitLog,
syncFlushTimeout (append wait), storePathRootDir, mappedFileSizeCommitLog (data
segment size: must be equal on every replica), brokerIP1/listenPort (store host
stamped into records), fileReservedTime / deleteWhen / disk ratios (retention).

Peers' API addresses (for NotLeader hints): `dLegerPeerApis` `n0-host:port;...` if
set; otherwise by convention the Raft host and Raft port - 30000
(40911 -> 10911, RocketMQ's default pair). This node's own API address is always
brokerIP1:listenPort.
"""

from __future__ import annotations

import random

from dledger.core import RaftConfig
from dledger.dledger_log import DLedgerLog
from dledger.entry_store import EntryStore
from dledger.shell import RaftNode, ShellConfig
from node.config import BrokerConfig, ConfigError, parse_dleger_peers
from node.store.disk_guard import DiskGuard
from node.store.fileio import FileSystem
from node.store.reserve import DiskReserve

API_PORT_OFFSET = 30000
DISK_LOOK_INTERVAL_MS = 50       # how stale the disk-usage ratio the DLedger log refuses by may be


def peer_addresses(config: BrokerConfig) -> dict[str, tuple[str, int]]:
    peers = parse_dleger_peers(config.dleger_peers)
    out: dict[str, tuple[str, int]] = {}
    for ident, addr in peers.items():
        host, _, port = addr.rpartition(":")
        out[ident] = (host, int(port))
    return out


def peer_api_addresses(config: BrokerConfig, raft: dict[str, tuple[str, int]]) -> dict[str, str]:
    if config.dleger_peer_apis:
        apis = parse_dleger_peers(config.dleger_peer_apis, key="dLegerPeerApis")
        missing = set(raft) - set(apis)
        if missing:
            raise ConfigError(f"dLegerPeerApis: no API address for {sorted(missing)}")
    else:
        apis = {}
        for ident, (host, port) in raft.items():
            if port <= API_PORT_OFFSET:
                raise ConfigError(f"dLegerPeers: cannot derive {ident}'s API port from Raft port {port}; "
                                  "set dLegerPeerApis")
            apis[ident] = f"{host}:{port - API_PORT_OFFSET}"
    apis[config.dleger_self_id] = config.api_address
    return apis


def build_dledger_log(config: BrokerConfig, fs: FileSystem | None = None,
                      raft_config: RaftConfig | None = None) -> DLedgerLog:
    """The DLedger-mode ReplicatedLog; call `await log.start()` to recover and join the group."""
    if not config.enable_dleger_commit_log:
        raise ConfigError("enableDLegerCommitLog is false")
    raft = peer_addresses(config)
    if config.dleger_self_id not in raft:
        raise ConfigError(f"dLegerSelfId {config.dleger_self_id!r} is not in dLegerPeers")
    fs = fs or FileSystem()
    store = EntryStore(fs, config.store_root, config.dleger_self_id,
                       data_segment_size=config.mapped_file_size_commit_log,
                       reserve=DiskReserve(fs, config.store_root, config.disk_reserve_bytes))
    shell = ShellConfig(flush_disk_type=config.flush_disk_type,
                        async_flush_interval_ms=config.flush_interval_commit_log_ms)
    ticks_a_second = max(1, 1000 // shell.tick_ms)
    rc = raft_config or RaftConfig(preferred_leader_id=config.preferred_leader_id or None,
                                   push_throttle_point_bytes=config.peer_push_throttle_point,
                                   push_quota_bytes_per_tick=-(-config.peer_push_quota // ticks_a_second),
                                   push_quota_window_ticks=ticks_a_second)
    from dledger.transport import TransportConfig
    from node.peer_auth import peer_security_from_config
    from node.server import retention_policy
    security = peer_security_from_config(config, (raft[config.dleger_self_id][0],))
    node = RaftNode(config.dleger_self_id, config.group, raft, store, rc, shell,
                    transport_config=TransportConfig(security=security,
                                                     max_inbound_connections=config.raft_max_inbound_connections), rng=random.Random())
    return DLedgerLog(node, peer_api_addresses(config, raft), store_host=config.broker_ip1,
                      store_port=config.listen_port, append_timeout_s=config.sync_flush_timeout_ms / 1000,
                      # looked at by sends and appends received, at most DISK_LOOK_INTERVAL_MS stale:
                      # a disk filling fast is refused before the write, not met by an ENOSPC that
                      # stalls Raft (a statvfs per message was 2-3 % of a node's CPU one at a time)
                      disk=DiskGuard(fs, config.store_root, config.disk_space_warning_level_ratio_pct,
                                     check_interval_ms=DISK_LOOK_INTERVAL_MS),
                      retention=retention_policy(config))
