"""``PersiaTrainingBatch``: a batch with its embeddings, as the NN worker receives it.

An embedding worker serves a batch (``next_batch`` for training, ``lookup_batch`` for
evaluation and inference) as a wire map (:mod:`stream_persia.core.served`: its schema and
its one decoder); :func:`from_served` turns it into torch tensors on the host. Decoded wire arrays are read-only views of the received frame, and torch
does not support read-only tensors (``torch.from_numpy`` warns, and writing through such
a tensor would write into an immutable ``bytes``), so every array is copied exactly once
here: into ordinary tensors, or into page-locked ones when the NN worker uses CUDA so
that the copy to the device can be asynchronous. The copy also lets the frame be freed.

Embeddings come in two kinds (see :mod:`stream_persia.worker.pooling`):

- **sum** slots: ``emb`` float32 ``(batch, dim)``: the model receives it as is (a leaf
  that requires grad in training).
- **raw** slots (``embedding_summation: false``): ``emb`` float32 ``(n + 1, dim)``, one
  row per distinct id of the batch plus the all-zero padding row 0, ``index`` int64
  ``(batch, sample_fixed_size)`` into it and ``mask`` bool (True where a sample has an id).
  The model receives the gathered ``(batch, sample_fixed_size, dim)`` tensor; the gather
  runs on the NN worker so that the gradient comes back per distinct id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from stream_persia.core.served import ServedBatch
from stream_persia.errors import BadInput

__all__ = ["EmbeddingSlot", "PersiaTrainingBatch", "arrange", "from_served", "input_signature"]


@dataclass(eq=False)
class EmbeddingSlot:
    """One slot's embeddings in a :class:`PersiaTrainingBatch` (host tensors).

    Attributes:
        name: slot name.
        kind: ``"sum"`` or ``"raw"``.
        emb: float32 ``(batch, dim)`` (sum) or ``(n + 1, dim)`` (raw; row 0 is padding).
        index: raw slots: int64 ``(batch, sample_fixed_size)`` rows of ``emb``.
        mask: raw slots: bool ``(batch, sample_fixed_size)``, True where an id is.
    """

    name: str
    kind: str
    emb: torch.Tensor
    index: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def is_raw_embedding(self) -> bool:
        return self.kind == "raw"


@dataclass(eq=False)
class PersiaTrainingBatch:
    """A batch with embeddings, ready for ``ctx.prepare_features`` / ``ctx.forward``.

    Attributes:
        non_id_type_features: host tensors, in the order the data loader added them.
        non_id_type_feature_names: their names (None where unnamed).
        labels: host tensors, or None when the batch carries no labels (inference).
        label_names: their names.
        id_type_feature_embeddings: one :class:`EmbeddingSlot` per slot, in the order of
            the batch's ID type features.
        batch_id: the embedding worker's id for the batch (None for evaluation lookups).
        requires_grad: whether gradients go back for this batch.
        meta: the ``meta`` bytes the data loader attached.
        batch_size: samples in the batch.
        worker_index: which of the context's embedding workers served it.
        missing: evaluation/inference lookups: ids the servers did not hold (zeros).
        event_time: the batch's event time (seconds since the Unix epoch of its newest
            sample: the data loader's, or its clock when the batch was sent), None when
            the batch carries none.
        masks: raw slot name -> bool mask tensor on the device, set by ``prepare_features``.
        event_time: the event time (seconds since the epoch) of the batch's newest sample,
            or None when unknown.
    """

    non_id_type_features: list[torch.Tensor]
    labels: list[torch.Tensor] | None
    id_type_feature_embeddings: list[EmbeddingSlot]
    batch_id: int | None = None
    requires_grad: bool = False
    meta: bytes | None = None
    batch_size: int = 0
    worker_index: int | None = None
    missing: int = 0
    event_time: float | None = None
    non_id_type_feature_names: list[str | None] = field(default_factory=list)
    label_names: list[str | None] = field(default_factory=list)
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    # Set by the data loader for served training batches: the staleness permit.
    ticket: Any = field(default=None, repr=False)
    # Set by prepare_features in training: slot name -> the embedding leaf on the device,
    # the same tensor for every prepare_features of this batch (backward sends its grad).
    leaves: dict[str, torch.Tensor] | None = field(default=None, repr=False)


def _numpy_to_torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def copy_to_tensor(a: np.ndarray, pin: bool = False) -> torch.Tensor:
    """A writable host tensor holding a copy of ``a`` (page-locked when ``pin``)."""
    if pin:
        t = torch.empty(a.shape, dtype=_numpy_to_torch_dtype(a.dtype), pin_memory=True)
        t.numpy()[...] = a
        return t
    return torch.from_numpy(np.array(a, order="C", copy=True))


def from_served(served: ServedBatch | object, worker_index: int | None = None, *,
                pin: bool = False) -> PersiaTrainingBatch:
    """Build a :class:`PersiaTrainingBatch` from an embedding worker's served batch: a
    :class:`~stream_persia.core.served.ServedBatch`, or the map it is decoded from.

    Raises:
        BadInput: the map does not have the documented shape (names the field).
    """
    sb = served if isinstance(served, ServedBatch) else ServedBatch.from_wire(served)
    slots = [EmbeddingSlot(e.name, "sum", copy_to_tensor(e.emb, pin)) if e.index is None
             or e.mask is None else EmbeddingSlot(
                 e.name, "raw", copy_to_tensor(e.emb, pin),
                 copy_to_tensor(e.index.astype(np.int64, copy=False), pin),
                 copy_to_tensor(e.mask, pin))
             for e in sb.embeddings]
    return PersiaTrainingBatch(
        non_id_type_features=[copy_to_tensor(f.data, pin) for f in sb.non_id_type_features],
        non_id_type_feature_names=[f.name for f in sb.non_id_type_features],
        labels=[copy_to_tensor(f.data, pin) for f in sb.labels]
        if sb.labels is not None else None,
        label_names=[f.name for f in sb.labels or ()],
        id_type_feature_embeddings=slots,
        batch_id=sb.batch_id,
        requires_grad=sb.requires_grad,
        meta=sb.meta,
        batch_size=sb.batch_size,
        worker_index=worker_index,
        missing=sb.missing,
        event_time=sb.event_time,
    )


def input_signature(batch: PersiaTrainingBatch) -> dict[str, Any]:
    """What the model receives from ``batch``, in order: its ID slots and its non-ID
    features (name, dtype, per-sample shape). ``dump_checkpoint`` records it in the
    manifest (``extra["inputs"]``) so that the API can match inference requests to the
    model's inputs by name (:mod:`stream_persia.api.inputs`)."""
    return {"id_type_features": [slot.name for slot in batch.id_type_feature_embeddings],
            "non_id_type_features": [
                {"name": name, "dtype": str(t.dtype).removeprefix("torch."),
                 "shape": list(t.shape[1:])}
                for name, t in zip(batch.non_id_type_feature_names or
                                   [None] * len(batch.non_id_type_features),
                                   batch.non_id_type_features, strict=True)]}


def arrange(batch: PersiaTrainingBatch, signature: dict[str, Any],
            label_names: list[str | None] | None = None, *,
            strict_labels: bool = True) -> None:
    """Put ``batch``'s inputs in the order of the batches the model was trained on, in
    place: the model takes positional lists, so a data loader that sends its slots (or
    named non-ID features, or labels) in another order from one batch to the next would
    feed one slot's embeddings where the model learned another's, silently. They are
    matched by name, as the API matches inference requests (:mod:`stream_persia.api.inputs`).

    Args:
        signature: :func:`input_signature` of the first batch trained (or the one a
            restored checkpoint recorded).
        label_names: the label names of the first batch trained (None: not known).
        strict_labels: refuse labels other than those (training). False (evaluation:
            labels never reach the model, only the script's metrics): labels are put in
            that order when the batch has exactly those, and left as they are otherwise
            (a test set with fewer labels, or other ones).

    Raises:
        BadInput: the batch lacks a slot, feature or label the model was trained with, or
            has one it was not, or a non-ID feature whose per-sample shape changed (names
            the field: ``id_type_features.<slot>``, ``non_id_type_features.<name>``, ...).
    """
    emb = batch.id_type_feature_embeddings
    order = _positions("id_type_features", list(signature.get("id_type_features") or []),
                       [slot.name for slot in emb])
    if order is not None:
        batch.id_type_feature_embeddings = [emb[i] for i in order]
    non_id = [f.get("name") if isinstance(f, dict) else None
              for f in signature.get("non_id_type_features") or []]
    names = batch.non_id_type_feature_names or [None] * len(batch.non_id_type_features)
    order = _positions("non_id_type_features", non_id, list(names))
    if order is not None:
        batch.non_id_type_features = [batch.non_id_type_features[i] for i in order]
        batch.non_id_type_feature_names = [names[i] for i in order]
    _check_widths(signature.get("non_id_type_features") or [], batch)
    same_labels = batch.labels is not None and \
        sorted(map(str, batch.label_names)) == sorted(map(str, label_names or []))
    if label_names is not None and batch.labels is not None and (strict_labels or same_labels):
        order = _positions("labels", label_names, list(batch.label_names))
        if order is not None:
            batch.labels = [batch.labels[i] for i in order]
            batch.label_names = [batch.label_names[i] for i in order]


def _check_widths(want: list[Any], batch: PersiaTrainingBatch) -> None:
    """Each non-ID feature must keep the per-sample shape it was first trained with: the
    model concatenates them (or slices their columns), so a loader whose 'age' grew a
    column while 'income' lost one keeps the total width and would feed every column after
    'age' one place off, silently. A dtype change is let through: a model that casts
    (``t.float()``) reads the same values, and one that does not fails loudly in torch."""
    names = batch.non_id_type_feature_names or [None] * len(batch.non_id_type_features)
    for i, (spec, t) in enumerate(zip(want, batch.non_id_type_features, strict=False)):
        shape = spec.get("shape") if isinstance(spec, dict) else None
        if not isinstance(shape, list) or list(t.shape[1:]) == shape:
            continue
        name = names[i] if i < len(names) and names[i] is not None else str(i)
        raise BadInput(
            f"non_id_type_features: {name!r} has per-sample shape {list(t.shape[1:])} in "
            f"this batch, but the model was trained on batches where it had {list(shape)}",
            field=f"non_id_type_features.{name}",
            hint="every batch of a job must carry each feature with the same width (the "
                 "model reads its columns by position); fix the data loader")


def _positions(what: str, want: list[str | None], have: list[str | None]) -> list[int] | None:
    """Where each of ``want`` is in ``have`` (None: already in order). Names that are not
    distinct strings in ``want`` cannot be matched: then ``have`` must hold the same names
    in the same order (anonymous features stay positional)."""
    if have == want:
        return None
    distinct = all(isinstance(n, str) for n in want) and len(set(want)) == len(want)
    missing = [n for n in want if n not in have]
    unknown = [n for n in have if n not in want]
    if missing or unknown or not distinct or len(have) != len(want):
        name = (missing or unknown or [None])[0]
        raise BadInput(
            f"{what}: this batch has {have}, but the model was trained on batches with "
            f"{want}" + (f": missing {missing}" if missing else "")
            + (f", unknown {unknown}" if unknown else "")
            + ("" if missing or unknown else " (a name twice)" if distinct else
               " (names that are not distinct cannot be matched, so their order must not "
               "change)"),
            field=f"{what}.{name}" if name is not None else what,
            hint="every batch of a job must carry the same features (the model takes them "
                 "as positional lists); fix the data loader")
    where = {n: i for i, n in enumerate(have)}
    return [where[n] for n in want]
