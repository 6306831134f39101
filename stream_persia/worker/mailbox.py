"""The checkpoint mailbox: how a checkpoint started over HTTP reaches the NN ranks.

NN ranks are clients (they call embedding workers; nothing calls them), so a request to
checkpoint waits in a mailbox that NN rank 0 polls between steps. The mailbox is a set of
RPC handlers mounted on embedding worker replica 0, which every NN rank already talks to
(:meth:`CheckpointMailbox.handlers`); the API reaches it through :class:`MailboxClient`,
and ``TrainCtx`` polls it through
:class:`stream_persia.nn.checkpoint_poller.NnCheckpointPoller` after every ``backward``.

RPC methods (params → result):

- ``nn_heartbeat {"rank", "world_size", "step", "trained"?, "progressive"?,
  "periodic"?, "at_step"?, "waiting"?}`` → ``{"checkpoint": {"id", "dst",
  "report_every_s"} | None}``: NN rank 0's training thread calls it at step boundaries
  (at most every ~0.5 s) and while its DataLoader waits for a batch: with one rank that
  is a step boundary too, with several it says ``"at_step": false`` (it cannot take a
  request there). Its RPC loop thread adds ``"waiting": true`` heartbeats every ~2 s that
  the training thread sent none (evaluation, user code, a slow step, a stuck collective):
  they relay nothing, only say the process is alive, and never attach a rank the mailbox
  marked detached. ``nn_status`` tells them apart: ``age_s`` since the training thread's
  last heartbeat (what ``persia_nn_heartbeat_age_seconds`` exports: a stuck step ages
  it), ``step_age_s`` since the last one at a step boundary, ``alive_s`` since any. ``trained``, ``progressive`` and
  ``periodic`` are the figures it relays for the worker to export
  (:mod:`stream_persia.worker.nn_relay`, which validates them). The reply carries the
  pending request, again on every call until the rank
  reports it ``running`` (so a lost reply loses nothing). Rank 0 then tells the other
  ranks (a broadcast), and every rank calls ``dump_checkpoint(dst)`` at the same step:
  the consistent cut of DESIGN §7.
- ``nn_detach {"rank", "step"?, "reason"?}`` → None: the NN ranks stop training (their
  context exits). The last heartbeat is marked detached, and a request not yet finished
  fails with the reason (the API then takes the cut itself: nothing trains any more).
- ``checkpoint_request {"id", "dst", "ttl_s"?, "report_timeout_s"?}`` → the record: queue
  a request (API). Misuse while another one is pending or running. A request nobody picks
  up within ``ttl_s`` (default 60) fails; so does one taken (running) whose rank 0 has
  not reported for ``report_timeout_s`` (default 30; liveness, below). ``dst`` must lie
  under the mailbox's checkpoint root (:mod:`stream_persia.checkpoint.root`; BadInput on
  field ``dst`` otherwise, Misuse when there is no root): NN rank 0 writes the
  checkpoint there, whoever asked.
- ``checkpoint_report {"id", "state": "running"|"done"|"failed", "step"?, "progress"?,
  "manifest"?, "error"?}`` → None: NN rank 0 reports progress and the outcome. A report of
  ``running`` with nothing else is a keepalive (the progress stays).
- ``checkpoint_status {"id"}`` → the record or None; ``nn_status`` → ``{"rank",
  "world_size", "step", "age_s", "detached", "trained", "progressive", "periodic"}`` of the
  last heartbeat, or None.

A record: ``{"id", "dst", "state", "step", "progress", "manifest", "error",
"requested_at", "updated_at", "report_timeout_s"}`` with ``state`` one of pending, running,
done, failed; ``updated_at`` is the time of the last report (or of the request), and
``step`` stays None until the NN ranks take the request (so a failed record with no step
was never picked up).

Liveness of a checkpoint being taken. NN rank 0 can die inside ``dump_checkpoint`` (SIGKILL,
the OOM killer) after reporting ``running``; nothing else would then end the record, and
the API would wait for its own timeout (an hour). So while a checkpoint runs, rank 0 sends
a keepalive report every ``report_every_s`` (a sixth of the request's ``report_timeout_s``,
given in the offer) from its RPC loop thread, independent of the dump, which can spend
minutes in one phase (a large dense model, many embedding shards). A running record whose
last report is older than ``report_timeout_s`` fails ("NN rank 0 stopped reporting while
taking checkpoint ..."), the last heartbeat is marked detached (the API then reports no NN
rank attached, and takes the next checkpoint itself), and a new request is accepted at
once. This deadline was chosen over watching rank 0's RPC connection close (instant on a
killed process): a client may reconnect or use several connections (TCP or the Unix
socket), so a closed connection does not prove death, while a host that vanishes or a
network partition closes nothing; the deadline covers every case with one rule, and needs
no change to the RPC layer. It proves rank 0's process and its link to worker 0 are alive,
not that the dump advances: a rank 0 stuck in a collective (another rank died) keeps the
record running until the process group's timeout (``max(ready_timeout_s, 60)`` s of
``TrainCtx``, 300 by default) fails the collective; rank 0 reports any exception out of
``dump_checkpoint`` as failed (:class:`stream_persia.nn.checkpoint_poller.NnCheckpointPoller`).
A gloo collective raises at the timeout (checked by hand, not by a test: a test would wait
the 60 s minimum); under NCCL that depends on torch's NCCL error handling. A rank 0 that
was only stalled and reports later is refused (Misuse: already failed); its next heartbeat
attaches it again.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from typing import Any

from stream_persia.checkpoint.root import CheckpointRoot, require_root
from stream_persia.errors import BadInput, Misuse
from stream_persia.worker.nn_relay import NnRelay, parse_relay

__all__ = ["CheckpointMailbox", "MailboxClient", "REPORT_TIMEOUT_S", "TERMINAL"]

log = logging.getLogger(__name__)

TERMINAL = ("done", "failed")
_STATES = ("pending", "running", "done", "failed")
_HISTORY = 32
#: default of ``checkpoint_request``'s ``report_timeout_s`` (seconds)
REPORT_TIMEOUT_S = 30.0
#: rank 0's keepalive interval, as a fraction of ``report_timeout_s``
KEEPALIVES_PER_TIMEOUT = 6


def _str(params: Any, key: str) -> str:
    value = params.get(key) if isinstance(params, dict) else None
    if not isinstance(value, str) or not value:
        raise BadInput(f"{key!r} must be a non-empty string, got {value!r}", field=key)
    return value


def _positive(params: dict, key: str, default: float) -> float:
    v = params.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == math.inf:
        raise BadInput(f"{key} must be a number of seconds > 0, got {v!r}", field=key)
    return float(v)


def _count(params: dict, key: str) -> int:
    v = params.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise BadInput(f"{key!r} must be an int >= 0, got {v!r}", field=key)
    return v


def _flag(params: dict, key: str, default: bool) -> bool:
    v = params.get(key, default)
    if not isinstance(v, bool):
        raise BadInput(f"{key!r} must be true or false, got {v!r}", field=key)
    return v


class CheckpointMailbox:
    """Server side: pending checkpoint requests and the NN ranks' heartbeats.

    Args:
        clock: wall-clock seconds (tests give their own).
        checkpoint_root: the root every request's ``dst`` must lie under; None: every
            request is refused.
    """

    def __init__(self, clock: Any = time.time, *,
                 checkpoint_root: CheckpointRoot | None = None):
        self._clock = clock
        self.checkpoint_root = checkpoint_root
        self._records: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._expires: dict[str, float] = {}
        self._heartbeat: dict[str, Any] | None = None

    def handlers(self) -> dict[str, Any]:
        """RPC method name → coroutine, to merge into an ``RpcServer``'s handlers."""
        return {"nn_heartbeat": self.nn_heartbeat, "nn_detach": self.nn_detach,
                "checkpoint_request": self.request, "checkpoint_report": self.report,
                "checkpoint_status": self.status, "nn_status": self.nn_status}

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
        for rec in self._records.values():
            if rec["state"] == "running" and now - rec["updated_at"] > rec["report_timeout_s"]:
                self._lost(rec, now)

    def _lost(self, rec: dict[str, Any], now: float) -> None:
        """Rank 0 took ``rec`` and went silent past its limit: it is presumed dead."""
        rec.update(state="failed", updated_at=now, error=(
            f"NN rank 0 stopped reporting while taking checkpoint {rec['id']} (last report "
            f"{now - rec['updated_at']:.1f} s ago, at step {rec['step']}; the limit is "
            f"report_timeout_s={rec['report_timeout_s']:g}): it was killed or lost its "
            f"link to embedding worker 0, and the checkpoint may be incomplete"))
        log.warning("checkpoint %s failed: %s", rec["id"], rec["error"])
        if self._heartbeat is not None:
            self._heartbeat["detached"] = True

    def _active(self) -> dict[str, Any] | None:
        self._expire()
        return next((r for r in self._records.values() if r["state"] not in TERMINAL), None)

    async def request(self, params: Any) -> dict[str, Any]:
        ident, dst = _str(params, "id"), _str(params, "dst")
        dst = require_root(self.checkpoint_root, "the checkpoint mailbox").confine(dst, "dst")
        ttl = _positive(params, "ttl_s", 60.0)
        report_timeout_s = _positive(params, "report_timeout_s", REPORT_TIMEOUT_S)
        active = self._active()
        if active is not None and active["id"] != ident:
            raise Misuse(f"checkpoint {active['id']} is {active['state']}; one at a time",
                         hint="wait for it to finish")
        if active is not None:
            return dict(active)
        now = self._clock()
        rec = {"id": ident, "dst": dst, "state": "pending", "step": None, "progress": {},
               "manifest": None, "error": None, "requested_at": now, "updated_at": now,
               "report_timeout_s": report_timeout_s}
        self._records[ident] = rec
        self._expires[ident] = now + ttl
        while len(self._records) > _HISTORY:
            self._records.popitem(last=False)
        return dict(rec)

    async def nn_heartbeat(self, params: Any) -> dict[str, Any]:
        if not isinstance(params, dict):
            raise BadInput("nn_heartbeat takes {'rank', 'world_size', 'step'}", field="params")
        rank, world, step = (_count(params, k) for k in ("rank", "world_size", "step"))
        waiting, at_step = (_flag(params, "waiting", False), _flag(params, "at_step", True))
        now = self._clock()
        hb = self._heartbeat
        if waiting:   # the process is alive, training is elsewhere: liveness only
            if hb is not None and not hb["detached"]:
                hb.update(world_size=world, step=step, seen=now)
        else:
            relay = parse_relay(params)
            kept = hb["stepped"] if hb is not None and not hb["detached"] else None
            self._heartbeat = {"rank": rank, "world_size": world, "step": step, "at": now,
                               "seen": now, "stepped": now if at_step else kept,
                               "detached": False, "relay": relay}
        active = self._active()
        if active is None or active["state"] != "pending":
            return {"checkpoint": None}
        return {"checkpoint": {
            "id": active["id"], "dst": active["dst"],
            "report_every_s": active["report_timeout_s"] / KEEPALIVES_PER_TIMEOUT}}

    async def nn_detach(self, params: Any) -> None:
        if not isinstance(params, dict):
            raise BadInput("nn_detach takes {'rank', 'reason'?}", field="params")
        _count(params, "rank")
        reason = params.get("reason") or "the NN ranks stopped training"
        if not isinstance(reason, str):
            raise BadInput(f"reason must be a string, got {reason!r}", field="reason")
        if self._heartbeat is not None:
            self._heartbeat["detached"] = True
            if "step" in params:
                self._heartbeat["step"] = _count(params, "step")
        active = self._active()
        if active is not None:
            when = "before taking it" if active["state"] == "pending" else "while taking it"
            active.update(state="failed", updated_at=self._clock(),
                          error=f"{reason} {when}")

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
        self._expire()     # a rank 0 lost while taking a checkpoint shows as detached
        hb = self._heartbeat
        if hb is None:
            return None
        now = self._clock()
        stepped = hb["stepped"]
        return {"rank": hb["rank"], "world_size": hb["world_size"], "step": hb["step"],
                "age_s": max(0.0, now - hb["at"]), "alive_s": max(0.0, now - hb["seen"]),
                "step_age_s": None if stepped is None else max(0.0, now - stepped),
                "detached": hb["detached"],
                "trained": hb["relay"]["trained"], "progressive": hb["relay"]["progressive"],
                "periodic": hb["relay"]["periodic"]}

    def relay(self) -> tuple[NnRelay, float] | None:
        """What the last heartbeat relayed, and its age in seconds (None before one)."""
        hb = self._heartbeat
        if hb is None:
            return None
        return hb["relay"], max(0.0, self._clock() - hb["at"])


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
        """The last heartbeat, or None without a mailbox or heartbeat; with ``attached``
        (NN rank 0 alive and training: any heartbeat within the window) and ``stepping``
        (a step's heartbeat within it: a checkpoint request reaches a step soon)."""
        try:
            hb = await self._call("nn_status", None)
        except Misuse:          # the peer has no mailbox: RpcServer answers unknown methods
            self.supported = False
            return None
        self.supported = True
        if not isinstance(hb, dict):
            return None
        def within(key: str) -> bool:
            value = hb.get(key, hb.get("age_s"))   # an older mailbox has age_s alone
            return value is not None and float(value) <= self.attached_within_s

        live = not hb.get("detached")
        return {**hb, "attached": live and (within("age_s") or within("alive_s")),
                "stepping": live and within("step_age_s")}

    async def request(self, ident: str, dst: str, ttl_s: float,
                      report_timeout_s: float = REPORT_TIMEOUT_S) -> dict[str, Any]:
        return await self._call("checkpoint_request", {"id": ident, "dst": dst, "ttl_s": ttl_s,
                                                       "report_timeout_s": report_timeout_s})

    async def status(self, ident: str) -> dict[str, Any] | None:
        return await self._call("checkpoint_status", {"id": ident})
