"""Suite-wide fixtures and reporting.

Fixtures for the Kafka test broker live in :mod:`stream_persia.testing.pytest_plugin` so
that load tests and users' own suites can use them too.
"""

from __future__ import annotations

import os

pytest_plugins = ["stream_persia.testing.pytest_plugin"]


def pytest_report_header(config):
    from stream_persia.kernels import segments
    from stream_persia.server import store

    lines = [f"stream-persia embedding store: {store.IMPLEMENTATION}, segment kernels: "
             f"{segments.IMPLEMENTATION}, worker segment sums: "
             f"{segments.SEGMENT_SUM_IMPLEMENTATION}"
             f" (STREAM_PERSIA_PURE_PYTHON={os.environ.get('STREAM_PERSIA_PURE_PYTHON', '')!r})"]
    return lines
