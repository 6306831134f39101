"""Online inference: ``POST /v1/predict``, ``GET /v1/model``, ``POST /v1/model/reload``."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from stream_persia.api.auth import PREDICT_AUTH_MARK, require_predict_token, require_token
from stream_persia.api.errors import NotReady
from stream_persia.api.features import (
    JSON_TYPES,
    MSGPACK_TYPES,
    parse_json,
    parse_msgpack,
    truncated_ids,
)
from stream_persia.api.json_body import StrictJsonRoute
from stream_persia.api.predictor import Prediction, predictions_json
from stream_persia.api.schemas import (
    ERRORS,
    ErrorBody,
    ModelInfo,
    PredictRequest,
    PredictResponse,
    ReloadRequest,
)

from stream_persia.core import wire

router = APIRouter(prefix="/v1", tags=["inference"], route_class=StrictJsonRoute)

_REQUEST_SCHEMA = PredictRequest.model_json_schema()
_MSGPACK_NOTE = ("the bytes of PersiaBatch.to_bytes() (stream_persia.core.data); "
                 "answer in msgpack too with Accept: application/msgpack")


def _media_type(request: Request) -> str:
    raw = request.headers.get("content-type") or "application/json"
    return raw.split(";", 1)[0].strip().lower()


def _wants_msgpack(request: Request) -> bool:
    accept = request.headers.get("accept", "")
    return any(t in accept for t in MSGPACK_TYPES)


def _response(request: Request, p: Prediction, truncated: int | None) -> Response:
    versions = {"model_version": p.step, "checkpoint": p.version,
                "trained_through": p.trained_through}
    counts = {"rows": p.rows, "missing_ids": p.missing, "truncated_ids": truncated}
    if _wants_msgpack(request):
        body = wire.pack({**versions, **counts, "heads": list(p.heads), "outputs": p.heads})
        return Response(body, media_type="application/msgpack")
    return JSONResponse({**versions, **counts, "heads": list(p.heads),
                         "predictions": predictions_json(p)})


@router.post(
    "/predict", response_model=PredictResponse, summary="Score samples with the served model",
    dependencies=[Depends(require_predict_token)], responses=ERRORS["predict"],
    openapi_extra={PREDICT_AUTH_MARK: True, "requestBody": {"required": True, "content": {
        "application/json": {"schema": _REQUEST_SCHEMA},
        "application/msgpack": {"schema": {"type": "string", "format": "binary",
                                           "description": _MSGPACK_NOTE}}}}})
async def predict(request: Request) -> Response:
    """Predictions per sample for every head of the model, the model version (checkpoint
    id) that produced them, and how many ids were missing from the embedding tables
    (their embeddings were zeros). Concurrent requests are micro-batched into one forward
    pass. Bodies over ``api.max_body_bytes`` or with more than ``api.max_rows_per_request``
    samples get 413; unknown slots, wrong types and malformed bodies get 422 naming the
    field. Slots and non-ID features are matched to the model's inputs by name, in any
    order (``GET /v1/model`` lists them); a name the model does not take, or one it lacks,
    is 422 naming it. A raw slot looks up at most its ``sample_fixed_size`` ids per sample
    (PERSIA's rule, as in training): ``truncated_ids`` counts the ids past it that the
    answer does not reflect."""
    state = request.app.state
    media = _media_type(request)
    if media not in JSON_TYPES and media not in MSGPACK_TYPES:
        raise HTTPException(415, f"content type {media!r} is not supported: send "
                                 f"application/json or application/msgpack")
    predictor = state.predictor
    if predictor.info() is None:
        raise NotReady(predictor.not_ready_reason(),
                       hint="POST /v1/model/reload with a checkpoint")
    body = await request.body()
    settings = state.settings
    if media in MSGPACK_TYPES:
        batch = parse_msgpack(body, settings.schema, settings.max_rows_per_request)
    else:
        batch = parse_json(body, settings.schema, settings.max_rows_per_request)
    return _response(request, await predictor.predict(batch),
                     truncated_ids(batch, settings.schema))


@router.get("/model", response_model=ModelInfo, summary="The model being served",
            dependencies=[Depends(require_predict_token)],
            openapi_extra={PREDICT_AUTH_MARK: True},
            responses={503: {"model": ErrorBody, "description": "no model loaded"}}
            | ERRORS["auth"] | ERRORS["public"])
async def model_info(request: Request) -> ModelInfo:
    """Version (checkpoint id), path, training step, kind and heads of the served model."""
    info = request.app.state.predictor.info()
    if info is None:
        raise NotReady(request.app.state.predictor.not_ready_reason())
    return ModelInfo(**info)


@router.post("/model/reload", response_model=ModelInfo, summary="Serve another checkpoint",
             dependencies=[Depends(require_token)], responses=ERRORS["control"])
async def reload(request: Request, body: ReloadRequest) -> ModelInfo:
    """Load the checkpoint completely (dense model and, with local embeddings, every row),
    then swap it in atomically: requests already running finish on the old model, none is
    dropped. ``checkpoint`` is a checkpoint id or the full path/URL of a checkpoint right
    under the checkpoint directory; anything else (other paths, ``..``, symbolic links out
    of it, other protocols, chained URLs) is 422 naming ``checkpoint``, as is a checkpoint
    that cannot be loaded."""
    return ModelInfo(**await request.app.state.predictor.reload(body.checkpoint))
