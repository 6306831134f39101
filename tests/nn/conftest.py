"""Fixtures of the NN-side tests (helpers live in nn_helpers.py, importable by scripts)."""

from __future__ import annotations

import pytest
from nn_helpers import LocalJob

from stream_persia.config import EmbeddingSchema


@pytest.fixture
def job_factory():
    jobs: list[LocalJob] = []

    def make(schema: EmbeddingSchema, **kw) -> LocalJob:
        job = LocalJob(schema, **kw)
        jobs.append(job)
        return job

    yield make
    for j in jobs:
        j.close()
