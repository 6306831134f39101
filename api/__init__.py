"""stream-persia's HTTP API (FastAPI on uvicorn): health, metrics, job control, checkpoints
and online inference. ``stream-persia launch api`` serves :func:`create_app`."""

from api.app import create_app
from api.settings import ApiSettings

__all__ = ["create_app", "ApiSettings"]
