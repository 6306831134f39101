"""The embedding server's table policies (issue 20): the ``policies`` param of ``configure``,
the periodic expiry pass and the per-slot metrics.

``policies`` (in ``configure``, and the server's constructor) is the wire form of a job's
:class:`~stream_persia.core.embedding_config.SlotPolicy` table, as
:meth:`stream_persia.config.embedding.EmbeddingSchema.policy_params` builds it::

    {"prefix_bits": int,                 # the schema's feature_index_prefix_bit, 1..32
     "policies": [dict | None, ...],     # entry p governs ids whose top prefix_bits bits
                                         #  are p (p = group + 1); None: the default
     "names": [str | None, ...]}         # optional: the group's name per entry (metrics)

At most ``2**prefix_bits`` entries (and :data:`MAX_POLICIES`); each dict a ``SlotPolicy``'s
fields (BadInput naming ``policies.policies[p].<key>`` otherwise). The store applies it
with ``set_policies`` on the store thread.

Metrics (from the store's ``policy_stats()``, read on the store thread by the expiry pass
once a second and by the ``metrics`` and ``slot_stats`` RPCs), per group, ``slot`` being its name (``default``
for entry 0 and entries past the table, ``p<index>`` for an entry with no name)::

    persia_embedding_server_slot_rows{slot}
    persia_embedding_server_slot_admitted_total{slot}
    persia_embedding_server_slot_rejected_total{slot}
    persia_embedding_server_slot_expired_total{slot}
    persia_embedding_server_slot_evicted_total{slot, policy="lru"|"cap"}
    persia_embedding_server_slot_dropped_grads_total{slot}

The counters go on across loads (a load swaps the store, whose own counts start from zero),
as the server's other store counters do.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from stream_persia.core.embedding_config import SlotPolicy
from stream_persia.errors import BadInput
from stream_persia.server.policies import EXPIRE_ROWS, MAX_POLICIES

__all__ = ["SlotPolicies", "parse_policies", "SlotStats", "MAX_POLICIES", "EXPIRE_ROWS",
           "EXPIRE_INTERVAL_S"]

log = logging.getLogger(__name__)

# MAX_POLICIES, the most entries a policy table may have, and EXPIRE_ROWS, the rows one
# expiry pass may evict (bounded work on the store thread between requests; a pass that
# reaches it is followed by the next at once, others by EXPIRE_INTERVAL_S), are the
# stores' own (stream_persia.server.policies): a table this module accepts, they take.
#: Seconds between two expiry passes.
EXPIRE_INTERVAL_S = 1.0
#: The store's policy_stats() keys: (metric, kind, extra label).
_STATS = {"rows": ("rows", "gauge", None), "admitted": ("admitted", "counter", None),
          "rejected": ("rejected", "counter", None), "expired": ("expired", "counter", None),
          "evicted_lru": ("evicted", "counter", ("policy", "lru")),
          "evicted_cap": ("evicted", "counter", ("policy", "cap")),
          "dropped_grads": ("dropped_grads", "counter", None)}
_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


class SlotPolicies(NamedTuple):
    """A validated policy table: what ``set_policies`` takes, and the names for metrics."""

    prefix_bits: int
    policies: tuple[SlotPolicy | None, ...]
    names: tuple[str | None, ...]

    @property
    def is_default(self) -> bool:
        """Every entry is the default policy (a table that changes nothing)."""
        return all(p is None or p.is_default for p in self.policies)

    @property
    def expires(self) -> bool:
        """Some entry has a TTL (the expiry pass has work to do)."""
        return any(p is not None and (p.ttl_s is not None or p.ttl_steps is not None)
                   for p in self.policies)

    def to_wire(self) -> dict[str, Any]:
        """The ``policies`` param form (what ``get_config`` answers)."""
        return {"prefix_bits": self.prefix_bits,
                "policies": [None if p is None or p.is_default else p.to_dict()
                             for p in self.policies],
                "names": list(self.names)}

    def name(self, p: int) -> str:
        """The ``slot`` label of entry ``p``."""
        if p == 0 or p >= len(self.policies):
            return "default"
        name = self.names[p] if p < len(self.names) else None
        return name if name is not None else f"p{p}"


def parse_policies(value: Any, field: str = "policies") -> SlotPolicies:
    """Validate a ``policies`` param (see the module docstring); BadInput names the field."""
    if not isinstance(value, Mapping):
        raise BadInput(f"{field} must be a map {{prefix_bits, policies, names?}}, got "
                       f"{type(value).__name__}", field=field)
    unknown = set(value) - {"prefix_bits", "policies", "names"}
    if unknown:
        raise BadInput(f"unknown {field} field(s) {sorted(map(str, unknown))}",
                       field=f"{field}.{sorted(map(str, unknown))[0]}",
                       hint="prefix_bits, policies, names")
    bits = value.get("prefix_bits")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 32:
        raise BadInput(f"{field}.prefix_bits must be an int in [1, 32] (the schema's "
                       f"feature_index_prefix_bit), got {bits!r}", field=f"{field}.prefix_bits",
                       hint="policies need id prefixes: with feature_index_prefix_bit 0 "
                            "only the default policy exists")
    raw = value.get("policies")
    limit = min(1 << bits, MAX_POLICIES)
    if not isinstance(raw, list) or len(raw) > limit:
        raise BadInput(f"{field}.policies must be a list of at most {limit} entries (map or "
                       f"null), got {type(raw).__name__}"
                       f"{f' of {len(raw)}' if isinstance(raw, list) else ''}",
                       field=f"{field}.policies")
    policies = tuple(None if p is None else SlotPolicy.from_dict(p, f"{field}.policies[{i}]")
                     for i, p in enumerate(raw))
    names = value.get("names")
    if names is None:
        names = []
    if not isinstance(names, list) or len(names) > len(policies):
        raise BadInput(f"{field}.names must be a list of at most {len(policies)} entries "
                       f"(one per policy), got {type(names).__name__}", field=f"{field}.names")
    for i, n in enumerate(names):
        if n is not None and not (isinstance(n, str) and _NAME.match(n)):
            raise BadInput(f"{field}.names[{i}] must be null or 1-128 characters of letters, "
                           f"digits and _.:-, got {str(n)[:80]!r}", field=f"{field}.names[{i}]")
    return SlotPolicies(bits, policies, tuple(names) + (None,) * (len(policies) - len(names)))


def apply_policies(store: Any, table: SlotPolicies | None) -> None:
    """``store.set_policies`` with ``table`` (store thread); None: nothing to apply."""
    if table is None:
        return
    store.set_policies(table.prefix_bits, list(table.policies))


def policies_digest_part(table: SlotPolicies | None) -> str | None:
    """``table`` as canonical text for the configuration digest (None: no policies, so a
    server without them has the digest it had before policies existed)."""
    if table is None or table.is_default:
        return None
    return json.dumps(table.to_wire(), sort_keys=True)


class SlotStats(Collector):
    """The per-slot metrics (module docstring), from snapshots taken on the store thread.

    Args:
        table: the policy table in force (its names label the slots), read at each scrape.
    """

    def __init__(self, table: Callable[[], SlotPolicies | None]):
        self._table = table
        self._now: dict[int, dict[str, int]] = {}       # the store's, at the last snapshot
        self._carried: dict[int, dict[str, int]] = {}   # stores swapped out by loads

    def snapshot(self, store: Any) -> None:
        """Read ``store.policy_stats()`` (store thread)."""
        self._now = {int(p): dict(s) for p, s in store.policy_stats().items()}

    def carry(self, old: Any, new: Any) -> None:
        """A load swaps ``old`` for ``new`` (store thread): the counters go on from the old
        store's, less what the new one counted while it was loaded."""
        was, own = old.policy_stats(), new.policy_stats()
        for p in set(was) | set(own):
            acc = self._carried.setdefault(int(p), {})
            for key in _STATS:
                if key != "rows":
                    acc[key] = (acc.get(key, 0) + int(was.get(p, {}).get(key, 0))
                                - int(own.get(p, {}).get(key, 0)))
        self.snapshot(new)

    def values(self) -> dict[str, dict[str, int]]:
        """slot label -> key -> value (counters continuous across loads)."""
        table = self._table()
        out: dict[str, dict[str, int]] = {}
        for p in sorted(set(self._now) | set(self._carried)):
            name = "default" if table is None else table.name(p)
            acc = out.setdefault(name, dict.fromkeys(_STATS, 0))
            for key in _STATS:
                acc[key] += int(self._now.get(p, {}).get(key, 0))
                if key != "rows":
                    acc[key] += int(self._carried.get(p, {}).get(key, 0))
        return out

    def collect(self) -> Iterable[Metric]:
        values = self.values()
        families: dict[str, Any] = {}
        for key, (metric, kind, extra) in _STATS.items():
            name = f"persia_embedding_server_slot_{metric}"
            if name not in families:
                labels = ["slot"] + ([extra[0]] if extra else [])
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                families[name] = cls(name, f"embedding rows per slot: {metric}", labels=labels)
            for slot, v in sorted(values.items()):
                families[name].add_metric([slot] + ([extra[1]] if extra else []), float(v[key]))
        yield from families.values()
