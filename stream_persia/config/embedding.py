"""``embedding_config.yml``: the slots (ID features), their embedding layout and id spaces.

PERSIA's keys and defaults::

    feature_index_prefix_bit: 8          # top bits of every id that name its feature group
    slots_config:                        # PERSIA's docs also spell it slot_config / slot_configs
      user_id:
        dim: 16                          # required
        sample_fixed_size: 10            # rows kept per sample when embedding_summation: false
        embedding_summation: true        # sum the sample's rows into one vector
        sqrt_scaling: false              # ... and divide the sum by sqrt(number of ids)
        hash_stack_config: {hash_stack_rounds: 0, embedding_size: 0}
    feature_groups:                      # slots in one group share one id space
      group1: [user_id, item_id]

stream-persia's per-slot table policies (issue 20; :class:`~stream_persia.core.
embedding_config.SlotPolicy`, enforced by the embedding servers' stores), all optional::

    slots_config:
      user_id:
        admit_probability: null          # PERSIA's admission draw for this slot (null: the
                                         # EmbeddingConfig's)
        min_count: 1                     # a row only at the k-th training lookup (1: off)
        ttl_s: null                      # rows unseen in training this long expire
        ttl_steps: null                  # ... or for this many training lookup calls
        max_rows: null                   # the most rows of the slot's group (LRU beyond)
        dtype: float32                   # float16 / bfloat16: compact row weights

A policy is per feature group (slots of one group share one id space and must agree) and
needs ``feature_index_prefix_bit > 0`` (the store tells an id's group from its prefix).
:meth:`EmbeddingSchema.policies` gives them indexed as the store's ``set_policies`` wants,
:meth:`EmbeddingSchema.policy_params` as the servers' ``configure`` RPC takes them.

**Id prefixes** (PERSIA's formula, kept bit for bit so ids match a PERSIA job's):
with ``b = feature_index_prefix_bit > 0``, an id of a slot in group ``g`` is stored as
``id % (2**(64-b) - 1) + ((g + 1) << (64 - b))`` (:mod:`stream_persia.kernels.ids` computes
both). Group indices follow PERSIA: first the
groups listed under ``feature_groups`` in file order, then every slot not in a group as a
group of its own, in ``slots_config`` order. So reordering ``slots_config`` or
``feature_groups`` changes the ids of existing embeddings (the config digest changes with
it). ``b = 0`` turns prefixing off: ids are stored as given and slots share one id space.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from stream_persia.config._base import (
    at_source,
    build,
    canonical_digest,
    check_bool,
    check_instance,
    check_int,
    check_no_unknown,
    check_str,
    describe,
    did_you_mean,
    error,
)
from stream_persia.core.embedding_config import SlotPolicy
from stream_persia.errors import BadInput, ConfigError
from stream_persia.kernels.ids import MAX_PREFIX_BIT, index_prefix, prefix_ids

__all__ = ["HashStackConfig", "SlotConfig", "EmbeddingSchema", "MAX_PREFIX_BIT"]

_MAX_DIM = 1 << 16
_MAX_SAMPLE_FIXED_SIZE = 1 << 20
_U64_MAX = (1 << 64) - 1


@dataclass(frozen=True)
class HashStackConfig:
    """PERSIA's hash stack: each id becomes ``hash_stack_rounds`` ids in
    ``[0, embedding_size)`` whose rows are summed, to bound a huge vocabulary's memory.

    Both zero (the default) turns it off.
    """

    hash_stack_rounds: int = 0
    embedding_size: int = 0

    def __post_init__(self) -> None:
        check_int(self, "hash_stack_rounds", lo=0, hi=64)
        check_int(self, "embedding_size", lo=0, hi=_U64_MAX >> 1)
        if self.hash_stack_rounds > 0 and self.embedding_size == 0:
            raise error("embedding_size", f"must be > 0 when hash_stack_rounds is "
                        f"{self.hash_stack_rounds}, got 0",
                        "set embedding_size to the hashed vocabulary size, or "
                        "hash_stack_rounds to 0 to turn hash stacking off")
        if self.embedding_size > 0 and self.hash_stack_rounds == 0:
            raise error("hash_stack_rounds", f"is 0, so embedding_size "
                        f"{self.embedding_size} has no effect",
                        "set hash_stack_rounds >= 1, or embedding_size to 0")

    @property
    def enabled(self) -> bool:
        return self.hash_stack_rounds > 0

    def to_dict(self) -> dict[str, Any]:
        return {"hash_stack_rounds": self.hash_stack_rounds,
                "embedding_size": self.embedding_size}


@dataclass(frozen=True)
class SlotConfig:
    """One slot (ID feature) of ``slots_config``.

    ``index_prefix`` is computed by :class:`EmbeddingSchema` from the feature groups
    (PERSIA refuses it in files too); a value given by hand is replaced there. ``policy``
    is the slot's :class:`SlotPolicy`, whose keys the file gives flat in the slot's entry
    (``_FLAT``: the loader gathers them).
    """

    name: str
    dim: int
    sample_fixed_size: int = 10
    embedding_summation: bool = True
    sqrt_scaling: bool = False
    hash_stack_config: HashStackConfig = field(default_factory=HashStackConfig)
    index_prefix: int = 0
    # The slot's table policy; its keys stand flat in the slot's entry (module docstring).
    policy: SlotPolicy = field(default_factory=SlotPolicy)

    _FLAT: ClassVar[dict[str, type]] = {"policy": SlotPolicy}
    _NESTED: ClassVar[dict[str, type]] = {"hash_stack_config": HashStackConfig}
    _REJECTED: ClassVar[dict[str, str]] = {
        "index_prefix": "it is computed from feature_groups (PERSIA refuses it too): remove it",
        "name": "the slot's name is its key under slots_config: remove it",
        "capacity": "PERSIA ignored a per-slot capacity; the LRU capacity is per embedding "
                    "server: set embedding_parameter_server_config.capacity in "
                    "global_config.yml, or cap this slot's group with max_rows here",
    }

    def __post_init__(self) -> None:
        check_str(self, "name")
        check_int(self, "dim", lo=1, hi=_MAX_DIM)
        check_int(self, "sample_fixed_size", lo=1, hi=_MAX_SAMPLE_FIXED_SIZE)
        check_bool(self, "embedding_summation")
        check_bool(self, "sqrt_scaling")
        if self.hash_stack_config is None:
            object.__setattr__(self, "hash_stack_config", HashStackConfig())
        check_instance(self, "hash_stack_config", HashStackConfig)
        check_int(self, "index_prefix", lo=0, hi=_U64_MAX)
        if isinstance(self.policy, Mapping):   # its keys, as build() gathered them
            try:
                object.__setattr__(self, "policy", SlotPolicy(**self.policy))
            except BadInput as e:
                raise error(e.field or "policy", e.message.removeprefix(f"{e.field} "),
                            e.hint) from None
        check_instance(self, "policy", SlotPolicy)

    def to_dict(self) -> dict[str, Any]:
        """The slot's entry under ``slots_config`` (without name and computed prefix).
        Policy keys appear only where they differ from the default, so that the digest of a
        config without policies (PERSIA's files) is what it was before they existed."""
        default = SlotPolicy().to_dict()
        return {"dim": self.dim, "sample_fixed_size": self.sample_fixed_size,
                "embedding_summation": self.embedding_summation,
                "sqrt_scaling": self.sqrt_scaling,
                "hash_stack_config": self.hash_stack_config.to_dict(),
                **{k: v for k, v in self.policy.to_dict().items() if v != default[k]}}


@dataclass(frozen=True)
class EmbeddingSchema:
    """The parsed ``embedding_config.yml``: every slot with its computed ``index_prefix``.

    Args:
        feature_index_prefix_bit: top bits of an id that name its feature group, 0..32;
            0 turns prefixing off.
        slots: slot name → :class:`SlotConfig`, in config order (the order matters: see the
            module docstring).
        feature_groups: group name → slot names sharing one id space, in config order.
    """

    feature_index_prefix_bit: int = 8
    slots: dict[str, SlotConfig] = field(default_factory=dict)
    feature_groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    if TYPE_CHECKING:   # set by __post_init__, not fields: each slot's group, each group's index
        _group_of: dict[str, str] = field(init=False, repr=False, compare=False)
        _group_index: dict[str, int] = field(init=False, repr=False, compare=False)

    _SLOTS_KEYS: ClassVar[tuple[str, ...]] = ("slots_config", "slot_config", "slot_configs")

    def __post_init__(self) -> None:
        check_int(self, "feature_index_prefix_bit", lo=0, hi=MAX_PREFIX_BIT,
                  hint="PERSIA's default is 8; 0 turns id prefixing off")
        slots = self._check_slots(self.slots)
        groups = self._check_groups(self.feature_groups, slots)
        # PERSIA's order: declared groups first, then each ungrouped slot on its own.
        group_of = {s: g for g, members in groups.items() for s in members}
        group_names = list(groups)
        for name in slots:
            if name not in group_of:
                if name in groups:
                    raise error(f"feature_groups.{name}", f"group name {name!r} is also the "
                                "name of a slot that is in no group (PERSIA refuses this too)",
                                f"rename the group, or add slot {name!r} to it")
                group_of[name] = name
                group_names.append(name)
        b = self.feature_index_prefix_bit
        if b > 0 and len(group_names) > (1 << b) - 1:
            need = len(group_names).bit_length()
            raise error("feature_index_prefix_bit", f"{b} bits name at most {(1 << b) - 1} "
                        f"feature groups, but the config has {len(group_names)} (explicit "
                        "groups plus one per ungrouped slot)",
                        f"set feature_index_prefix_bit to at least {need}, or put slots "
                        "into feature_groups")
        index = {g: i for i, g in enumerate(group_names)}
        self._check_policies(slots, group_of, b)
        final: dict[str, SlotConfig] = {}
        for name, slot in slots.items():
            # Always recomputed (a given index_prefix is ignored), so that
            # dataclasses.replace(schema, feature_index_prefix_bit=...) stays consistent.
            final[name] = dataclasses.replace(
                slot, index_prefix=index_prefix(index[group_of[name]], b))
        object.__setattr__(self, "slots", final)
        object.__setattr__(self, "feature_groups", groups)
        object.__setattr__(self, "_group_of", group_of)
        object.__setattr__(self, "_group_index", index)

    @staticmethod
    def _check_slots(slots: Any) -> dict[str, SlotConfig]:
        if not isinstance(slots, Mapping):
            raise error("slots", f"expected a mapping of slot name to SlotConfig, got "
                        f"{describe(slots)}")
        out: dict[str, SlotConfig] = {}
        for name, slot in slots.items():
            if not isinstance(name, str) or not name.strip():
                raise error("slots", f"slot names must be non-empty strings, got "
                            f"{describe(name)}")
            if isinstance(slot, Mapping):
                slot = build(SlotConfig, slot, f"slots.{name}", name=name)
            if not isinstance(slot, SlotConfig):
                raise error(f"slots.{name}", f"expected a SlotConfig, got {describe(slot)}")
            if slot.name != name:
                raise error(f"slots.{name}.name", f"is {slot.name!r} but the slot is "
                            f"listed as {name!r}", "use the same name for both")
            out[name] = slot
        return out

    @staticmethod
    def _check_policies(slots: Mapping[str, SlotConfig], group_of: Mapping[str, str],
                        b: int) -> None:
        """Slots of one group agree on their policy; a policy needs id prefixes."""
        first: dict[str, str] = {}   # group -> its first slot
        for name, slot in slots.items():
            policy = slot.policy
            if b == 0 and not policy.is_default:
                key = next(k for k, v in policy.to_dict().items()
                           if v != SlotPolicy().to_dict()[k])
                raise error(f"slots_config.{name}.{key}", "sets a table policy, but "
                            "feature_index_prefix_bit is 0, so the embedding servers cannot "
                            "tell this slot's ids from the others'",
                            "set feature_index_prefix_bit > 0 (PERSIA's default is 8), or "
                            "remove the key")
            group = group_of[name]
            other = first.setdefault(group, name)
            if other != name and slots[other].policy != policy:
                theirs, ours = slots[other].policy.to_dict(), policy.to_dict()
                key = next(k for k in ours if ours[k] != theirs[k])
                raise error(f"slots_config.{name}.{key}", f"is {ours[key]!r} but slot "
                            f"{other!r} of the same feature group {group!r} has "
                            f"{theirs[key]!r}: slots of one group share one id space and "
                            "one policy", f"give every slot of group {group!r} the same "
                            f"{key}")

    @staticmethod
    def _check_groups(groups: Any, slots: Mapping[str, SlotConfig]) -> dict[str, tuple]:
        if groups is None:
            return {}
        if not isinstance(groups, Mapping):
            raise error("feature_groups", f"expected a mapping of group name to a list of "
                        f"slot names, got {describe(groups)}")
        out: dict[str, tuple[str, ...]] = {}
        owner: dict[str, str] = {}
        for group, members in groups.items():
            where = f"feature_groups.{group}"
            if not isinstance(group, str) or not group.strip():
                raise error("feature_groups", f"group names must be non-empty strings, got "
                            f"{describe(group)}")
            if isinstance(members, (str, bytes)) or not isinstance(members, Sequence):
                raise error(where, f"expected a list of slot names, got {describe(members)}",
                            f"write it as [{members}]" if isinstance(members, str) else None)
            if not members:
                raise error(where, "is empty", "list at least one slot, or remove the group")
            for slot in members:
                if not isinstance(slot, str) or slot not in slots:
                    hint = did_you_mean(slot, slots) or ""
                    raise error(where, f"names {describe(slot)}, which is not in slots_config",
                                (hint + " " if hint else "") + "define the slot under "
                                "slots_config or remove it from the group")
                if slot in owner:
                    where_first = "this group" if owner[slot] == group else \
                        f"group {owner[slot]!r}"
                    raise error(where, f"slot {slot!r} is already in {where_first}",
                                "a slot belongs to at most one feature group")
                owner[slot] = group
            out[group] = tuple(members)
        return out

    # ---- queries

    def slot(self, name: str) -> SlotConfig:
        """The :class:`SlotConfig` of ``name``; :class:`BadInput` naming an unknown slot."""
        try:
            return self.slots[name]
        except (KeyError, TypeError):
            pass
        known = list(self.slots)
        shown = ", ".join(known[:20]) + (f", ... ({len(known)} in all)" if len(known) > 20
                                         else "")
        hint = did_you_mean(name, known)
        raise BadInput(f"unknown slot {name!r}: it is not in embedding_config.yml's "
                       f"slots_config (slots: {shown or 'none'})", field=str(name),
                       hint=hint or "add it to slots_config or fix the feature's name")

    def group_of(self, slot_name: str) -> str:
        """Name of the feature group of a slot (the slot's own name when ungrouped)."""
        self.slot(slot_name)
        return self._group_of[slot_name]

    def group_index(self, slot_name: str) -> int:
        """0-based index of the slot's feature group (``index_prefix = (i + 1) << (64-b)``)."""
        return self._group_index[self.group_of(slot_name)]

    @property
    def group_names(self) -> tuple[str, ...]:
        """Every feature group in index order (explicit groups, then ungrouped slots)."""
        return tuple(self._group_index)

    def policies(self) -> list[SlotPolicy | None]:
        """Every feature group's policy indexed as the store's ``set_policies`` wants:
        entry ``g + 1`` is group ``g``'s (None: the default), entry 0 (ids of no group) is
        None. Empty when ``feature_index_prefix_bit`` is 0 (no prefixes: only the default
        policy exists)."""
        if self.feature_index_prefix_bit == 0:
            return []
        out: list[SlotPolicy | None] = [None] * (len(self._group_index) + 1)
        for name, slot in self.slots.items():
            policy = slot.policy
            out[self._group_index[self._group_of[name]] + 1] = (
                None if policy.is_default else policy)
        return out

    def policy_params(self) -> dict[str, Any] | None:
        """The ``policies`` param of the embedding servers' ``configure`` RPC:
        ``{"prefix_bits", "policies": [dict | None], "names": [group name | None]}``, or
        None when every group has the default policy (nothing to send)."""
        policies = self.policies()
        if all(p is None for p in policies):
            return None
        names: list[str | None] = [None, *self._group_index]
        return {"prefix_bits": self.feature_index_prefix_bit,
                "policies": [None if p is None else p.to_dict() for p in policies],
                "names": names}

    def prefix_ids(self, slot_name: str, ids: np.ndarray) -> np.ndarray:
        """Map a slot's raw uint64 ids into its group's id space (vectorised, see module
        docstring). With ``feature_index_prefix_bit == 0`` the ids come back unchanged."""
        slot = self.slot(slot_name)
        return prefix_ids(ids, index_prefix=slot.index_prefix,
                          prefix_bits=self.feature_index_prefix_bit)

    # ---- (de)serialisation

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>") -> EmbeddingSchema:
        """Build from a parsed ``embedding_config.yml`` mapping; errors name ``source``."""
        try:
            return cls._from_dict(d)
        except ConfigError as err:
            raise at_source(err, source) from None

    @classmethod
    def _from_dict(cls, d: Any) -> EmbeddingSchema:
        if not isinstance(d, Mapping):
            raise error("<top level>", f"expected a mapping, got {describe(d)}")
        aliases = {k: "slots_config" for k in cls._SLOTS_KEYS[1:]}
        check_no_unknown(d, ("feature_index_prefix_bit", "slots_config", "feature_groups"),
                         "", aliases=aliases)
        given = [k for k in cls._SLOTS_KEYS if k in d]
        if not given:
            raise error("slots_config", "required key is missing (it has no default)",
                        "list the ID features: slots_config: {user_id: {dim: 8}}")
        if len(given) > 1:
            raise error(given[1], f"is given together with {given[0]!r} (two spellings of "
                        "slots_config)", "keep only slots_config")
        key = given[0]
        raw_slots = d[key]
        if raw_slots is None:
            raw_slots = {}
        if not isinstance(raw_slots, Mapping):
            raise error(key, f"expected a mapping of slot name to settings, got "
                        f"{describe(raw_slots)}")
        slots: dict[str, SlotConfig] = {}
        for name, raw in raw_slots.items():
            if not isinstance(name, str) or not name.strip():
                raise error(f"{key}.{name}", f"slot names must be non-empty strings, got "
                            f"{describe(name)}", "quote the name in YAML")
            slots[name] = build(SlotConfig, raw, f"{key}.{name}", name=name)
        kwargs: dict[str, Any] = {"slots": slots, "feature_groups": d.get("feature_groups")}
        if "feature_index_prefix_bit" in d:
            kwargs["feature_index_prefix_bit"] = d["feature_index_prefix_bit"]
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The ``embedding_config.yml`` mapping (PERSIA's spelling); round-trips."""
        return {"feature_index_prefix_bit": self.feature_index_prefix_bit,
                "slots_config": {n: s.to_dict() for n, s in self.slots.items()},
                "feature_groups": {g: list(m) for g, m in self.feature_groups.items()}}

    def digest(self) -> str:
        """Hex SHA-256 of the canonical JSON of :meth:`to_dict` without the table policies
        (stored in checkpoints, which a restore checks). Policies decide which rows are
        kept, not which row an id is or what it means, so a job that changes a TTL or a
        row cap still restores its checkpoints; the embedding servers' configuration
        digest (``get_config``) covers them."""
        d = self.to_dict()
        for slot in d["slots_config"].values():
            for key in SlotPolicy().to_dict():
                slot.pop(key, None)
        return canonical_digest(d)
