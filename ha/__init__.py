"""Classic master/slave HA and the controller (DESIGN section 4).

- `ha.protocol`      wire codec (slave report, master push), pure
- `ha.replication`   pure cores: HAConnectionCore, HAClientCore, HAServiceCore (+ their tables)
- `ha.epoch`         epochFileCheckpoint (RocketMQ's text format) and the consistent-point search
- `ha.shell`         asyncio shells: HAService / HAConnection (master), HAClient (slave)
- `ha.ha_log`        HALog, the ReplicatedLog for classic mode
- `ha.controller`    pure election and replicated ops + the pysyncobj state machine
- `ha.controller_server`  the `mqstore controller` process (`main`) and the broker-side ControllerClient
- `ha.wiring`        build_ha_log(config, fs, checkpoint) / attach_truncation(broker) for node.server

`python -m ha --data-dir DIR [--port 9876 --raft-port 9878 --peers h:p,h:p --peer-apis h:p,h:p]`
runs a controller.
"""
