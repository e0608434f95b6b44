"""The produce benches report where a node's event-loop thread stood in a round: its CPU per
message, the share of the round it ran and the share it waited for a core. On a 2-core machine
a master, its slave and the load generator share the cores, and these tell a loop that is the
limit from one that waited for a core."""

import os
import time

from bench.bench_store import loop_facts, loop_thread_sample


def test_the_loop_figures_are_per_message_and_shares_of_the_round():
    out = loop_facts(1000, 2.0, (1.0, 0.5), (2.5, 0.7))
    assert out == {"node_loop_cpu_us_per_msg": 1500.0, "node_loop_busy_pct": 75.0,
                   "node_loop_waiting_for_cpu_pct": 10.0}


def test_without_schedstat_the_wait_is_left_out_not_made_up():
    out = loop_facts(10, 1.0, (0.0, None), (0.5, None))
    assert "node_loop_waiting_for_cpu_pct" not in out and out["node_loop_busy_pct"] == 50.0


def test_nothing_is_reported_for_an_empty_round():
    assert loop_facts(0, 1.0, (0.0, 0.0), (1.0, 0.0)) == {}


def test_the_sample_is_the_main_thread_s_cpu():
    cpu0, wait0 = loop_thread_sample(os.getpid())
    end = time.process_time() + 0.3
    while time.process_time() < end:     # this (main) thread spins
        pass
    cpu1, wait1 = loop_thread_sample(os.getpid())
    assert cpu1 - cpu0 >= 0.2
    assert (wait0 is None) == (wait1 is None)
    if wait0 is not None:
        assert wait1 >= wait0
