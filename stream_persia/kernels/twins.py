"""The one switch between the compiled fast paths and their pure-Python (numpy) twins.

``STREAM_PERSIA_PURE_PYTHON=1`` (or true, yes, on) in the environment picks every twin;
0 (false, no, off), empty or unset picks each compiled path that is available, and any
other value is a ConfigError naming the variable (:mod:`stream_persia.core.switches`). It is read here, once, when the package
is first imported, and nowhere else. The pairs, each held to one result by the same tests:

=================================================  ==========================================
compiled                                           twin
=================================================  ==========================================
Cython ``CEmbeddingStore`` (``server.store``)      ``PyEmbeddingStore`` (``server._pystore``)
Cython ``_segments`` (``kernels.segments``)        numpy functions beside it
torch ``embedding_bag`` (``segments.segment_sum``)  ``np.add.reduceat``
=================================================  ==========================================

Each module states the one it runs in its ``IMPLEMENTATION`` constant (``segment_sum``:
``SEGMENT_SUM_IMPLEMENTATION``), and the suite's header prints them.
"""

from __future__ import annotations

from stream_persia.core.switches import env_switch

__all__ = ["ENV", "PURE_PYTHON"]

#: The environment variable.
ENV = "STREAM_PERSIA_PURE_PYTHON"

#: True when every pure-Python twin runs.
PURE_PYTHON: bool = env_switch(ENV, False)
