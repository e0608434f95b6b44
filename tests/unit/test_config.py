"""broker.conf parsing: Java properties syntax, RocketMQ key names, env overrides, validation.

Method: feed text through parse_properties / load_config and check the typed BrokerConfig;
every invalid value must raise ConfigError naming its key.
"""

import dataclasses

import pytest

from node.config import (BrokerConfig, ConfigError, from_properties, load_config, parse_dleger_peers,
                         parse_properties, to_properties)


def test_defaults_match_design_section_6():
    c = BrokerConfig().validate()
    assert c.listen_port == 10911 and c.ha_listen_port == 10912
    assert c.broker_role == "ASYNC_MASTER" and c.flush_disk_type == "ASYNC_FLUSH"
    assert c.maped_file_size_consume_queue == 300_000 * 20 and c.cq_units_per_file == 300_000
    assert c.mapped_file_size_commit_log == 1 << 30
    assert c.file_reserved_time_hours == 72 and c.delete_when == "04"
    assert c.disk_max_used_space_ratio_pct == 75 and c.max_message_size == 4 << 20
    assert c.long_polling_enable and not c.acl_enable and not c.enable_dleger_commit_log


def test_java_properties_syntax():
    text = (
        "# comment\n"
        "! also a comment\n"
        "   \n"
        "brokerName = broker-b\n"
        "brokerClusterName:Cluster1\n"
        "deleteWhen 03\n"
        "dLegerPeers=n0-127.0.0.1:40911;\\\n"
        "    n1-127.0.0.1:40912\n"
        "weird\\=key=a\\u0041b\\tc\n"
        "empty=\n"
        "brokerName=broker-c\n"
    )
    props = parse_properties(text)
    assert props["brokerName"] == "broker-c"               # later duplicate wins, like Java
    assert props["brokerClusterName"] == "Cluster1"
    assert props["deleteWhen"] == "03"
    assert props["dLegerPeers"] == "n0-127.0.0.1:40911;n1-127.0.0.1:40912"
    assert props["weird=key"] == "aAb\tc"
    assert props["empty"] == ""


def test_malformed_unicode_escape_is_a_config_error():
    with pytest.raises(ConfigError, match="line 1"):
        parse_properties("a=\\u00zz\n")


def test_typed_values_and_aliases():
    c, warnings = from_properties({"listenPort": "10921", "slaveReadEnable": "TRUE", "namesrvAddr": "h:9876",
                                   "mappedFileSizeConsumeQueue": "6000", "flushDiskType": "SYNC_FLUSH"})
    assert c.listen_port == 10921 and c.slave_read_enable is True
    assert c.controller_addr == "h:9876" and c.maped_file_size_consume_queue == 6000
    assert c.flush_disk_type == "SYNC_FLUSH" and warnings == []


def test_unknown_keys_warn_not_fail():
    c, warnings = from_properties({"brokerName": "x", "transientStorePoolEnable": "false"})
    assert c.broker_name == "x"
    assert warnings == ["unknown config key 'transientStorePoolEnable' ignored"]


@pytest.mark.parametrize("key,value,message", [
    ("listenPort", "0", "listenPort: must be 1..65535, got 0"),
    ("listenPort", "abc", "listenPort: must be an integer, got 'abc'"),
    ("brokerRole", "MASTER", "brokerRole: must be one of ASYNC_MASTER, SYNC_MASTER, SLAVE, got 'MASTER'"),
    ("flushDiskType", "SOMETIMES", "flushDiskType: must be one of"),
    ("slaveReadEnable", "yes", "slaveReadEnable: must be true or false"),
    ("mapedFileSizeConsumeQueue", "1001", "mapedFileSizeConsumeQueue: must be a multiple of 20"),
    ("deleteWhen", "25", "deleteWhen: must be hours"),
    ("brokerIP1", "my-host", "brokerIP1: must be an IPv4 address"),
    ("mappedFileSizeCommitLog", "1048576", "mappedFileSizeCommitLog: must exceed maxMessageSize"),
    ("maxRequestBytes", "1000", "maxRequestBytes: must be >="),
    ("brokerName", "a b", "brokerName: must be"),
    ("pageCacheRetainBytes", "1048576", "pageCacheRetainBytes: must be 0 or coldReadHotBytes"),
])
def test_validation_names_the_bad_key(key, value, message):
    with pytest.raises(ConfigError) as ei:
        from_properties({key: value})
    assert message in str(ei.value)


def test_dledger_settings_are_checked_together():
    ok, _ = from_properties({"enableDLegerCommitLog": "true", "dLegerGroup": "g", "dLegerSelfId": "n1",
                             "dLegerPeers": "n0-127.0.0.1:40911;n1-127.0.0.1:40912;n2-127.0.0.1:40913"})
    assert ok.node_id == "n1" and ok.group == "g"
    with pytest.raises(ConfigError, match="dLegerSelfId: must be one of"):
        from_properties({"enableDLegerCommitLog": "true", "dLegerPeers": "n0-h:1", "dLegerSelfId": "n9"})
    with pytest.raises(ConfigError, match="dLegerPeers: entry 'n0h:1'"):
        parse_dleger_peers("n0h:1")
    assert parse_dleger_peers("n0-a:1; n1-b:2") == {"n0": "a:1", "n1": "b:2"}
    group = {"enableDLegerCommitLog": "true", "dLegerGroup": "g", "dLegerSelfId": "n0", "dLegerPeers": "n0-h:1"}
    with pytest.raises(ConfigError, match="peerPushQuota must be 0 to 2"):
        from_properties({**group, "peerPushQuota": "-1"})
    quota, _ = from_properties({**group, "peerPushQuota": "20971520"})
    assert (quota.peer_push_quota, quota.peer_push_throttle_point) == (20 << 20, 300 << 20)


def test_file_plus_environment_overrides(tmp_path):
    conf = tmp_path / "broker.conf"
    conf.write_text("listenPort=10911\nbrokerName=broker-a\nstorePathRootDir=/tmp/x\n")
    c = load_config(str(conf), {"MQSTORE_listenPort": "10921", "PATH": "/bin", "MQSTORE_": "ignored"})
    assert c.listen_port == 10921 and c.broker_name == "broker-a" and c.store_root == "/tmp/x"
    with pytest.raises(ConfigError, match="listenPort: must be 1..65535, got 70000"):
        load_config(str(conf), {"MQSTORE_listenPort": "70000"})


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(str(tmp_path / "nope.conf"), {})


def test_config_is_frozen_and_round_trips():
    c, _ = from_properties({"listenPort": "10931", "aclEnable": "true"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.listen_port = 1  # type: ignore[misc]
    again, warnings = from_properties(to_properties(c))
    assert again == c and warnings == []
