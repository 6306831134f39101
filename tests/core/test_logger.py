"""The role loggers' RepeatFilter: a flood of one line becomes one line and a count."""

from __future__ import annotations

import logging

import pytest

from stream_persia.logger import RepeatFilter


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def logged():
    handler = _Capture()
    clock = [1000.0]
    flt = RepeatFilter(window_s=10.0, max_lines=3)
    handler.addFilter(flt)
    logger = logging.getLogger("test.repeat")
    logger.addHandler(handler)
    logger.propagate = False
    yield logger, handler.lines, clock, flt
    logger.removeHandler(handler)


def test_a_repeated_line_passes_once_per_window_then_says_how_many_were_dropped(
        logged, monkeypatch):
    logger, lines, clock, _ = logged
    monkeypatch.setattr("stream_persia.core.logger.time.monotonic", lambda: clock[0])
    for _ in range(50):
        logger.error("Unable connect to node with id %s: %s", 1, "refused")
    logger.error("the role is unhealthy")          # another line is never held back
    assert lines == ["Unable connect to node with id 1: refused", "the role is unhealthy"]
    clock[0] += 10.5
    logger.error("Unable connect to node with id %s: %s", 1, "refused")
    assert lines[-1] == ("Unable connect to node with id 1: refused (repeated 49 more times "
                         "in the 10 s before)")


def test_levels_and_loggers_are_told_apart_and_memory_is_bounded(logged, monkeypatch):
    logger, lines, clock, flt = logged
    monkeypatch.setattr("stream_persia.core.logger.time.monotonic", lambda: clock[0])
    logger.warning("x")
    logger.error("x")
    logging.getLogger("test.repeat.child").error("x")   # reaches the same handler
    logger.error("x")                                    # a repeat: dropped
    assert lines == ["x", "x", "x"]
    for i in range(10):
        logger.error("line %d", i)
    assert len(flt._seen) <= 3
