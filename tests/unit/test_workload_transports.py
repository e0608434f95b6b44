"""dledger_harness.Workload.acked_by_transport: the acks after a moment, for each transport
a thread of the workload sends on.

Regression: it always named both transports, so the fault tests' `finish()` failed a workload
whose threads all send over HTTP (test_slow_disk) with "stream: 0".
Method: attempts recorded by hand on a workload that never started.
"""

from __future__ import annotations

from tests.integration.dledger_harness import ACKED, FAILED, Attempt, Workload


def _workload(stream_threads: int) -> Workload:
    w = Workload(cluster=None, stream_threads=stream_threads)
    w.attempts += [Attempt("w0-0", 0, "n0", start=1.0, outcome=ACKED), Attempt("w1-0", 1, "n0", start=5.0, outcome=ACKED),
                   Attempt("s2-0", 2, "n0", start=5.0, outcome=FAILED), Attempt("s2-1", 2, "n1", start=6.0, outcome=ACKED)]
    return w


def test_regression_an_http_only_workload_names_only_http():
    w = _workload(0)
    w.attempts[:] = [a for a in w.attempts if a.body.startswith("w")]
    assert w.acked_by_transport(after=2.0) == {"http": 1}


def test_a_mixed_workload_counts_each_transport_after_the_moment():
    w = _workload(1)
    assert w.acked_by_transport(after=2.0) == {"http": 1, "stream": 1}
    assert w.acked_by_transport(after=5.5) == {"http": 0, "stream": 1}


def test_a_stream_only_workload_names_only_the_stream():
    assert _workload(3).acked_by_transport(after=0.0) == {"stream": 1}


def test_waiting_for_each_transport_returns_the_counts_or_fails_at_the_bound():
    w = _workload(1)
    assert w.wait_each_transport_acks(after=2.0, timeout_s=1.0) == {"http": 1, "stream": 1}
    try:
        w.wait_each_transport_acks(after=5.5, timeout_s=0.1)      # no HTTP ack after 5.5
    except AssertionError as e:
        assert "{'http': 0, 'stream': 1}" in str(e)
    else:
        raise AssertionError("waited past its bound")
