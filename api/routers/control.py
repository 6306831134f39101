"""Job control (``/v1/...``, bearer token): status, ingest pause/resume, embedding config,
clear and sizes. Every call fans out to the roles concurrently over their RPC clients."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from prometheus_client.parser import text_string_to_metric_families
from stream_persia.api.auth import require_token
from stream_persia.api.json_body import StrictJsonRoute
from stream_persia.api.roles import SERVER, WORKER, Role, Roles
from stream_persia.api.schemas import (
    ERRORS,
    Applied,
    EmbeddingConfigRequest,
    IngestState,
    JobStatus,
    KafkaLagRow,
    ServerStatus,
    Sizes,
    StageMark,
    TrainingStatus,
    Watermarks,
    WorkerStatus,
)

from stream_persia.core.embedding_config import EmbeddingConfig, SlotPolicy
from stream_persia.core.optim import optimizer_from_dict
from stream_persia.core.replies import WorkerStatus as WorkerStatusReply
from stream_persia.errors import BadInput, Misuse, PersiaError

router = APIRouter(prefix="/v1", tags=["control"], dependencies=[Depends(require_token)],
                   responses=ERRORS["control"], route_class=StrictJsonRoute)

_APPLIED_METRIC = "persia_embedding_worker_batches_applied"


def _roles(request: Request) -> Roles:
    return request.app.state.roles


def _error(item: Any) -> str | None:
    return item.message if isinstance(item, PersiaError) else None


def _applied(text: Any) -> int | None:
    if not isinstance(text, (bytes, str)):
        return None
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    try:
        for fam in text_string_to_metric_families(text):
            if fam.name == _APPLIED_METRIC:
                return int(sum(s.value for s in fam.samples if s.name.endswith("_total")))
    except ValueError:
        return None
    return None


def _worker_status(role: Role, health: dict, status: WorkerStatusReply | PersiaError
                   ) -> WorkerStatus:
    out = WorkerStatus(index=role.index, address=role.address, healthy=health["healthy"],
                       error=health["error"] or _error(status))
    if isinstance(status, dict):
        kafka = status.get("kafka") if isinstance(status.get("kafka"), dict) else None
        out = out.model_copy(update={
            "ready": status.get("ready"), "ready_capacity": status.get("ready_capacity"),
            "inflight": status.get("inflight"), "pending": status.get("pending"),
            "ingest_paused": status.get("ingest_paused"),
            "frontier": {str(k): int(v) for k, v in (status.get("frontier") or {}).items()},
            "lag": {str(k): int(v) for k, v in ((kafka or {}).get("lag") or {}).items()},
            "kafka": kafka})
    return out


def _mark(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        return None
    return float(value)


def _watermarks(w_status: list[Any], s_health: list[Any], training: dict[str, Any] | None,
                served: float | None) -> Watermarks:
    """The job's stage watermarks: per stage the least event time over the roles that
    report it (the slowest), its lag, the Kafka lag rows and the relayed progressive.

    A role that does not answer may be the slowest: the stages its kind reports (workers:
    produced, ingested; servers: applied) are then unknown (None), not the least over the
    others, which would show a stuck role's stage as current."""
    seen: dict[str, list[float]] = {}
    unknown: set[str] = set()
    rows: list[KafkaLagRow] = []
    for i, st in enumerate(w_status):
        if not isinstance(st, dict):
            unknown |= {"produced", "ingested"}
            continue
        for stage, t in (st.get("watermarks") or {}).items():
            if (t := _mark(t)) is not None:
                seen.setdefault(stage, []).append(t)
        for row in st.get("kafka_lag") or ():
            if isinstance(row, dict):
                rows.append(KafkaLagRow(worker=i, **row))
    for health in s_health:
        if not isinstance(health, dict):
            unknown.add("applied")
        elif (t := _mark(health.get("trained_through"))) is not None:
            seen.setdefault("applied", []).append(t)
    if served is not None:
        seen.setdefault("served", []).append(served)
    now = time.time()
    marks = {stage: StageMark(event_time=min(ts), lag_s=now - min(ts))
             for stage, ts in seen.items()
             if stage in Watermarks.model_fields and stage not in unknown}
    progressive = (training or {}).get("progressive")
    return Watermarks(**marks, kafka_lag=rows,
                      progressive=progressive if isinstance(progressive, dict) else {})


def _total(values: list[int | None]) -> int | None:
    """The sum, or None when a value is unknown (its role did not answer)."""
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


@router.get("/status", response_model=JobStatus, summary="Status of the whole job")
async def status(request: Request) -> JobStatus:
    """Roles with address and health, per-partition consumer lag, batches in flight
    (staleness), rows per embedding server, training step, last checkpoint and model, and
    the stage watermarks (``watermarks``: per stage the slowest role's event time and lag,
    Kafka lag per partition, NN rank 0's relayed progressive figures)."""
    roles = _roles(request)
    state = request.app.state
    replies: dict[tuple[str, int], Any] = {}   # health replies; servers': "applied"
    (health, w_status, w_metrics, s_stats, s_size, s_slots, training,
     last) = await asyncio.gather(
        roles.health(replies),
        roles.gather_settled(roles.workers, "status"),
        roles.gather_settled(roles.workers, "metrics"),
        roles.gather_settled(roles.servers, "stats"),
        roles.gather_settled(roles.servers, "size"),
        roles.gather_settled(roles.servers, "slot_stats"),
        state.checkpoints.training(),
        state.checkpoints.last(),
    )
    by_role = {(h["role"], h["index"]): h for h in health}
    workers = [_worker_status(r, by_role[(WORKER, r.index)], st)
               for r, st in zip(roles.workers, w_status, strict=True)]
    servers = []
    for r, stats, size, slots in zip(roles.servers, s_stats, s_size, s_slots, strict=True):
        h = by_role[(SERVER, r.index)]
        servers.append(ServerStatus(
            index=r.index, address=r.address, healthy=h["healthy"],
            error=h["error"] or _error(stats) or _error(size),
            rows=size if isinstance(size, int) else None,
            stats={k: float(v) for k, v in stats.items() if isinstance(v, (int, float))}
            if isinstance(stats, dict) else {},
            slots={str(k): {str(n): int(v) for n, v in c.items()}
                   for k, c in slots.items() if isinstance(c, dict)}
            if isinstance(slots, dict) else {}))
    lag: dict[str, int] = {}
    for w in workers:
        lag.update(w.lag)
    applied = [_applied(m) for m in w_metrics]
    replica = getattr(state.predictor, "replica", None)
    served = _mark(getattr(replica, "trained_through", None))
    # Totals over the roles: unknown (None) when one does not answer, not the sum of the
    # others (a server gone would read as rows lost, a stuck worker as nothing in flight).
    paused = [w.ingest_paused for w in workers]
    inflight = [w.inflight for w in workers]
    rows = [s.rows for s in servers]
    return JobStatus(
        roles=health, workers=workers, servers=servers, consumer_lag=lag,
        staleness_in_flight=_total(inflight),
        rows_total=_total(rows),
        ingest_paused=(False if False in paused else
                       True if paused and None not in paused else None),
        training=TrainingStatus(
            step=training.get("step") if training else None,
            nn_attached=training.get("attached") if training else None,
            batches_applied=_total(applied)),
        last_checkpoint=last,
        model=state.predictor.info() if state.predictor is not None else None,
        watermarks=_watermarks(w_status, [replies.get((SERVER, r.index))
                                          for r in roles.servers], training, served))


async def _set_ingest(request: Request, paused: bool) -> IngestState:
    roles = _roles(request)
    workers = roles.require(WORKER)
    await roles.change_all(workers, "pause_ingest" if paused else "resume_ingest")
    return IngestState(ingest_paused=paused, workers=len(workers))


@router.post("/ingest/pause", response_model=IngestState, summary="Pause ingest on every worker")
async def pause_ingest(request: Request) -> IngestState:
    """Every embedding worker stops consuming its partitions (batches already buffered are
    still served). Idempotent."""
    return await _set_ingest(request, True)


@router.post("/ingest/resume", response_model=IngestState,
             summary="Resume ingest on every worker")
async def resume_ingest(request: Request) -> IngestState:
    """Every embedding worker consumes again. Idempotent."""
    return await _set_ingest(request, False)


def _checked_config(body: EmbeddingConfigRequest) -> dict[str, Any]:
    """The ``configure`` params, validated here so a bad value is a 422 before any server
    changes (a half-applied config across servers is the failure to avoid)."""
    params: dict[str, Any] = {}
    cfg = body.model_dump(exclude_none=True, exclude={"optimizer", "policies"})
    if cfg:
        try:
            params["embedding_config"] = EmbeddingConfig.from_dict(cfg).to_dict()
        except BadInput as e:
            raise BadInput(e.message, field=f"body.{e.field}", hint=e.hint) from None
    if body.optimizer is not None:
        spec = body.optimizer.model_dump()
        try:
            params["optimizer"] = optimizer_from_dict(spec).to_dict()
        except BadInput as e:
            raise BadInput(e.message, field=f"body.optimizer.{e.field}", hint=e.hint) from None
        except TypeError as e:  # a required parameter (lr) is missing
            raise BadInput(f"optimizer {spec.get('name')!r}: {e}", field="body.optimizer",
                           hint="e.g. {'name': 'adagrad', 'lr': 0.01}") from None
    if not params and body.policies is None:
        raise BadInput("nothing to apply: give EmbeddingConfig fields, an optimizer and/or "
                       "policies", field="body", hint="e.g. {'admit_probability': 0.5}")
    return params


async def _policies_param(request: Request, body: EmbeddingConfigRequest, servers: list[Role]
                          ) -> dict[str, Any] | None:
    """The ``policies`` param of ``configure``: the table the servers hold (the first
    configured one's, or the job file's while none is), with the feature group of every slot the body names replaced by its
    policy. Slot names map to groups with the API's embedding schema."""
    if body.policies is None:
        return None
    schema = request.app.state.settings.schema
    if schema is None:
        raise Misuse("policies are given by slot name, but the API has no embedding schema "
                     "to map them to feature groups", field="body.policies",
                     hint="start the API with PERSIA_EMBEDDING_CONFIG set")
    bits = schema.feature_index_prefix_bit
    if bits == 0:
        raise BadInput("the job's feature_index_prefix_bit is 0: its slots share one id "
                       "space, so only the default policy exists", field="body.policies",
                       hint="set feature_index_prefix_bit > 0 in embedding_config.yml")
    groups = schema.group_names
    table: list[dict[str, Any] | None] = [None] * (len(groups) + 1)
    # The first configured server's table is the base (no "policies": every group the
    # default, as an operator may have reset them); a server never configured (get_config
    # None; perhaps restarted, not yet configured again by the workers) holds the file's,
    # which its launcher passed: the base only while no server is configured.
    held = [c for c in await _roles(request).fanout(servers, "get_config") if c is not None]
    base = held[0].get("policies") if held else schema.policy_params()
    if base is not None and base.get("prefix_bits") == bits:
        for p, entry in enumerate(base.get("policies") or []):
            if 0 < p < len(table):
                table[p] = entry
    given: dict[int, tuple[str, SlotPolicy | None]] = {}
    for slot, spec in body.policies.items():
        where = f"body.policies.{slot}"
        try:
            g = schema.group_index(slot)
        except BadInput as e:
            raise BadInput(e.message, field=where, hint=e.hint) from None
        policy = None if spec is None else SlotPolicy.from_dict(spec.model_dump(), where)
        if policy is not None and policy.is_default:
            policy = None
        if g in given and given[g][1] != policy:
            raise BadInput(f"slot {slot!r} is given another policy than slot {given[g][0]!r} "
                           f"of the same feature group {groups[g]!r}", field=where,
                           hint="slots of one group share one id space and one policy: "
                                "give it once")
        given[g] = (slot, policy)
        table[g + 1] = None if policy is None else policy.to_dict()
    return {"prefix_bits": bits, "policies": table, "names": [None, *groups]}


@router.post("/embeddings/configure", response_model=Applied,
             summary="Apply an EmbeddingConfig (and optimizer) to every embedding server")
async def configure(request: Request, body: EmbeddingConfigRequest) -> Applied:
    """PERSIA's ``configure_embedding_parameter_servers``. The EmbeddingConfig is replaced
    as a whole (fields left out take their defaults) when any of its fields is given; the
    optimizer only when given; ``policies`` (by slot name) replace the policy of each named
    slot's feature group as a whole, other groups keep theirs. Checked in full, and every
    server must answer, before any server is changed; a server that fails the change
    itself is an error naming the servers that took it and those that did not (send it
    again: it is idempotent)."""
    params = _checked_config(body)
    roles = _roles(request)
    servers = roles.require(SERVER)
    policies = await _policies_param(request, body, servers)
    if policies is not None:
        params["policies"] = policies
    await roles.change_all(servers, "configure", params)
    return Applied(applied=True, servers=len(servers))


@router.post("/embeddings/clear", response_model=Applied,
             summary="Clear every embedding on every server")
async def clear(request: Request) -> Applied:
    """PERSIA's ``clear_embeddings``: drops every row on every embedding server. Every
    server must answer before any is cleared; one that fails the clear itself is an error
    naming the servers that were cleared and those that were not."""
    roles = _roles(request)
    servers = roles.require(SERVER)
    await roles.change_all(servers, "clear")
    return Applied(applied=True, servers=len(servers))


@router.get("/embeddings/sizes", response_model=Sizes, summary="Rows per embedding server")
async def sizes(request: Request) -> Sizes:
    """PERSIA's ``get_embedding_size``: rows held by each server, in replica order."""
    roles = _roles(request)
    servers = roles.require(SERVER)
    sizes, slot_stats = await asyncio.gather(roles.fanout(servers, "size"),
                                             roles.gather_settled(servers, "slot_stats"))
    counts = [int(n) for n in sizes]
    return Sizes(servers=counts, total=sum(counts), slots=_slot_rows(slot_stats))


def _slot_rows(replies: list[Any]) -> dict[str, int]:
    """Rows per feature group over every server's ``slot_stats`` (errors: left out)."""
    out: dict[str, int] = {}
    for reply in replies:
        if isinstance(reply, dict):
            for slot, counts in reply.items():
                if isinstance(counts, dict):
                    out[str(slot)] = out.get(str(slot), 0) + int(counts.get("rows", 0))
    return out
