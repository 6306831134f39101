"""What the served model takes, and inference requests arranged to match it by name.

A PERSIA model is called with two positional lists, ``forward(non_id_type_feature_tensors,
id_type_feature_embedding_tensors)``, in the order of the batches it was trained on (the
data loader's order). A request names every feature (JSON object keys, or the names in a
msgpack ``PersiaBatch``), so the API puts them in the model's order whatever order the
request uses, and refuses a name the model does not take or one it lacks. Where the order
comes from:

- **Recorded** (checkpoints written by ``dump_checkpoint``): the manifest's
  ``extra["inputs"]`` holds the ID slots in order and the non-ID features (name, dtype,
  per-sample shape) of the batches the NN workers trained on
  (:func:`stream_persia.nn.batch.input_signature`). A request must carry exactly those
  slots and features (names), each non-ID feature with that per-sample shape.
- **Not recorded** (older checkpoints, or ones written without an NN worker): the ID
  slots go in ``slots_config`` order of the job's embedding config (the order the bundled
  topologies' data loaders use), and a request must carry every slot. Non-ID features
  have no known names or order: a single one is taken whatever its name; two or more are
  refused, since no order can be known for them.

Every refusal is a :class:`BadInput` whose field names the feature at fault:
``id_type_features.<slot>`` or ``non_id_type_features.<name>``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from stream_persia.checkpoint import Manifest
from stream_persia.config import EmbeddingSchema
from stream_persia.core.data import NonIDTypeFeature, PersiaBatch
from stream_persia.core.served import ServedSlot
from stream_persia.errors import BadInput, ConfigError

__all__ = ["ModelInputs", "NonIdInput"]

log = logging.getLogger(__name__)

_F = TypeVar("_F")


@dataclass(frozen=True)
class NonIdInput:
    """One non-ID feature the model was trained with."""

    name: str
    dtype: str | None
    shape: tuple[int, ...]       # per sample (the batch axis left out)


@dataclass(frozen=True)
class ModelInputs:
    """The inputs of the served model, in the order it takes them.

    Attributes:
        id_slots: slot names in order; None when neither a record nor an embedding config
            says (every request is refused then).
        non_id: the non-ID features in order; None when not recorded.
        recorded: whether the order comes from the checkpoint (else from the rule above).
    """

    id_slots: tuple[str, ...] | None
    non_id: tuple[NonIdInput, ...] | None
    recorded: bool

    @classmethod
    def of(cls, manifest: Manifest, schema: EmbeddingSchema | None) -> ModelInputs:
        """The inputs recorded in ``manifest``, else the documented rule over ``schema``."""
        raw = manifest.extra.get("inputs") if isinstance(manifest.extra, dict) else None
        if raw is not None:
            try:
                return cls._parse(raw)
            except (TypeError, ValueError, KeyError) as e:
                log.warning("checkpoint %s: extra.inputs is malformed (%s); slots go in the "
                            "embedding config's order", manifest.path, e)
        return cls(tuple(schema.slots) if schema is not None else None, None, False)

    @classmethod
    def _parse(cls, raw: Any) -> ModelInputs:
        slots = tuple(raw["id_type_features"])
        if not slots or not all(isinstance(s, str) for s in slots) or len(set(slots)) != len(
                slots):
            raise ValueError("id_type_features must be distinct slot names")
        non_id = tuple(NonIdInput(f["name"], f.get("dtype"), tuple(int(d) for d in f["shape"]))
                       for f in raw["non_id_type_features"])
        names = [f.name for f in non_id]
        if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            # Unnamed (or twice-named) features cannot be matched by name: positional rule.
            return cls(slots, None, True)
        return cls(slots, non_id, True)

    def describe(self) -> dict[str, Any]:
        """For ``GET /v1/model``: what a request must carry."""
        return {"id_type_features": list(self.id_slots or []),
                "non_id_type_features": None if self.non_id is None else [
                    {"name": f.name, "dtype": f.dtype, "shape": list(f.shape)}
                    for f in self.non_id],
                "recorded": self.recorded}

    def arrange(self, batch: PersiaBatch) -> PersiaBatch:
        """``batch`` with its features in the model's order (``batch`` itself when they
        already are).

        Raises:
            BadInput: a slot or feature the model does not take, one it lacks, one given
                twice, or a non-ID feature whose per-sample shape differs from training.
        """
        if self.id_slots is None:
            raise ConfigError("the served checkpoint does not record its slot order and the "
                              "API has no embedding config to take it from",
                              field="PERSIA_EMBEDDING_CONFIG",
                              hint="set PERSIA_EMBEDDING_CONFIG, or serve a checkpoint "
                                   "written by dump_checkpoint (it records the order)")
        ids = _by_name(batch.id_type_features, self.id_slots, "id_type_features", "slot")
        non_id: Sequence[NonIDTypeFeature] = batch.non_id_type_features
        if self.non_id is not None:
            non_id = _by_name(non_id, [f.name for f in self.non_id], "non_id_type_features",
                              "non-ID feature")
            for f, want in zip(non_id, self.non_id, strict=True):
                if tuple(f.data.shape[1:]) != want.shape:
                    raise BadInput(f"non_id_type_features.{f.name}: each sample has shape "
                                   f"{tuple(f.data.shape[1:])} but the model was trained "
                                   f"with {want.shape}",
                                   field=f"non_id_type_features.{f.name}",
                                   hint=f"send {want.shape} values per sample")
        elif len(non_id) > 1:
            raise BadInput(f"non_id_type_features: the served checkpoint does not record the "
                           f"order of its non-ID features, so {len(non_id)} of them cannot "
                           f"be matched to the model by name",
                           field="non_id_type_features",
                           hint="serve a checkpoint written by dump_checkpoint (it records "
                                "the names and order the model was trained with)")
        if ids is batch.id_type_features and non_id is batch.non_id_type_features:
            return batch
        return PersiaBatch(list(ids), non_id_type_features=list(non_id), labels=batch.labels,
                           requires_grad=batch.requires_grad, meta=batch.meta)

    def order_embeddings(self, embeddings: Sequence[ServedSlot]) -> Sequence[ServedSlot]:
        """A worker's ``lookup_batch`` embeddings (each with its ``name``) in slot order."""
        names = [e.name for e in embeddings]
        if self.id_slots is None or names == list(self.id_slots):
            return embeddings
        by_name = dict(zip(names, embeddings, strict=True))
        lacking = [s for s in self.id_slots if s not in by_name]
        if lacking:
            raise BadInput(f"embedding worker reply: no embeddings for slot {lacking[0]!r}",
                           field=f"embeddings.{lacking[0]}")
        return [by_name[s] for s in self.id_slots]


def _by_name(features: Sequence[_F], order: Sequence[str], group: str, kind: str
             ) -> Sequence[_F]:
    """``features`` (each with a ``name``) in ``order``; BadInput naming the first name that
    is unknown, missing or given twice."""
    names = [f.name for f in features]   # type: ignore[attr-defined]
    if names == list(order):
        return features
    by_name: dict[str, _F] = {}
    for name, f in zip(names, features, strict=True):
        if name in by_name:
            raise BadInput(f"{group}.{name}: given twice", field=f"{group}.{name}",
                           hint="name each feature once")
        by_name[name] = f
    known = set(order)
    unknown = [n for n in names if n not in known]
    missing = [n for n in order if n not in by_name]
    if not unknown and not missing:
        return [by_name[n] for n in order]
    takes = f"the served model takes: {', '.join(order) or 'none'}"
    if unknown:
        lacks = f"; missing: {', '.join(missing)}" if missing else ""
        raise BadInput(f"{group}.{unknown[0]}: the served model has no {kind} "
                       f"{unknown[0]!r}{lacks}", field=f"{group}.{unknown[0]}", hint=takes)
    raise BadInput(f"{group}.{missing[0]}: missing; the served model takes {kind}(s) "
                   f"{', '.join(missing)} too", field=f"{group}.{missing[0]}", hint=takes)
