"""Freshness as the run's report computes it (``launch.replica_watch.freshness_of``): a
sample of event time ``e`` is served from the first advance whose ``trained_through`` is
at or after ``e``; samples are spread evenly over event time."""

from __future__ import annotations

import numpy as np

from stream_persia.launch.replica_watch import freshness_of


def test_each_sample_waits_for_the_first_advance_that_covers_it():
    # (applied_at, trained_through): event times (100, 101] are served at 102.5,
    # (101, 103] at 104.0
    fresh = freshness_of([(101.0, 100.0), (102.5, 101.0), (104.0, 103.0)], grid_s=0.5)
    np.testing.assert_allclose(fresh, [2.0, 1.5, 2.5, 2.0, 1.5, 1.0])


def test_steady_figures_leave_out_the_start_and_order_does_not_matter():
    adv = [(10.0 + i, 5.0 + i) for i in range(20)] + [(3.0, 0.0)]   # first: a slow start
    assert freshness_of(adv, grid_s=0.1).max() > 4.9
    steady = freshness_of(adv[::-1], grid_s=0.1, skip_s=6.0)
    assert steady.size and 5.0 - 1e-9 <= steady.min() and steady.max() <= 6.0 + 1e-9


def test_fewer_than_two_advances_measure_nothing():
    assert freshness_of([]).size == 0 and freshness_of([(1.0, 0.5)]).size == 0


def test_advances_through_one_event_time_measure_nothing():
    # a dense-only advance: applied later, trained through the same sample as the one
    # before it; the report then has a zero span and no freshness (not a crash)
    assert freshness_of([(10.0, 5.0), (11.0, 5.0)]).size == 0


def test_the_report_names_the_span_it_timed_and_no_freshness_over_none():
    from stream_persia.launch.replica_watch import ReplicaWatch

    watch = ReplicaWatch("127.0.0.1:9", "token", [], ["click"])
    try:
        watch.advances = {10.0: 5.0, 11.0: 5.0}        # a dense-only advance: same sample
        out = watch.summary(None, None)
        assert (out["advances"], out["freshness_span_s"], out["freshness_p50_s"]) \
            == (2, 0.0, None)
        watch.advances = {10.0: 5.0, 12.0: 9.0}
        out = watch.summary(None, None)
        assert out["freshness_span_s"] == 4.0 and 0 < out["freshness_p50_s"] <= 7.0
    finally:
        watch.close()
