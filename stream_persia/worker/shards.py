"""Lookup and update groups, split per owning server and put back together: the pure half
of :class:`stream_persia.worker.router.ShardRouter` (no I/O).

A group is one dim's ids: :class:`RowLookup` (their rows come back), :class:`PooledLookup`
(a pooled lookup, :mod:`stream_persia.kernels.segments`: every server pools the rows it
owns and the partial sums are added) or :class:`UpdateGroup` (gradient rows to apply).
Splitting is one stable argsort per group, or one pass of
:func:`~stream_persia.kernels.segments.split`; nothing is done per id in Python.

Wire groups (the ``groups`` of an embedding server's ``lookup`` and ``update``,
:mod:`stream_persia.server.service`): ``{"dim", "ids"}``, ``{"dim", "ids", "index",
"offsets"}`` and ``{"dim", "ids", "grads"}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np

from stream_persia.core.replies import UpdateReply
from stream_persia.errors import PersiaError
from stream_persia.kernels import segments
from stream_persia.kernels.sharding import shard_of, split_by_shard

__all__ = ["LookupGroup", "LookupPlan", "PendingUpdate", "PooledLookup", "RowLookup",
           "UpdateGroup", "gather_lookup", "plan_lookup", "split_update"]

#: A wire group (the dicts above).
WireGroup: TypeAlias = dict[str, Any]
#: Server ``s``'s share of a lookup group: its wire group, and where its reply goes (the
#: positions of its rows in the group's result; None: partial sums, added). None when
#: ``s`` owns none of the group's ids.
_Part: TypeAlias = tuple[WireGroup, np.ndarray | None] | None


@dataclass(frozen=True, eq=False)
class RowLookup:
    """The rows of ``ids`` (uint64): a float32 ``(len(ids), dim)`` result."""

    dim: int
    ids: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.ids), self.dim)

    def to_wire(self) -> WireGroup:
        return {"dim": self.dim, "ids": self.ids}

    def per_server(self, num_shards: int) -> list[_Part]:
        split = split_by_shard(self.ids, num_shards)
        parts: list[_Part] = []
        for s in range(num_shards):
            pos = split.positions(s)
            parts.append(({"dim": self.dim, "ids": self.ids[pos]}, pos) if pos.size else None)
        return parts


@dataclass(frozen=True, eq=False)
class PooledLookup:
    """A pooled lookup of ``ids`` (uint64, distinct): ``index`` (int32) and ``offsets``
    (int64) as :mod:`stream_persia.kernels.segments` has them; a float32 ``(len(offsets)
    - 1, dim)`` result of segment sums."""

    dim: int
    ids: np.ndarray
    index: np.ndarray
    offsets: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.offsets) - 1, self.dim)

    def to_wire(self) -> WireGroup:
        return {"dim": self.dim, "ids": self.ids, "index": self.index, "offsets": self.offsets}

    def per_server(self, num_shards: int) -> list[_Part]:
        splits = segments.split(self.index, self.offsets, shard_of(self.ids, num_shards),
                                num_shards)
        return [({"dim": self.dim, "ids": self.ids[sp.positions], "index": sp.index,
                  "offsets": sp.offsets}, None) if sp.positions.size else None
                for sp in splits]


LookupGroup: TypeAlias = RowLookup | PooledLookup


@dataclass(frozen=True, eq=False)
class UpdateGroup:
    """Gradient rows to apply: ``grads`` float32 ``(len(ids), dim)``, one row per id of
    ``ids`` (uint64, distinct)."""

    dim: int
    ids: np.ndarray
    grads: np.ndarray


@dataclass(frozen=True, eq=False)
class LookupPlan:
    """A lookup split per server: ``requests[s]`` the wire groups server ``s`` gets (only
    servers owning some id are named), ``where[s]`` for each of them the group it is part
    of and where its reply goes (positions, or None: partial sums to add)."""

    requests: dict[int, list[WireGroup]]
    where: dict[int, list[tuple[int, np.ndarray | None]]]


def plan_lookup(groups: Sequence[LookupGroup], num_shards: int) -> LookupPlan:
    """Split ``groups`` into one request per owning server."""
    shares = [g.per_server(num_shards) for g in groups]
    requests: dict[int, list[WireGroup]] = {}
    where: dict[int, list[tuple[int, np.ndarray | None]]] = {}
    for s in range(num_shards):
        for gi, parts in enumerate(shares):
            part = parts[s]
            if part is not None:
                requests.setdefault(s, []).append(part[0])
                where.setdefault(s, []).append((gi, part[1]))
    return LookupPlan(requests, where)


def gather_lookup(groups: Sequence[LookupGroup], plan: LookupPlan,
                  rows: Mapping[int, Sequence[np.ndarray]]) -> list[np.ndarray]:
    """One float32 array per group from each server's reply rows (``rows[s]``, one array
    per wire group of ``plan.requests[s]``); partial sums are added in server order."""
    out = [np.zeros(g.shape, dtype=np.float32) for g in groups]
    for s in sorted(rows):
        for got, (gi, pos) in zip(rows[s], plan.where[s], strict=True):
            if pos is None:
                out[gi] += got
            else:
                out[gi][pos] = got
    return out


def split_update(groups: Sequence[UpdateGroup], num_shards: int
                 ) -> dict[int, list[WireGroup]]:
    """``groups`` as one list of wire groups per owning server (one stable argsort per
    group)."""
    if num_shards == 1:
        return {0: [{"dim": g.dim, "ids": g.ids, "grads": np.ascontiguousarray(g.grads)}
                    for g in groups]} if groups else {}
    splits = [split_by_shard(g.ids, num_shards) for g in groups]
    parts: dict[int, list[WireGroup]] = {}
    for s in range(num_shards):
        for g, sp in zip(groups, splits, strict=True):
            pos = sp.positions(s)
            if pos.size:
                parts.setdefault(s, []).append(
                    {"dim": g.dim, "ids": g.ids[pos],
                     "grads": np.ascontiguousarray(g.grads[pos])})
    return parts


@dataclass(eq=False)
class PendingUpdate:
    """One batch's update, split per owning server, and what each server answered.

    ``parts`` maps a server index to the groups it owns; ``replies`` gets a server's reply
    once it applied them (or recognised the token); ``errors`` the last error of a server
    that has not replied.
    """

    token: str | None
    parts: dict[int, list[WireGroup]]
    source: dict[str, Any] | None = None   # its Kafka batch (stream_persia.core.watermarks)
    event_time: float | None = None         # its batch's event time (servers' trained_through)
    #: per server, the table its rows were looked up in, a router's ``Table`` (process,
    #: loads): the only one it may reach
    tables: dict[int, Any] = field(default_factory=dict)
    replies: dict[int, UpdateReply] = field(default_factory=dict)
    errors: dict[int, PersiaError] = field(default_factory=dict)

    def missing(self) -> list[int]:
        """Servers that have not replied yet, in index order."""
        return [s for s in self.parts if s not in self.replies]

    def done(self) -> bool:
        return len(self.replies) == len(self.parts)

    def totals(self) -> tuple[int, int]:
        """(applied, dropped) over the servers that replied."""
        return (sum(int(r["applied"]) for r in self.replies.values()),
                sum(int(r["dropped"]) for r in self.replies.values()))
