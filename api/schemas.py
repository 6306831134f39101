"""Request and response bodies of the HTTP API (pydantic), each with an example for /docs."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

__all__ = [
    "ErrorInfo", "ErrorBody", "Liveness", "RoleHealth", "ModelInfo", "Readiness",
    "WorkerStatus", "ServerStatus", "TrainingStatus", "JobStatus", "IngestState",
    "OptimizerSpec", "SlotPolicySpec", "EmbeddingConfigRequest", "Applied", "Sizes", "PredictRequest",
    "PredictResponse", "ReloadRequest", "CheckpointStart", "CheckpointAccepted",
    "CheckpointInfo", "CheckpointList", "CheckpointDeleted", "RestoreRequest", "RestoreResult",
    "ERRORS",
    "CHECKPOINT_ID_PATTERN",
]


#: a JSON number for a float field: ints are taken (1 -> 1.0), but not ``false`` or ``"1"``,
#: which pydantic's lax mode would coerce (request bodies are checked strictly).
Number = Annotated[float, Field(strict=True)]
#: a Number the embedding tables (float32) can hold
Float32 = Annotated[float, Field(strict=True, ge=-3.4e38, le=3.4e38)]


def _example(example: dict[str, Any]) -> ConfigDict:
    return ConfigDict(json_schema_extra={"examples": [example]})


class ErrorInfo(BaseModel):
    kind: str = Field(description="error family: bad_input, too_large, misuse, unavailable, "
                                  "timeout, remote, unauthorized, forbidden, internal, ...")
    type: str = Field(description="the exception type")
    message: str
    field: str | None = Field(default=None, description="the request field at fault, dotted")
    hint: str | None = Field(default=None, description="what would be accepted")
    peer: str | None = Field(default=None, description="the role that failed (502/503)")


class ErrorBody(BaseModel):
    model_config = _example({"error": {
        "kind": "bad_input", "type": "BadInput",
        "message": "unknown slot 'usr' in id_type_features", "field": "id_type_features.usr",
        "hint": "slots of this job: item, tags, user", "peer": None}})
    error: ErrorInfo


def _responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    text = {401: "no bearer token", 403: "wrong bearer token", 404: "not found",
            409: "not possible in the job's current state", 413: "request too large",
            415: "unsupported content type", 422: "invalid request (names the field)",
            502: "a role answered with a failure", 503: "a role is unavailable or busy"}
    return {c: {"model": ErrorBody, "description": text[c]} for c in codes}


#: common error responses per route group, for the OpenAPI document
ERRORS = {
    "control": _responses(401, 403, 409, 422, 502, 503),
    "public": _responses(422),
    "auth": _responses(401, 403),
    "predict": _responses(401, 403, 409, 413, 415, 422, 502, 503),
    "checkpoint": _responses(401, 403, 404, 409, 422, 502, 503),
}


# ---------------------------------------------------------------------------- health
class Liveness(BaseModel):
    model_config = _example({"status": "ok"})
    status: Literal["ok"] = "ok"


class RoleHealth(BaseModel):
    role: str = Field(description="embedding-worker or embedding-server")
    index: int
    address: str
    healthy: bool
    error: str | None = None
    latency_ms: float | None = None


class ModelInfo(BaseModel):
    model_config = _example({"version": "ckpt-20250101T000000Z-0001", "checkpoint":
                             "/ckpt/ckpt-20250101T000000Z-0001", "step": 1200,
                             "kind": "torchscript", "embeddings": "local",
                             "heads": ["click", "buy"], "loaded_at": 1735689600.0,
                             "inputs": {"id_type_features": ["user", "item", "tags"],
                                        "non_id_type_features": [
                                            {"name": "dense", "dtype": "float32",
                                             "shape": [3]}],
                                        "recorded": True}})
    version: str = Field(description="checkpoint id of the dense model being served")
    checkpoint: str
    step: int | None = None
    model_version: int | None = Field(None, description="training step of the dense model "
                                                        "served (a replica follows training)")
    trained_through: float | None = Field(
        None, description="event time of the newest training sample whose updates are "
                          "applied (serving replicas)")
    replica: dict[str, Any] | None = Field(
        None, description="serving replica: each shard's place in its server's update log, "
                          "and recent advances of trained_through as [applied_at, "
                          "trained_through]")
    kind: str = Field(description="torchscript (jit_dense.pt) or state_dict (model class)")
    embeddings: str = Field(description="workers, local or replica")
    heads: list[str] = Field(default_factory=list)
    loaded_at: float
    inputs: dict[str, Any] | None = Field(
        None, description="what POST /v1/predict must carry, matched by name in any order: "
                          "id_type_features (the slots, in the model's order) and "
                          "non_id_type_features (name, dtype, per-sample shape; null when "
                          "the checkpoint does not record them: then one feature is taken "
                          "whatever its name); recorded: whether the checkpoint records them "
                          "(else the slots are the embedding config's, in its order)")


class Readiness(BaseModel):
    model_config = _example({"ready": True, "problems": [], "roles": [
        {"role": "embedding-worker", "index": 0, "address": "127.0.0.1:7100",
         "healthy": True, "error": None, "latency_ms": 0.4}], "model": None})
    ready: bool
    problems: list[str] = Field(description="why the API is not ready (empty when ready)")
    roles: list[RoleHealth]
    model: ModelInfo | None = None


# ---------------------------------------------------------------------------- control
class WorkerStatus(BaseModel):
    index: int
    address: str
    healthy: bool
    error: str | None = None
    ready: int | None = Field(default=None, description="batches ready for NN workers")
    ready_capacity: int | None = None
    inflight: int | None = Field(default=None, description="served batches awaiting gradients")
    pending: int | None = Field(default=None, description="batches consumed but not applied")
    ingest_paused: bool | None = None
    frontier: dict[str, int] = Field(default_factory=dict,
                                     description="partition -> first offset not yet applied")
    lag: dict[str, int] = Field(default_factory=dict, description="partition -> consumer lag")
    kafka: dict[str, Any] | None = None


class ServerStatus(BaseModel):
    index: int
    address: str
    healthy: bool
    error: str | None = None
    rows: int | None = None
    stats: dict[str, float] = Field(default_factory=dict)
    slots: dict[str, dict[str, int]] = Field(
        default_factory=dict, description="per feature group: rows, admitted, rejected, "
        "expired, evicted_lru, evicted_cap, dropped_grads (see /metrics' slot_* series)")


class TrainingStatus(BaseModel):
    step: int | None = Field(default=None, description="last step reported by NN rank 0")
    batches_applied: int | None = Field(
        default=None, description="sum over embedding workers (null: a worker did not answer)")
    nn_attached: bool | None = None


class StageMark(BaseModel):
    event_time: float | None = Field(
        default=None, description="event time (Unix seconds) of the newest sample that "
        "reached the stage, at the slowest role reporting it (the least over the roles)")
    lag_s: float | None = Field(default=None, description="now minus event_time")


class KafkaLagRow(BaseModel):
    topic: str
    partition: int
    worker: int = Field(description="the embedding worker reading the partition")
    messages: int | None = Field(default=None, description="end offset minus position")
    seconds: float | None = Field(
        default=None, description="event time of the partition's newest record minus that "
        "of the newest one the worker ingested (0 when caught up)")
    probe_age_s: float | None = Field(
        default=None, description="seconds since the worker's last lag probe that "
        "succeeded: messages and seconds are as of then (a probe fails while the brokers "
        "are down or slow, and the figures stay as last known, 0 included)")


class Watermarks(BaseModel):
    """Stage watermarks (``stream_persia.core.stages``), job-level: per stage the slowest
    role of that stage, i.e. the least event time over the roles reporting it (produced and
    ingested: the embedding workers; trained: NN rank 0, relayed by worker 0; applied: the
    embedding servers; served: this API when it is a serving replica). A stage no role
    reports yet is null."""

    produced: StageMark | None = None
    ingested: StageMark | None = None
    trained: StageMark | None = None
    applied: StageMark | None = None
    served: StageMark | None = None
    kafka_lag: list[KafkaLagRow] = Field(default_factory=list,
                                         description="per partition, Kafka ingest only")
    progressive: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="task -> NN rank 0's progressive figures, as its "
        "heartbeat relays them (windowed auc, ne, calibration, log_loss, their lifetime_ "
        "twins, samples, window)")


class JobStatus(BaseModel):
    model_config = _example({
        "roles": [{"role": "embedding-worker", "index": 0, "address": "127.0.0.1:7100",
                   "healthy": True, "error": None, "latency_ms": 0.5}],
        "workers": [{"index": 0, "address": "127.0.0.1:7100", "healthy": True, "ready": 3,
                     "ready_capacity": 16, "inflight": 1, "pending": 4, "ingest_paused": False,
                     "frontier": {"0": 1200}, "lag": {"0": 17}}],
        "servers": [{"index": 0, "address": "127.0.0.1:7200", "healthy": True, "rows": 5210,
                     "stats": {"lookups": 91000.0, "evictions": 0.0}}],
        "consumer_lag": {"0": 17}, "staleness_in_flight": 1, "rows_total": 5210,
        "ingest_paused": False,
        "training": {"step": 1200, "batches_applied": 1200, "nn_attached": True},
        "last_checkpoint": None, "model": None})
    roles: list[RoleHealth]
    workers: list[WorkerStatus]
    servers: list[ServerStatus]
    consumer_lag: dict[str, int] = Field(description="partition -> lag, over every worker")
    staleness_in_flight: int | None = Field(
        description="batches served but not yet applied (null: a worker did not answer)")
    rows_total: int | None = Field(
        description="embedding rows over every server (null: a server did not answer)")
    ingest_paused: bool | None = Field(
        default=None, description="true when every worker is paused, false when one is not "
        "(null: not known, a worker did not answer)")
    training: TrainingStatus
    last_checkpoint: dict[str, Any] | None = None
    model: ModelInfo | None = None
    watermarks: Watermarks = Field(default_factory=lambda: Watermarks())


class IngestState(BaseModel):
    model_config = _example({"ingest_paused": True, "workers": 2})
    ingest_paused: bool
    workers: int


class OptimizerSpec(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [
        {"name": "adagrad", "lr": 0.01}, {"name": "sgd", "lr": 0.1, "momentum": 0.9}]})
    name: Literal["sgd", "adagrad", "adam"]


class SlotPolicySpec(BaseModel):
    """A slot's table policy (``SlotPolicy``; the keys of a ``slots_config`` entry in
    ``embedding_config.yml``). Fields left out take their defaults."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"min_count": 2, "ttl_s": 86400, "max_rows": 1000000}]})
    admit_probability: Number | None = Field(default=None, ge=0.0, le=1.0)
    min_count: int = Field(default=1, strict=True, ge=1)
    ttl_s: Number | None = Field(default=None, gt=0.0)
    ttl_steps: int | None = Field(default=None, strict=True, ge=1)
    max_rows: int | None = Field(default=None, strict=True, ge=1)
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"


class EmbeddingConfigRequest(BaseModel):
    """PERSIA's ``EmbeddingConfig`` and, optionally, a new embedding optimizer and table
    policies by slot name."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"emb_initialization": [-0.01, 0.01], "admit_probability": 1.0, "weight_bound": 10.0},
        {"optimizer": {"name": "adagrad", "lr": 0.01}},
        {"policies": {"user_id": {"min_count": 2, "ttl_s": 86400}, "item_id": None}}]})
    emb_initialization: tuple[Float32, Float32] | None = None
    admit_probability: Number | None = Field(default=None, ge=0.0, le=1.0)
    weight_bound: Float32 | None = Field(default=None, gt=0.0)
    optimizer: OptimizerSpec | None = None
    policies: dict[str, SlotPolicySpec | None] | None = Field(
        default=None, description="slot name -> its feature group's new table policy (null: "
        "the default); groups not named keep the policy the servers hold")


class Applied(BaseModel):
    model_config = _example({"applied": True, "servers": 2})
    applied: bool
    servers: int


class Sizes(BaseModel):
    model_config = _example({"servers": [5210, 5198], "total": 10408,
                             "slots": {"user_id": 6004, "item_id": 4404}})
    servers: list[int] = Field(description="rows per embedding server, in replica order")
    total: int
    slots: dict[str, int] = Field(
        default_factory=dict, description="rows per feature group (its name: the slot's for "
        "an ungrouped slot) over every server; empty while the servers report none")


# ---------------------------------------------------------------------------- inference
class PredictRequest(BaseModel):
    """Samples to score. Every list has one entry per sample."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "id_type_features": {"user": [[3, 17], [5]], "item": [101, 102],
                             "tags": [[1, 2, 3], []]},
        "non_id_type_features": {"dense": [[0.1, 0.2, 0.3], [0.0, 1.5, -0.2]]}}]})
    id_type_features: dict[str, list[int | list[int]]] = Field(
        description="slot -> per sample either a list of ids or one id (uint64)")
    non_id_type_features: dict[str, list[Any]] = Field(
        default_factory=dict, description="name -> nested lists, first axis is the sample")


class PredictResponse(BaseModel):
    model_config = _example({"model_version": 1200,
                             "checkpoint": "ckpt-20250101T000000Z-0001",
                             "trained_through": 1735689600.25, "rows": 2,
                             "missing_ids": 1, "truncated_ids": 0,
                             "heads": ["click", "buy"],
                             "predictions": [{"click": 0.12, "buy": 0.01},
                                             {"click": 0.57, "buy": 0.2}]})
    model_version: int = Field(description="training step of the dense model that answered")
    checkpoint: str = Field(description="id of the checkpoint the served model started from")
    trained_through: float | None = Field(
        None, description="event time (s since the epoch) of the newest training sample "
                          "whose updates the answer reflects (serving replicas; null when "
                          "not known)")
    rows: int
    missing_ids: int = Field(description="ids absent from the embedding tables (zeros used)")
    truncated_ids: int | None = Field(
        0, description="ids past a raw slot's sample_fixed_size in their sample: no row is "
                       "looked up for them (PERSIA's rule, as in training), so the answer "
                       "does not reflect them (null when the API has no embedding config: "
                       "not known)")
    heads: list[str]
    predictions: list[dict[str, float | int | bool | list[Any] | None]] = Field(
        description="per sample: head -> a number (an integer or bool head keeps its type, "
                    "never rounded through float32), or nested lists for wider heads (null "
                    "where the model's output is not finite)")


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"checkpoint": "ckpt-20250101T000000Z-0002"},
        {"checkpoint": "/ckpt/ckpt-20250101T000000Z-0002"}]})
    checkpoint: str = Field(min_length=1, description="a checkpoint id, or the full path/URL "
                                                      "of a checkpoint right under the "
                                                      "checkpoint directory; anything else "
                                                      "is 422")


# ---------------------------------------------------------------------------- checkpoints
CHECKPOINT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class CheckpointStart(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {}, {"id": "before-schema-change"}]})
    id: str | None = Field(default=None, pattern=CHECKPOINT_ID_PATTERN,
                           description="its name under the checkpoint directory (default: "
                                       "ckpt-<UTC time>-<random>); never a path, so a request "
                                       "cannot write outside that directory")


class CheckpointAccepted(BaseModel):
    model_config = _example({"id": "ckpt-20250101T000000Z-0001", "state": "pending",
                             "dst": "/ckpt/ckpt-20250101T000000Z-0001",
                             "status_url": "/v1/checkpoints/ckpt-20250101T000000Z-0001"})
    id: str
    state: str
    dst: str
    status_url: str


class CheckpointInfo(BaseModel):
    model_config = _example({
        "id": "ckpt-20250101T000000Z-0001", "state": "done",
        "dst": "/ckpt/ckpt-20250101T000000Z-0001", "by": "nn", "step": 1200,
        "progress": {"phase": "committed", "done": 1, "total": 1}, "error": None,
        "requested_at": 1735689600.0, "finished_at": 1735689604.2, "parent": None,
        "base": "ckpt-20250101T000000Z-0001", "depth": 0, "bytes": 167772160,
        "manifest": {"step": 1200, "offsets": {"job.samples": {"0": 1200}}}})
    id: str
    state: str = Field(description="pending, running, done or failed")
    dst: str
    by: str | None = Field(default=None, description="who took the cut: nn (NN ranks) or api")
    step: int | None = None
    progress: dict[str, Any] = Field(default_factory=dict)
    error: str | None = None
    requested_at: float | None = None
    finished_at: float | None = None
    parent: str | None = Field(
        default=None, description="the id of the checkpoint this one patches (an "
        "incremental checkpoint: a restore loads its base, then every patch up to it); null "
        "for a full base, or while not done")
    base: str | None = Field(
        default=None, description="the id of the full checkpoint its chain starts at (its "
        "own id for a base); null when its manifest records no chain, or while not done")
    depth: int | None = Field(
        default=None, description="patches since its base (0: a base)")
    bytes: int | None = Field(
        default=None, description="size of this checkpoint's own files (a patch's, not "
        "its chain's), as its manifest records them; null while not done")
    manifest: dict[str, Any] | None = None


class CheckpointList(BaseModel):
    model_config = _example({"checkpoints": [{
        "id": "ckpt-20250101T000000Z-a1b2c3", "state": "done",
        "dst": "/ckpt/ckpt-20250101T000000Z-a1b2c3", "by": "nn", "step": 1200,
        "progress": {"phase": "committed"}, "error": None, "requested_at": None,
        "finished_at": 1735689604.2, "parent": None,
        "base": "ckpt-20250101T000000Z-a1b2c3", "depth": 0, "bytes": 167772160,
        "manifest": {"step": 1200, "stream": "kafka"}}, {
        "id": "periodic-step-000000001300-20250101T000100.000Z-9f3e", "state": "done",
        "dst": "/ckpt/periodic-step-000000001300-20250101T000100.000Z-9f3e", "by": "periodic",
        "step": 1300, "progress": {"phase": "committed"}, "error": None,
        "requested_at": None, "finished_at": 1735689664.0,
        "parent": "ckpt-20250101T000000Z-a1b2c3", "base": "ckpt-20250101T000000Z-a1b2c3",
        "depth": 1, "bytes": 4194304, "manifest": {"step": 1300, "stream": "kafka"}}]})
    checkpoints: list[CheckpointInfo] = Field(
        description="complete ones oldest step first, then those being taken or failed")


class CheckpointDeleted(BaseModel):
    model_config = _example({"id": "ckpt-20250101T000000Z-a1b2c3", "deleted": True,
                             "dst": "/ckpt/ckpt-20250101T000000Z-a1b2c3"})
    id: str
    deleted: bool
    dst: str


class RestoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"reload_model": True}]})
    reload_model: StrictBool = Field(True, description="also serve this checkpoint's dense model")


class RestoreResult(BaseModel):
    model_config = _example({"id": "ckpt-20250101T000000Z-0001", "rows": 10408,
                             "offsets": {"0": 1200}, "workers_reset": 1,
                             "model_reloaded": True})
    id: str
    rows: int = Field(description="embedding rows loaded over every server")
    offsets: dict[str, int] = Field(default_factory=dict)
    workers_reset: int
    model_reloaded: bool
