"""Loggers for user scripts (PERSIA's ``persia.logger``).

``get_default_logger()`` is what PERSIA's examples use in train scripts: a logger that
prints time, level, rank and message to stderr, configured once per name. Library modules
of stream-persia use plain ``logging.getLogger(__name__)`` and leave handlers to the
application.
"""

from __future__ import annotations

import logging
import os

__all__ = ["DEFAULT_LOGGER_NAME", "get_default_logger", "get_logger"]

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
