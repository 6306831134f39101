"""The FastAPI application: :func:`create_app` builds it, its lifespan owns every resource.

Startup (lifespan): RPC clients of the embedding workers and servers, the predictor (its
micro-batcher task, its forward thread and the model of ``PERSIA_API_MODEL`` when set)
and the checkpoint manager. Shutdown stops them in reverse order: queued inference
requests finish, checkpoint tasks are cancelled, connections close.

Middleware, outermost first: request metrics per route template, the request body limit
(413), then the 500 answer to an unexpected exception. Error mapping: :mod:`stream_persia.api.errors`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI
from stream_persia.api.auth import document_security
from stream_persia.api.checkpoints import Checkpoints
from stream_persia.api.errors import UnhandledErrors, install_error_handlers
from stream_persia.api.limits import BodySizeLimit
from stream_persia.api.metrics import ApiMetrics, HttpMetricsMiddleware
from stream_persia.api.predictor import Predictor
from stream_persia.api.roles import Roles
from stream_persia.api.routers import checkpoints, control, health, predict
from stream_persia.api.settings import ApiSettings

import stream_persia
from stream_persia.core.supervisor import Supervisor

__all__ = ["create_app"]

log = logging.getLogger(__name__)

DESCRIPTION = """\
Control plane and online inference of a stream-persia job.

* **health**: liveness, readiness (every role reachable, model loaded) and Prometheus
  metrics of the API and every role.
* **control** (bearer token): job status, pause/resume ingest, embedding config, clear,
  sizes.
* **checkpoints** (bearer token): consistent cuts started over HTTP, listed with their
  manifests, followed, restored and deleted; the newest `keep_checkpoints` are kept.
  Requests name checkpoints by id (or full path) under the checkpoint directory only.
* **inference**: `POST /v1/predict` (JSON or msgpack `PersiaBatch`, features matched to
  the model's inputs by name), micro-batched; `POST /v1/model/reload` swaps checkpoints
  without dropping a request.

Errors always have the body `{"error": {"kind", "type", "message", "field", "hint",
"peer"}}`: 422 names the field at fault, 413 a size limit, 409 a state conflict, 502/503
the role that failed.
"""

TAGS = [
    {"name": "health", "description": "probes and metrics (no token)"},
    {"name": "control", "description": "job control (bearer token)"},
    {"name": "checkpoints", "description": "consistent checkpoints (bearer token)"},
    {"name": "inference", "description": "online predictions (token when configured)"},
]


def create_app(settings: ApiSettings | None = None, *, checkpoints_factory=None) -> FastAPI:
    """Build the application.

    Args:
        settings: resolved settings; None reads them from the environment
            (:meth:`ApiSettings.from_env`, with ``PERSIA_GLOBAL_CONFIG`` when set).
        checkpoints_factory: ``(settings, roles, predictor) -> Checkpoints`` override
            (e.g. to point the checkpoint mailbox elsewhere).

    Raises:
        ConfigError: no token is configured and the host is not loopback (control routes
            would be open to the network), or invalid settings.
    """
    if settings is None:
        from stream_persia.config import load_global_config

        gc = load_global_config() if _env_global_config() else None
        settings = ApiSettings.from_env(gc)
    settings.check_bind()
    metrics = ApiMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        roles = Roles(settings.embedding_workers, settings.embedding_servers,
                      timeout_ms=settings.rpc_timeout_ms)
        predictor = Predictor(settings, roles, metrics)
        factory = checkpoints_factory or Checkpoints
        ckpts = factory(settings, roles, predictor)
        app.state.roles, app.state.predictor, app.state.checkpoints = roles, predictor, ckpts
        try:
            await predictor.start()
            if predictor.batcher.task is not None:   # supervised: a crash exits the API 1
                app.state.supervisor.watch(predictor.batcher.task, "predict-batcher",
                                           forever=False)   # stop() lets it return
            log.info("API ready: %d embedding worker(s), %d embedding server(s), embeddings "
                     "from %s, auth %s", len(roles.workers), len(roles.servers),
                     settings.source, "on" if settings.token else "off (loopback only)")
            yield
        finally:
            await ckpts.stop()
            await predictor.stop()
            await roles.close()

    app = FastAPI(title="stream-persia API", version=stream_persia.__version__,
                  description=DESCRIPTION, openapi_tags=TAGS, lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    # Long-running tasks of the API (the micro-batcher): one that fails makes /readyz 503
    # naming it, and `launch api` exit 1 (stream_persia.core.supervisor, stream_persia.api.server).
    app.state.supervisor = Supervisor("api")
    install_error_handlers(app)
    app.add_middleware(UnhandledErrors)   # innermost: the metrics see its 500s
    app.add_middleware(BodySizeLimit, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(HttpMetricsMiddleware, metrics=metrics)
    # Inference first: routes are matched in order and /v1/predict is the hot one.
    for module in (predict, health, control, checkpoints):
        app.include_router(module.router)
    _document_security(app, settings)
    return app


def _document_security(app: FastAPI, settings: ApiSettings) -> None:
    """Generate the OpenAPI document with the authentication this instance enforces."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = document_security(generate(), settings.token,
                                                   settings.predict_requires_token)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]   # FastAPI's documented hook


def _env_global_config() -> bool:
    import os

    return bool(os.environ.get("PERSIA_GLOBAL_CONFIG"))
