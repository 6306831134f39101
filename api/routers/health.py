"""Probes and metrics: ``/healthz`` (alive), ``/readyz`` (dependencies), ``/metrics``."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from stream_persia.api.metrics import merge_role_metrics
from stream_persia.api.schemas import Liveness, Readiness

from stream_persia.core.metrics import CONTENT_TYPE
from stream_persia.errors import PersiaError

router = APIRouter(tags=["health"])

ROLE_METRICS_TIMEOUT_MS = 2000


@router.get("/healthz", response_model=Liveness, summary="The process is alive")
async def healthz() -> Liveness:
    """Answers 200 as long as the event loop runs; depends on nothing else."""
    return Liveness()


@router.get("/readyz", response_model=Readiness, summary="Every dependency is reachable",
            responses={503: {"model": Readiness, "description": "not ready (see problems)"}})
async def readyz(request: Request) -> JSONResponse:
    """200 when every configured role answers ``health`` and, when this API serves a model,
    the model is loaded; 503 with the reasons otherwise."""
    state = request.app.state
    roles = await state.roles.health()
    problems = [f"{r['role']}-{r['index']} {r['address']}: {r['error']}"
                for r in roles if not r["healthy"]]
    model = state.predictor.info() if state.predictor is not None else None
    if state.predictor is not None and state.predictor.expects_model and model is None:
        problems.append(state.predictor.not_ready_reason())
    if state.supervisor.error:   # a background task failed: the API exits 1 shortly
        problems.append(state.supervisor.error)
    body = Readiness(ready=not problems, problems=problems, roles=roles, model=model)
    return JSONResponse(body.model_dump(mode="json"), status_code=200 if not problems else 503)


@router.get("/metrics", summary="Prometheus metrics of the API and every role",
            response_class=Response,
            responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}},
                             "description": "Prometheus text exposition"}})
async def metrics(request: Request) -> Response:
    """Request counts and latency histograms per route, inference and model metrics, and
    the metrics of every embedding worker and server (labelled ``role``, ``replica``)."""
    state = request.app.state
    roles = state.roles.all

    async def fetch(role):
        try:
            return await state.roles.call(role, "metrics", None, ROLE_METRICS_TIMEOUT_MS)
        except PersiaError:
            return None

    texts = await asyncio.gather(*(fetch(r) for r in roles))
    reports = []
    for role, text in zip(roles, texts, strict=True):
        state.metrics.role_up.labels(role.kind, str(role.index)).set(text is not None)
        if text is not None:
            reports.append((role.kind, role.index, text))
    body = state.metrics.render() + merge_role_metrics(reports)
    return Response(body, media_type=CONTENT_TYPE)
