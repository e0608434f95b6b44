"""How classic HA plugs into the node (`node.server.build_log` and `build_broker`).

    log = build_ha_log(config, fs, checkpoint)     # an HALog, or None when classic HA is off
    attach_truncation(broker)                       # after build_broker: CQs follow truncations

Classic HA is on when `brokerRole=SLAVE`, `haMasterAddress` or `controllerAddr` is set,
or `brokerRole=SYNC_MASTER` (a SYNC_MASTER without the HA port could never be acked).
With `controllerAddr` the broker's role comes from the controller (it starts as a slave
with no master and writes are refused until the controller names a master).
"""

from __future__ import annotations

import logging

from ha.ha_log import HALog, ha_log_from_broker_config
from node.store.fileio import FileSystem

log = logging.getLogger(__name__)


def classic_ha_enabled(config) -> bool:
    if config.enable_dleger_commit_log:
        return False
    return (config.broker_role in ("SLAVE", "SYNC_MASTER") or bool(config.ha_master_address)
            or bool(config.controller_addr))


def build_ha_log(config, fs: FileSystem, checkpoint) -> HALog | None:
    if not classic_ha_enabled(config):
        return None
    from node.server import local_log_config
    checkpoint.load()
    return ha_log_from_broker_config(config, fs, local_log_config(config), checkpoint.committed_offset)


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
