"""The checkpoint mailbox: how a checkpoint started over HTTP reaches the NN ranks.

NN ranks are clients (they call embedding workers; nothing calls them), so a request to
checkpoint waits in a mailbox that NN rank 0 polls between steps. The mailbox is a set of
RPC handlers meant to be mounted on embedding worker replica 0, which every NN rank
already talks to (:meth:`CheckpointMailbox.handlers`); the API reaches it through
:class:`MailboxClient`. This module imports nothing from ``api`` so the handlers can move
next to the worker unchanged.

RPC methods (params → result):

- ``nn_heartbeat {"rank", "world_size", "step"}`` → ``{"checkpoint": {"id", "dst"} |
  None}``: NN rank 0 calls it at a step boundary (at most every ~100 ms is plenty). The
  reply carries the pending request, again on every call until the rank reports it
  ``running`` (so a lost reply loses nothing). Rank 0 then tells the other ranks (e.g. a
  broadcast with the step's all-reduce), and every rank calls ``dump_checkpoint(dst)`` at
  the same step: the consistent cut of DESIGN §7.
- ``checkpoint_request {"id", "dst", "ttl_s"?}`` → the record: queue a request (API).
  Misuse while another one is pending or running. A request nobody picks up within
  ``ttl_s`` (default 60) expires.
- ``checkpoint_report {"id", "state": "running"|"done"|"failed", "step"?, "progress"?,
  "manifest"?, "error"?}`` → None: NN rank 0 reports progress and the outcome.
- ``checkpoint_status {"id"}`` → the record or None; ``nn_status`` → ``{"rank",
  "world_size", "step", "age_s"}`` of the last heartbeat, or None.

A record: ``{"id", "dst", "state", "step", "progress", "manifest", "error",
"requested_at", "updated_at"}`` with ``state`` one of pending, running, done, failed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from stream_persia.errors import BadInput, Misuse

__all__ = ["CheckpointMailbox", "MailboxClient", "NnCheckpointPoller", "TERMINAL"]

TERMINAL = ("done", "failed")
_STATES = ("pending", "running", "done", "failed")
_HISTORY = 32


def _str(params: Any, key: str) -> str:
    value = params.get(key) if isinstance(params, dict) else None
    if not isinstance(value, str) or not value:
        raise BadInput(f"{key!r} must be a non-empty string, got {value!r}", field=key)
    return value


class CheckpointMailbox:
    """Server side: pending checkpoint requests and the NN ranks' heartbeats."""

    def __init__(self, clock: Any = time.time):
        self._clock = clock
        self._records: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._expires: dict[str, float] = {}
        self._heartbeat: dict[str, Any] | None = None

    def handlers(self) -> dict[str, Any]:
        """RPC method name → coroutine, to merge into an ``RpcServer``'s handlers."""
        return {"nn_heartbeat": self.nn_heartbeat, "checkpoint_request": self.request,
                "checkpoint_report": self.report, "checkpoint_status": self.status,
                "nn_status": self.nn_status}

    def _expire(self) -> None:
        now = self._clock()
        for ident, deadline in list(self._expires.items()):
            rec = self._records.get(ident)
            if rec is None or rec["state"] != "pending":
                self._expires.pop(ident, None)
            elif now > deadline:
                rec.update(state="failed", updated_at=now,
                           error="no NN rank picked the request up in time")
                self._expires.pop(ident, None)

    def _active(self) -> dict[str, Any] | None:
        self._expire()
        return next((r for r in self._records.values() if r["state"] not in TERMINAL), None)

    async def request(self, params: Any) -> dict[str, Any]:
        ident, dst = _str(params, "id"), _str(params, "dst")
        ttl = params.get("ttl_s", 60.0)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0:
            raise BadInput(f"ttl_s must be a number > 0, got {ttl!r}", field="ttl_s")
        active = self._active()
        if active is not None and active["id"] != ident:
            raise Misuse(f"checkpoint {active['id']} is {active['state']}; one at a time",
                         hint="wait for it to finish")
        if active is not None:
            return dict(active)
        now = self._clock()
        rec = {"id": ident, "dst": dst, "state": "pending", "step": None, "progress": {},
               "manifest": None, "error": None, "requested_at": now, "updated_at": now}
        self._records[ident] = rec
        self._expires[ident] = now + float(ttl)
        while len(self._records) > _HISTORY:
            self._records.popitem(last=False)
        return dict(rec)

    async def nn_heartbeat(self, params: Any) -> dict[str, Any]:
        if not isinstance(params, dict):
            raise BadInput("nn_heartbeat takes {'rank', 'world_size', 'step'}", field="params")
        for key in ("rank", "world_size", "step"):
            v = params.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise BadInput(f"{key!r} must be an int >= 0, got {v!r}", field=key)
        self._heartbeat = {"rank": params["rank"], "world_size": params["world_size"],
                           "step": params["step"], "at": self._clock()}
        active = self._active()
        if active is None or active["state"] != "pending":
            return {"checkpoint": None}
        return {"checkpoint": {"id": active["id"], "dst": active["dst"]}}

    async def report(self, params: Any) -> None:
        ident = _str(params, "id")
        rec = self._records.get(ident)
        if rec is None:
            raise BadInput(f"no checkpoint request {ident!r}", field="id")
        state = params.get("state")
        if state not in _STATES[1:]:
            raise BadInput(f"state must be running, done or failed, got {state!r}",
                           field="state")
        if rec["state"] in TERMINAL:
            raise Misuse(f"checkpoint {ident} is already {rec['state']}")
        rec["state"] = state
        rec["updated_at"] = self._clock()
        for key in ("step", "progress", "manifest", "error"):
            if key in params:
                rec[key] = params[key]

    async def status(self, params: Any) -> dict[str, Any] | None:
        self._expire()
        rec = self._records.get(_str(params, "id"))
        return dict(rec) if rec is not None else None

    async def nn_status(self, params: Any) -> dict[str, Any] | None:
        hb = self._heartbeat
        if hb is None:
            return None
        return {"rank": hb["rank"], "world_size": hb["world_size"], "step": hb["step"],
                "age_s": max(0.0, self._clock() - hb["at"])}


class MailboxClient:
    """API side: the mailbox as reached over one ``RpcClient``-like ``call``.

    Args:
        call: ``async call(method, params)``, e.g. ``Roles.call`` bound to worker 0.
        attached_within_s: an NN rank counts as attached when its last heartbeat is
            at most this old.
    """

    def __init__(self, call: Any, *, attached_within_s: float = 10.0):
        self._call = call
        self.attached_within_s = attached_within_s
        self.supported: bool | None = None   # None: not probed yet

    async def nn_status(self) -> dict[str, Any] | None:
        """The last heartbeat (with ``attached``), or None without a mailbox or heartbeat."""
        try:
            hb = await self._call("nn_status", None)
        except Misuse:          # the peer has no mailbox: RpcServer answers unknown methods
            self.supported = False
            return None
        self.supported = True
        if not isinstance(hb, dict):
            return None
        return {**hb, "attached": float(hb.get("age_s", 1e9)) <= self.attached_within_s}

    async def request(self, ident: str, dst: str, ttl_s: float) -> dict[str, Any]:
        return await self._call("checkpoint_request", {"id": ident, "dst": dst, "ttl_s": ttl_s})

    async def status(self, ident: str) -> dict[str, Any] | None:
        return await self._call("checkpoint_status", {"id": ident})


class NnCheckpointPoller:
    """NN side: take checkpoints requested over HTTP at a step boundary (for ``TrainCtx``).

    Call :meth:`step_boundary` after every ``backward`` on every rank. Every ``every_steps``
    steps rank 0 sends ``nn_heartbeat`` (with the step) and, with several ranks, broadcasts
    the pending request so that all ranks agree; then every rank runs
    ``ctx.dump_checkpoint(dst)`` at that same step and rank 0 reports the outcome. This is
    the glue a ``TrainCtx`` needs to honour ``POST /v1/checkpoints``; it uses only the
    context's public checkpoint call and its RPC loop.

    Args:
        ctx: an entered ``TrainCtx``.
        address: the mailbox's ``host:port`` (default: the context's embedding worker 0).
        every_steps: poll period in steps (the same on every rank).
        dump_kwargs: passed to ``dump_checkpoint`` (e.g. ``with_jit_model=True`` so the
            API can serve the checkpoint without the model class).
    """

    def __init__(self, ctx: Any, address: str | None = None, *, every_steps: int = 1,
                 **dump_kwargs: Any):
        from stream_persia.rpc import RpcClient

        self.ctx = ctx
        self.cluster = ctx._cluster()
        self.every_steps = max(1, int(every_steps))
        self.dump_kwargs = dump_kwargs
        self._calls = 0
        self._client = RpcClient(address or self.cluster.workers[0].address, timeout_ms=10_000,
                                 name="checkpoint mailbox")

    def close(self) -> None:
        self.cluster.run(self._client.close())

    def _call(self, method: str, params: Any) -> Any:
        return self.cluster.run(self._client.call(method, params))

    def _agree(self, request: dict | None) -> dict | None:
        if getattr(self.ctx, "world_size", 1) <= 1:
            return request
        import torch.distributed as dist

        box = [request]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def step_boundary(self) -> str | None:
        """Poll (every ``every_steps`` calls); returns the id of a checkpoint taken now."""
        self._calls += 1
        if self._calls % self.every_steps:
            return None
        rank = getattr(self.ctx, "rank", 0)
        step = int(getattr(self.ctx, "steps", 0))
        request = None
        if rank == 0:
            reply = self._call("nn_heartbeat", {"rank": 0, "step": step, "world_size":
                                                getattr(self.ctx, "world_size", 1)})
            request = reply.get("checkpoint") if isinstance(reply, dict) else None
        request = self._agree(request)
        if request is None:
            return None
        ident, dst = request["id"], request["dst"]
        if rank == 0:
            self._call("checkpoint_report", {"id": ident, "state": "running", "step": step,
                                             "progress": {"phase": "dumping"}})
        try:
            self.ctx.dump_checkpoint(dst, **self.dump_kwargs)
        except Exception as e:
            if rank == 0:
                self._call("checkpoint_report", {"id": ident, "state": "failed",
                                                 "error": f"{type(e).__name__}: {e}"})
            raise
        if rank == 0:
            from stream_persia.checkpoint import read_manifest

            manifest = read_manifest(dst).to_dict()
            self._call("checkpoint_report", {"id": ident, "state": "done", "step": step,
                                             "progress": {"phase": "committed"},
                                             "manifest": manifest})
        return ident
