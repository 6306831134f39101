"""Loggers for user scripts (PERSIA's ``persia.logger``).

``get_default_logger()`` is what PERSIA's examples use in train scripts: a logger that
prints time, level, rank and message to stderr, configured once per name. Library modules
of stream-persia use plain ``logging.getLogger(__name__)`` and leave handlers to the
application.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict

__all__ = ["DEFAULT_LOGGER_NAME", "RepeatFilter", "get_default_logger", "get_logger"]

DEFAULT_LOGGER_NAME = "stream_persia"
_FORMAT = "%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s"


def get_logger(name: str, level: int | str | None = None,
               formatter: logging.Formatter | None = None) -> logging.Logger:
    """A logger named ``name`` with one stderr handler (added once, however often called).

    Args:
        name: logger name.
        level: logging level (default: env ``LOG_LEVEL``, else INFO).
        formatter: replaces the default format (time, level, rank, name, message).
    """
    logger = logging.getLogger(name)
    if level is None:
        level = os.environ.get("LOG_LEVEL", "INFO")
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
        if not isinstance(level, int):
            level = logging.INFO
    logger.setLevel(level)
    if not any(getattr(h, "_stream_persia", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler._stream_persia = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    rank = os.environ.get("RANK", "0") or "0"
    for h in logger.handlers:
        if getattr(h, "_stream_persia", False):
            h.setFormatter(formatter or logging.Formatter(_FORMAT.format(rank=rank)))
    return logger


def get_default_logger(name: str = DEFAULT_LOGGER_NAME, level: int | str | None = None
                       ) -> logging.Logger:
    """The logger PERSIA's examples use (``get_default_logger("nn_worker")``)."""
    return get_logger(name, level)


class RepeatFilter(logging.Filter):
    """Lets a log line through once per ``window_s`` and counts its repeats.

    A role whose broker is gone gets the same aiokafka ERROR line ("Unable connect to node
    with id 1: [Errno 111] Connection refused") dozens of times a second; the line that
    says why the role stops is lost among them, in its log and in the tail ``stream-persia
    run`` prints. A line (same logger, level and text) seen again within ``window_s`` is
    dropped; the next time it passes, it says how many were dropped. At most ``max_lines``
    distinct lines are remembered (the oldest are forgotten first), so memory is bounded.
    """

    def __init__(self, window_s: float = 10.0, max_lines: int = 1024):
        super().__init__()
        self.window_s = window_s
        self.max_lines = max_lines
        self._seen: OrderedDict[tuple, list] = OrderedDict()   # key -> [first_s, dropped]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        key = (record.name, record.levelno, text)
        now = time.monotonic()
        with self._lock:
            entry = self._seen.get(key)
            if entry is not None and now - entry[0] < self.window_s:
                entry[1] += 1
                return False
            dropped = entry[1] if entry is not None else 0
            self._seen[key] = [now, 0]
            self._seen.move_to_end(key)
            while len(self._seen) > self.max_lines:
                self._seen.popitem(last=False)
        if dropped:
            record.msg = f"{text} (repeated {dropped} more times in the {self.window_s:g} s before)"
            record.args = None
        return True
