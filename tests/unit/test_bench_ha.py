"""bench_ha's slave catch-up figure counts only the bytes the slave copied, from its first
transfer on.

Regression: the case started a fresh slave, which (as RocketMQ's) copies only from the
master's last segment, and divided the master's whole log by the time: 3,118 MB/s reported
for 3.2 GB of which the slave copied a quarter. The slave is now restarted after a kill -9
while the master takes the bytes, and the rate runs from its first transfer."""

from bench.bench_ha import MIB, transfer_rate


def test_the_catch_up_rate_runs_from_the_first_poll_past_the_restart_to_the_end():
    start = 100 * MIB
    seen = [(0.0, -1), (0.5, -1), (1.0, start), (1.2, start + 30 * MIB), (1.5, start + 60 * MIB)]
    mb_s, seconds = transfer_rate(seen, start, t_start=0.0)
    assert seconds == 0.5 and mb_s == 120.0


def test_a_slave_caught_up_at_the_first_poll_is_timed_from_its_start():
    mb_s, seconds = transfer_rate([(2.0, 8 * MIB)], 0, t_start=1.0)
    assert seconds == 1.0 and mb_s == 8.0
