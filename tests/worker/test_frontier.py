import pytest

from stream_persia.errors import InternalError
from stream_persia.worker.frontier import Frontier


def test_frontier_waits_for_oldest_pending_batch():
    f = Frontier({0: 10})
    assert f.offsets() == {0: 10}
    for o in (10, 11, 12):
        f.read(0, o)
    assert f.offsets() == {0: 10} and f.pending() == 3
    f.done(0, 11)          # out of order: 10 still pending
    assert f.offsets() == {0: 10}
    f.done(0, 10)
    assert f.offsets() == {0: 12} and f.pending() == 1
    f.done(0, 12)
    assert f.offsets() == {0: 13} and f.pending() == 0


def test_partitions_are_independent_and_accepted_gaps_may_skip():
    f = Frontier(allow_gaps=True)   # kafka.on_data_loss: skip (the consumer counted them)
    f.read(0, 5)
    f.read(1, 100)
    f.read(1, 104)
    f.done(1, 100)
    assert f.offsets() == {0: 5, 1: 104}
    f.done(1, 104)
    f.done(0, 5)
    assert f.offsets() == {0: 6, 1: 105}


def test_a_gap_is_refused_so_the_frontier_never_passes_untrained_offsets():
    f = Frontier({0: 10})
    f.read(0, 10)
    with pytest.raises(InternalError, match="11..13 never were"):
        f.read(0, 14)
    f.done(0, 10)
    assert f.offsets() == {0: 11}       # not 15: offsets 11..14 were not trained


def test_invariant_violations_are_internal_errors():
    f = Frontier()
    f.read(0, 3)
    with pytest.raises(InternalError):
        f.read(0, 2)
    with pytest.raises(InternalError):
        f.done(0, 7)
    with pytest.raises(InternalError):
        f.done(5, 0)
