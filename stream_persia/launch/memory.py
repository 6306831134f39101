"""Process-wide memory settings every launched role applies once it has started: a frozen
start-up heap (:func:`freeze_startup_heap`) and freed heap memory kept for reuse
(:func:`keep_freed_memory`, ``STREAM_PERSIA_KEEP_FREED_MB``)."""

from __future__ import annotations

import gc as _gc
import os
import sys

from stream_persia.errors import ConfigError

__all__ = ["KEEP_FREED_ENV", "freeze_startup_heap", "keep_freed_memory"]


def freeze_startup_heap(young_threshold: int = 20_000) -> None:
    """Hide every object alive after start-up from the cyclic garbage collector and collect
    young objects less often.

    A role's steady state allocates short-lived containers per batch (msgpack maps, Kafka
    records, futures). With the default thresholds each full collection re-scans the
    modules imported at start-up (torch alone is several hundred thousand objects): in one
    py-spy profile of load_tests/bench_ingest.py the collector was in about a third of the
    embedding worker's active samples, and it is absent once the heap is frozen (the
    benchmark's per-batch CPU did not move beyond its noise). Frozen objects are never
    collected, which is right for module state; cycles made later are still found.
    """
    _gc.collect()
    _gc.freeze()
    _, mid, old = _gc.get_threshold()
    _gc.set_threshold(young_threshold, mid, old)


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
KEEP_FREED_ENV = "STREAM_PERSIA_KEEP_FREED_MB"


def keep_freed_memory(keep_mb: int | None = None) -> int:
    """Keep freed heap memory in the process for reuse instead of returning it to the
    system at once (glibc only; elsewhere a no-op). Returns the bytes of free heap now kept,
    0 where nothing took effect (disabled, not glibc, or mallopt refused).

    Every batch allocates buffers of a megabyte or more (Kafka records, RPC frames, pooled
    embeddings) and frees them a moment later. glibc serves blocks that large with a
    fresh ``mmap`` until a free raises its threshold, and hands the top of the heap back
    once more than twice that threshold is free, so a role alternates between reusing
    memory and faulting in (zeroed) new pages. In ``load_tests/bench_ingest.py`` that cost
    about 25,000 page faults every other round in the consume-only client, and about half
    of the embedding worker's kernel time (~1.5 against ~0.8 ms per batch with it). Blocks
    under 32 MiB then come from the heap, and up to
    ``keep_mb`` MiB of free heap (``STREAM_PERSIA_KEEP_FREED_MB``, default 256; 0 leaves
    glibc's defaults alone) stay mapped: a role's resident size may stay that much above
    its live data.
    """
    if keep_mb is None:
        raw = os.environ.get(KEEP_FREED_ENV, "256")
        try:
            keep_mb = int(raw)
        except ValueError:
            raise ConfigError(f"{KEEP_FREED_ENV}={raw!r} is not a whole number of MiB",
                              field=KEEP_FREED_ENV, hint="e.g. 256, or 0 to disable") from None
    if keep_mb < 0 or keep_mb > 1 << 20:
        raise ConfigError(f"{KEEP_FREED_ENV} must be in [0, {1 << 20}] MiB, got {keep_mb}",
                          field=KEEP_FREED_ENV)
    if keep_mb == 0 or not sys.platform.startswith("linux"):
        return 0
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return 0
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    took = mallopt(_M_TRIM_THRESHOLD, keep_mb << 20) and mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    return keep_mb << 20 if took else 0
