"""`mqstore cluster up` options for classic groups: the brokers' role and how many controllers.

Goal: `--broker-role ASYNC_MASTER` and `--controllers 1` reach the broker.conf files and the
controller plan; a wrong value, or one given to another mode, is refused with words a user can
act on. Method: mqstore.cluster.plan on a temporary directory, and the CLI's parser (the
processes themselves: tests/integration/test_cluster_classic.py).
"""

from __future__ import annotations

import pytest

from mqstore import cli
from mqstore import cluster as mc


def conf(path: str) -> dict[str, str]:
    with open(path) as f:
        return dict(line.strip().split("=", 1) for line in f if "=" in line and not line.startswith("#"))


def test_classic_plan_writes_the_role_and_lists_the_controllers_asked_for(tmp_path):
    specs = mc.plan(str(tmp_path), "classic", 2, 10911, broker_role="ASYNC_MASTER", controllers=1)
    ctls = mc.plan_controllers(str(tmp_path), 10911, 1)
    assert [c.api for c in ctls] == ["127.0.0.1:9876"]
    for i, s in enumerate(specs):
        c = conf(s.config_path)
        assert c["brokerRole"] == "ASYNC_MASTER" and c["brokerId"] == str(i)
        assert c["controllerAddr"] == "127.0.0.1:9876"
    three = mc.plan(str(tmp_path / "b"), "classic", 2, 10911)
    assert conf(three[0].config_path)["brokerRole"] == "SYNC_MASTER"
    assert conf(three[0].config_path)["controllerAddr"].count(";") == 2


@pytest.mark.parametrize("mode, role, controllers, words", [
    ("classic", "SLAVE", 3, "--broker-role must be one of SYNC_MASTER, ASYNC_MASTER"),
    ("classic", "SYNC_MASTER", 2, "--controllers must be 1, 3 or 5"),
    ("dledger", "ASYNC_MASTER", 3, "apply to --mode classic only"),
    ("standalone", "SYNC_MASTER", 1, "apply to --mode classic only"),
])
def test_wrong_classic_options_are_refused_with_words(tmp_path, mode, role, controllers, words):
    with pytest.raises(SystemExit) as e:
        mc.plan(str(tmp_path), mode, 2, 10911, broker_role=role, controllers=controllers)
    assert words in str(e.value)


def test_the_cli_takes_the_classic_options():
    a = cli.build_parser().parse_args(["cluster", "up", "--mode", "classic", "--broker-role", "ASYNC_MASTER",
                                       "--controllers", "1"])
    assert (a.broker_role, a.controllers) == ("ASYNC_MASTER", 1)
    a = cli.build_parser().parse_args(["cluster", "up"])
    assert (a.broker_role, a.controllers) == ("SYNC_MASTER", 3)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["cluster", "up", "--controllers", "2"])


def test_a_port_in_use_is_named_before_anything_starts(tmp_path):
    """Regression: with one of its ports taken (the DLedger ports lie in Linux's ephemeral range,
    where any outgoing connection may hold one), `cluster up` started the other processes and
    then said only that a node did not become healthy. Now it names the ports first."""
    import socket
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert port in mc.lc.ports_in_use([port])
        with pytest.raises(SystemExit, match=f"{port}.* in use.*--base-port"):
            mc.start(str(tmp_path), mode="standalone", base_port=port)
    assert not (tmp_path / mc.STATE_FILE).exists(), "nothing was started"
    specs = mc.plan(str(tmp_path / "d"), "dledger", 3, 10911)
    assert sorted(mc.planned_ports("dledger", specs, [])) == [10909, 10911, 10919, 10921, 10929, 10931,
                                                              40911, 40912, 40913]
