"""Classic master/slave HA and the controller (DESIGN section 4).

- `ha.protocol`      wire codec (slave report, master push), pure
- `ha.replication`   pure cores: HAConnectionCore, HAClientCore, HAServiceCore (+ their tables)
- `ha.epoch`         epochFileCheckpoint (RocketMQ's text format) and the consistent-point search
- `ha.shell`         asyncio shells: HAService / HAConnection (master), HAClient (slave)
- `ha.ha_log`        HALog, the ReplicatedLog for classic mode
- `ha.controller`    pure election and replicated ops + the pysyncobj state machine
- `ha.controller_server`  the `mqstore controller` process (`main`) and the broker-side ControllerClient
- `ha.wiring`        build_ha_log(config, fs, checkpoint) / attach_truncation(broker) for node.server;
                     start_controller_reporter(broker, config): DLedger nodes report their leader
- `mqstore.admin_ha` CLI verbs haStatus, getSyncStateSet, electMaster, getControllerMetaData
- `bench.bench_ha`   SYNC/ASYNC_MASTER vs standalone, slave catch-up, failover (`python -m bench.bench_ha`)

A master in controller mode holds a lease: without the leader controller's confirmation for
`HALogConfig.controller_lease_ms` (2 s, below the controller's 3 s heartbeat timeout) it
steps down and refuses writes, so a master partitioned from the controller cannot keep
writing while the controller elects another.

`python -m ha --data-dir DIR [--port 9876 --raft-port 9878 --peers h:p,h:p --peer-apis h:p,h:p]`
runs a controller.
"""
