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
from typing import Awaitable

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

    def on_truncate(offset: int) -> Awaitable[None]:
        def truncate() -> None:
            cut = broker.dispatcher.cut_queues(offset, rewind_to=offset)
            log.warning("truncation to %d: dropped %d consume-queue units; dispatch resumes at %d", offset, cut,
                        broker.dispatcher.position)
        broker.dispatcher.when_recovered(truncate)    # not under the start's recovery of the queues
        # The HALog goes on (syncs new bytes over the cut) once the cut queues are durable: a
        # crash then cannot leave units of the old tail pointing at the new bytes.
        return broker.dispatcher.queues_settled()

    halog.truncate_listeners.append(on_truncate)

    def on_reset(offset: int) -> None:
        def reset() -> None:
            broker.dispatcher.skip_to(offset)
            log.warning("slave log restarts at %d: dispatch resumes there", offset)
        broker.dispatcher.when_recovered(reset)

    halog.reset_listeners.append(on_reset)


def dledger_heartbeat(config, log) -> dict:
    """A DLedger node's heartbeat: the controller learns the group's leader from it, so routes
    follow leader changes. DLedger elects by itself; the controller never decides for it."""
    st = log.status()
    digits = "".join(ch for ch in str(config.dleger_self_id) if ch.isdigit())
    return {"group": config.group, "broker_id": int(digits) if digits else config.broker_id,
            "addr": config.api_address, "mode": "dledger", "term": int(st.get("term") or 0),
            "is_leader": log.role() == "LEADER", "max_offset": int(log.committed_position)}


async def start_controller_reporter(broker, config):
    """DLedger node with `controllerAddr`: heartbeat the controller about once a second.
    Returns the ControllerClient (stop it on shutdown), or None when there is nothing to do.
    Classic HA runs its own heartbeats inside HALog; standalone nodes do not report."""
    if not config.enable_dleger_commit_log or not config.controller_addr:
        return None
    from ha.controller_server import ControllerClient
    addrs = [a.strip() for a in config.controller_addr.replace(",", ";").split(";") if a.strip()]

    async def ignore(_reply: dict) -> None:
        return None

    from node.peer_auth import peer_security_from_config
    client = ControllerClient(addrs, lambda: dledger_heartbeat(config, broker.log), ignore,
                              security=peer_security_from_config(config))
    client.topic_sink = broker.apply_controller_topics   # the leader creates the controller's topics
    client.start()
    log.info("reporting DLedger role to controller(s) %s", addrs)
    return client
