"""Checkpoints (``/v1/checkpoints``, bearer token): start, list, inspect, restore, delete."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Path, Request
from fastapi.responses import JSONResponse
from stream_persia.api.auth import require_token
from stream_persia.api.checkpoints import Checkpoints
from stream_persia.api.json_body import StrictJsonRoute
from stream_persia.api.schemas import (
    CHECKPOINT_ID_PATTERN,
    ERRORS,
    CheckpointAccepted,
    CheckpointDeleted,
    CheckpointInfo,
    CheckpointList,
    CheckpointStart,
    RestoreRequest,
    RestoreResult,
)

router = APIRouter(prefix="/v1/checkpoints", tags=["checkpoints"],
                   dependencies=[Depends(require_token)], responses=ERRORS["checkpoint"],
                   route_class=StrictJsonRoute)

_ID = Path(description="checkpoint id (its directory name under the checkpoint directory)",
           pattern=CHECKPOINT_ID_PATTERN, examples=["ckpt-20250101T000000Z-a1b2c3"])


def _ckpts(request: Request) -> Checkpoints:
    return request.app.state.checkpoints


@router.post("", status_code=202, response_model=CheckpointAccepted,
             summary="Start a checkpoint (consistent cut at the next step boundary)")
async def start(request: Request, body: CheckpointStart | None = None) -> JSONResponse:
    """Returns 202 with the id at once. With NN ranks attached, every rank takes the cut at
    its next step boundary (the same guarantees as ``dump_checkpoint`` from train.py);
    with none, the API takes it. Follow it at ``status_url``. It is written under the
    checkpoint directory. 409 while another one runs or one is being restored, or when
    the id is taken. Once it is
    done, the oldest checkpoints beyond ``checkpointing_config.keep_checkpoints`` (3 by
    default) are deleted, never one in use or served."""
    job = await _ckpts(request).start(body.id if body is not None else None)
    url = f"/v1/checkpoints/{job.id}"
    accepted = CheckpointAccepted(id=job.id, state=job.state, dst=job.dst, status_url=url)
    return JSONResponse(accepted.model_dump(), status_code=202, headers={"Location": url})


@router.get("", response_model=CheckpointList, summary="Checkpoints with their manifests")
async def list_all(request: Request) -> CheckpointList:
    """Complete checkpoints under the checkpoint directory (oldest step first, each with
    its manifest), then those this API is taking or failed to take. Each says where it
    stands in its chain (incremental checkpoints): ``parent`` (the checkpoint it patches;
    null for a full base), ``base``, ``depth`` (patches since the base), and ``bytes``, the
    size of its own files."""
    # validated from the plain dicts Checkpoints.list gives
    return CheckpointList.model_validate({"checkpoints": await _ckpts(request).list()})


@router.get("/{checkpoint_id}", response_model=CheckpointInfo,
            summary="One checkpoint's status, progress and manifest")
async def get_one(request: Request, checkpoint_id: str = _ID) -> CheckpointInfo:
    info = await _ckpts(request).get(checkpoint_id)
    if info is None:
        raise HTTPException(404, f"no checkpoint {checkpoint_id!r}")
    return CheckpointInfo(**info)


@router.post("/{checkpoint_id}/restore", response_model=RestoreResult,
             summary="Restore the job to a checkpoint")
async def restore(request: Request, checkpoint_id: str = _ID,
                  body: RestoreRequest | None = None) -> RestoreResult:
    """Every embedding server loads the checkpoint's rows (any server count; any member of
    a chain: its base, then its patches up to it), every worker
    consumes again from its offsets, and (by default) the API serves its dense model. 409
    while a checkpoint is being taken or another one restored, and while NN ranks train
    (rank 0 heartbeats) or batches are in flight: stop the NN workers, restore, then start them with
    ``load_checkpoint``. Batches whose push failed and embedding servers that restarted
    (their tables lost) do not stop it: a restore is the way back from both. 409
    (``data_lost``) when Kafka no longer holds the samples from the checkpoint's offsets on
    (retention deleted them; the message names each partition and its offsets), 422 when
    an offset is beyond its partition's end: nothing is changed."""
    ckpts = _ckpts(request)
    if await ckpts.get(checkpoint_id) is None:
        raise HTTPException(404, f"no checkpoint {checkpoint_id!r}")
    reload_model = body.reload_model if body is not None else True
    return RestoreResult(**await ckpts.restore(checkpoint_id, reload_model))


@router.delete("/{checkpoint_id}", response_model=CheckpointDeleted,
               summary="Delete a checkpoint from the checkpoint directory")
async def delete(request: Request, checkpoint_id: str = _ID) -> CheckpointDeleted:
    """Deletes it at once (a reader never sees it half gone). 404 when there is no such
    checkpoint; 409 while it is being taken, restored or deleted, or is the model being
    served (or loaded, or configured to be served); 422 for a symbolic link. The API also
    deletes the oldest checkpoints beyond ``checkpointing_config.keep_checkpoints`` after
    each checkpoint it takes."""
    deleted = await _ckpts(request).delete(checkpoint_id)
    if deleted is None:
        raise HTTPException(404, f"no checkpoint {checkpoint_id!r}")
    return CheckpointDeleted(**deleted)
