"""build_dledger_log reads the broker config keys into a wired DLedgerLog."""

from __future__ import annotations

import pytest

from dledger.factory import build_dledger_log
from node.config import BrokerConfig, ConfigError


def cfg(tmp_path, **kw) -> BrokerConfig:
    base = dict(enable_dleger_commit_log=True, dleger_group="broker-a",
                dleger_peers="n0-127.0.0.1:40911;n1-127.0.0.1:40912;n2-127.0.0.1:40913",
                dleger_self_id="n1", preferred_leader_id="n0", flush_disk_type="SYNC_FLUSH",
                store_path_root_dir=str(tmp_path), listen_port=10921, mapped_file_size_commit_log=8 << 20)
    base.update(kw)
    return BrokerConfig(**base).validate()


def test_builds_from_config(tmp_path):
    log = build_dledger_log(cfg(tmp_path))
    node = log.node
    assert node.node_id == "n1" and node.group == "broker-a"
    assert node.peers["n2"] == ("127.0.0.1", 40913)
    assert node.raft_config.preferred_leader_id == "n0"
    assert node.config.flush_disk_type == "SYNC_FLUSH"
    assert log.store.segment_size == 8 << 20
    assert log.store.dir == str(tmp_path / "dledger-n1")
    # API addresses: own from brokerIP1:listenPort, others by the port convention.
    assert log.peer_api_addrs == {"n0": "127.0.0.1:10911", "n1": "127.0.0.1:10921", "n2": "127.0.0.1:10913"}


def test_the_push_quota_is_off_by_default_and_a_quota_a_second_becomes_one_a_tick(tmp_path):
    rc = build_dledger_log(cfg(tmp_path / "a")).node.raft_config
    assert (rc.push_quota_bytes_per_tick, rc.push_throttle_point_bytes) == (0, 300 << 20)
    rc = build_dledger_log(cfg(tmp_path / "b", peer_push_quota=20 << 20, peer_push_throttle_point=1 << 30)).node.raft_config
    assert (rc.push_quota_bytes_per_tick, rc.push_quota_window_ticks, rc.push_throttle_point_bytes) == (1 << 20, 20, 1 << 30)


def test_refuses_when_disabled(tmp_path):
    with pytest.raises(ConfigError):
        build_dledger_log(BrokerConfig(store_path_root_dir=str(tmp_path)))
