"""Goal: broker.conf keys map onto HALog the way the wiring module documents. Method:
build BrokerConfigs from properties and inspect the HALogConfig (no IO started)."""

import pytest

from ha.ha_log import MASTER, SLAVE
from ha.wiring import build_ha_log, classic_ha_enabled
from node.config import ConfigError, load_config
from node.store.checkpoint import Checkpoint
from node.store.fileio import FileSystem


def conf(tmp_path, **kv):
    base = {"storePathRootDir": str(tmp_path), "mappedFileSizeCommitLog": "1048576", "maxMessageSize": "262144"}
    base.update(kv)
    path = tmp_path / "broker.conf"
    path.write_text("\n".join(f"{k}={v}" for k, v in base.items()))
    return load_config(str(path), environ={})


def build(c):
    fs = FileSystem()
    fs.makedirs(c.store_root)
    return build_ha_log(c, fs, Checkpoint(fs, c.store_root))


def test_standalone_async_master_stays_local(tmp_path):
    c = conf(tmp_path, brokerRole="ASYNC_MASTER")
    assert not classic_ha_enabled(c)
    assert build(c) is None


def test_static_slave(tmp_path):
    c = conf(tmp_path, brokerRole="SLAVE", brokerId="1", haMasterAddress="10.0.0.1:10912")
    h = build(c)
    assert h.cfg.initial_role == SLAVE and h.cfg.ha_master_address == "10.0.0.1:10912"
    assert h.cfg.master_api_address == "10.0.0.1:10911" and h.leader() == "10.0.0.1:10911"


def test_sync_master_with_controller(tmp_path):
    c = conf(tmp_path, brokerRole="SYNC_MASTER", brokerName="broker-b", controllerAddr="a:9876;b:9876")
    h = build(c)
    assert h.cfg.sync_master and h.cfg.controller_mode and h.cfg.initial_role == MASTER
    assert h.role() == SLAVE                     # with a controller, nobody is master until told
    assert h.cfg.controller_addrs == ("a:9876", "b:9876") and h.cfg.group == "broker-b"
    assert h.cfg.self_ha_address.endswith(":10912")


def test_lease_and_catchup_keys_reach_the_ha_log(tmp_path):
    h = build(conf(tmp_path, brokerRole="SYNC_MASTER", controllerAddr="a:9876"))
    assert h.cfg.controller_lease_ms == 2000 and h.cfg.timings.max_time_slave_not_catchup_ms == 15_000
    h = build(conf(tmp_path, brokerRole="SYNC_MASTER", controllerAddr="a:9876", controllerLeaseTimeoutMills="1200",
                   haMaxTimeSlaveNotCatchup="4000"))
    assert h.cfg.controller_lease_ms == 1200 and h.core.timings.max_time_slave_not_catchup_ms == 4000


@pytest.mark.parametrize("key,value", [("controllerLeaseTimeoutMills", "0"), ("controllerLeaseTimeoutMills", "99"),
                                       ("controllerLeaseTimeoutMills", "2s"), ("haMaxTimeSlaveNotCatchup", "-1"),
                                       ("haMaxTimeSlaveNotCatchup", "3600001")])
def test_lease_and_catchup_keys_are_validated(tmp_path, key, value):
    with pytest.raises(ConfigError) as e:
        conf(tmp_path, brokerRole="SYNC_MASTER", **{key: value})
    assert key in str(e.value)


def test_lease_not_below_the_controller_timeout_is_reported_once(tmp_path, caplog):
    h = build(conf(tmp_path, brokerRole="SYNC_MASTER", controllerAddr="a:9876", controllerLeaseTimeoutMills="3000"))
    with caplog.at_level("ERROR", logger="ha.ha_log"):
        h._check_lease_against(3000)
        h._check_lease_against(3000)
    assert sum("controllerLeaseTimeoutMills=3000" in r.getMessage() for r in caplog.records) == 1
    ok = build(conf(tmp_path, brokerRole="SYNC_MASTER", controllerAddr="a:9876"))
    with caplog.at_level("ERROR", logger="ha.ha_log"):
        ok._check_lease_against(3000)
    assert sum("controllerLeaseTimeoutMills=2000" in r.getMessage() for r in caplog.records) == 0
