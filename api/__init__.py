"""stream-persia's HTTP API (FastAPI on uvicorn): health, metrics, job control, checkpoints
and online inference. ``stream-persia launch api`` serves :func:`create_app`.

Imports are lazy so that reading settings (``stream_persia.api.settings``) does not pay for torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app", "ApiSettings"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from stream_persia.api.app import create_app

        return create_app
    if name == "ApiSettings":
        from stream_persia.api.settings import ApiSettings

        return ApiSettings
    raise AttributeError(f"module 'api' has no attribute {name!r}")
