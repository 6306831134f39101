"""Fixtures of the API tests (helpers live in api_helpers.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from api_helpers import Job, start_job, stop_job


@pytest.fixture
async def job() -> AsyncIterator[Job]:
    """Two embedding servers and one embedding worker on loopback, in the test's loop."""
    j = await start_job()
    try:
        yield j
    finally:
        await stop_job(j)
