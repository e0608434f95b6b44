"""How classic HA plugs into the node (for the lead's `node.server.build_log`).

    log = build_ha_log(config, fs, checkpoint)     # an HALog, or None when classic HA is off
    attach_truncation(broker)                       # after build_broker: CQs follow truncations

Classic HA is on when `brokerRole=SLAVE`, `haMasterAddress` or `controllerAddr` is set,
or `brokerRole=SYNC_MASTER` (a SYNC_MASTER without the HA port could never be acked).
With `controllerAddr` the broker's role comes from the controller (it starts as a slave
with no master and writes are refused until the controller names a master).
`python -m ha.node_launcher -c broker.conf` runs the real node with this wiring, until
`node.server.build_log` calls it directly.
"""

from __future__ import annotations

import logging

from ha.ha_log import HALog, ha_log_from_broker_config
from node.local_log import LocalLogConfig
from node.store.fileio import FileSystem
from node.store.retention import RetentionPolicy

log = logging.getLogger(__name__)


def classic_ha_enabled(config) -> bool:
    if config.enable_dleger_commit_log:
        return False
    return (config.broker_role in ("SLAVE", "SYNC_MASTER") or bool(config.ha_master_address)
            or bool(config.controller_addr))


def build_ha_log(config, fs: FileSystem, checkpoint) -> HALog | None:
    if not classic_ha_enabled(config):
        return None
    retention = RetentionPolicy(file_reserved_time_hours=config.file_reserved_time_hours,
                                delete_when=config.delete_when,
                                disk_max_used_space_ratio=config.disk_max_used_space_ratio_pct,
                                disk_space_warning_level_ratio=config.disk_space_warning_level_ratio_pct)
    llc = LocalLogConfig(segment_size_bytes=config.mapped_file_size_commit_log,
                         flush_disk_type=config.flush_disk_type,
                         flush_interval_ms=config.flush_interval_commit_log_ms,
                         sync_flush_timeout_ms=config.sync_flush_timeout_ms,
                         store_ip=config.broker_ip1, store_port=config.listen_port, retention=retention)
    checkpoint.load()
    return ha_log_from_broker_config(config, fs, llc, checkpoint.committed_offset)


def attach_truncation(broker) -> None:
    """When the HALog truncates (an old master rejoining), cut consume queues and rewind dispatch."""
    halog = broker.log
    if not isinstance(halog, HALog):
        return

    def on_truncate(offset: int) -> None:
        cut = broker.cq_store.truncate_past_physical(offset)
        d = broker.dispatcher
        d.position = min(d.position, offset)
        d.flushed_position = min(d.flushed_position, offset)
        log.warning("truncation to %d: dropped %d consume-queue units; dispatch resumes at %d", offset, cut,
                    d.position)

    halog.truncate_listeners.append(on_truncate)
