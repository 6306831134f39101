"""The NN contexts as the modules around them see them: two small typed interfaces.

Checkpoints (:mod:`~stream_persia.nn.checkpointing`), the checkpoint mailbox's poller
(:mod:`~stream_persia.nn.checkpoint_poller`) and the DataLoader (:mod:`~stream_persia.nn.
data`) work on a context that the contexts themselves hand them. They depend on these
Protocols, not on :mod:`~stream_persia.nn.embedding_ctx` or :mod:`~stream_persia.nn.
train_ctx`, which import them: the imports go one way (``train_ctx`` → ``checkpoint_poller``
→ ``checkpointing`` → ``seams``), and the type checker holds the contexts to the members
listed here.

- :class:`ContextSeam`: any entered context (``EmbeddingCtx``, ``eval_ctx()``,
  ``InferCtx``, ``TrainCtx``).
- :class:`TrainerSeam`: a ``TrainCtx``, as :meth:`ContextSeam.as_trainer` returns it:
  how checkpoints and the DataLoader tell training from evaluation without an
  ``isinstance`` on a class they may not import.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from stream_persia.nn.batch import PersiaTrainingBatch
from stream_persia.nn.cluster import Cluster
from stream_persia.nn.loader import StreamPrefetcher
from stream_persia.nn.progressive import ProgressiveValidation

__all__ = ["ContextSeam", "TrainerSeam"]


class ContextSeam(Protocol):
    """Any entered context: its connections and its model."""

    #: the model as the context runs it (DDP-wrapped in a TrainCtx with several ranks)
    model: torch.nn.Module | None
    #: the model's inputs as trained (:func:`~stream_persia.nn.batch.input_signature`):
    #: the first batch a TrainCtx trained, or a restored checkpoint's; batches are
    #: arranged to it (None: not known)
    input_signature: dict[str, Any] | None
    #: the label names it was trained with, in order (None: not known)
    label_names: list[str | None] | None

    def require_cluster(self) -> Cluster:
        """The context's RPC clients and loop thread; ``Misuse`` if not entered."""
        ...

    def as_trainer(self) -> TrainerSeam | None:
        """This context as a trainer (a ``TrainCtx``), or None (evaluation, inference)."""
        ...


class TrainerSeam(ContextSeam, Protocol):
    """A ``TrainCtx``, as checkpoints, the checkpoint poller and the DataLoader use it."""

    rank: int
    world_size: int
    #: training steps taken (restored from a checkpoint's manifest)
    steps: int
    device: torch.device
    #: the RPC clients while entered, else None
    cluster: Cluster | None
    #: the dense model itself (``model`` may be its DDP wrapper)
    raw_model: torch.nn.Module
    dense_optimizer: torch.optim.Optimizer
    grad_scaler: torch.amp.GradScaler | None
    #: the newest event time of a batch this rank ran a backward on (None: none yet)
    trained_through: float | None
    #: this rank's progressive validation (None: off)
    progressive_validation: ProgressiveValidation | None

    # ---- checkpoints: the cut
    def barrier(self) -> None:
        """Wait for every NN rank."""
        ...

    def quiesce(self, *, strict: bool = True, timeout_s: float | None = None
                ) -> list[StreamPrefetcher]:
        """Stop prefetching, hand untrained batches back, wait for every pending push;
        returns the prefetchers that were running (for :meth:`resume_prefetchers`)."""
        ...

    def resume_prefetchers(self, prefetchers: list[StreamPrefetcher]) -> None:
        """Start the prefetchers that :meth:`quiesce` stopped again."""
        ...

    def drop_kept(self, why: str) -> None:
        """Forget what the prefetchers kept at a pause (stale after ``why``: a restore)."""
        ...

    # ---- the DataLoader's training stream
    def register_prefetcher(self, prefetcher: StreamPrefetcher) -> None:
        ...

    def release_untrained(self, batch: PersiaTrainingBatch) -> None:
        ...

    def all_ranks_agree(self, flag: bool) -> bool:
        """True only when ``flag`` is True on every rank."""
        ...

    def stream_ended(self) -> None:
        """Every rank agreed that the stream ran dry (serves a pending HTTP checkpoint)."""
        ...

    def stream_idle(self) -> None:
        """The DataLoader waited a poll slice without a batch (a paused or slow stream):
        publish what training holds if not yet (the dense model to serving replicas) and,
        with one rank, take a checkpoint requested over HTTP."""
        ...

    def raise_async_errors(self) -> None:
        """Raise the first error of an asynchronous gradient push, if any."""
        ...
