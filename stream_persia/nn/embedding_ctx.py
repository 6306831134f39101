"""``EmbeddingCtx``, ``eval_ctx`` and ``InferCtx``: embeddings for evaluation and inference.

These are PERSIA's contexts (``persia.ctx``) on stream-persia's runtime. A context owns
one loop thread and the RPC clients of the job's roles (:class:`~stream_persia.nn.
cluster.Cluster`); entering it connects and waits (bounded) until every role answers.

What the model receives (``forward(non_id_type_feature_tensors,
id_type_feature_embedding_tensors)``, PERSIA's signature), slot by slot in the batch's
ID-feature order. In a ``TrainCtx`` that order (and the non-ID features' and labels')
is the one of the first batch trained, or of the restored checkpoint (in any context
that restored one: an ``eval_ctx`` evaluating a checkpoint too): later batches are
arranged by name to match it, and one with another set of slots, named features or
labels, or a non-ID feature whose per-sample shape changed, is refused (``BadInput``
naming it), since the model takes positional lists and would read one slot's embeddings
(or one feature's columns) as another's:

- a summation slot: float32 ``(batch, dim)``;
- a raw slot (``embedding_summation: false``): float32 ``(batch, sample_fixed_size,
  dim)``, the sample's first ids' rows with zero rows where it has fewer ids. Its bool
  mask ``(batch, sample_fixed_size)`` is attached to the tensor as ``tensor.mask`` and is
  also in ``training_batch.masks[slot_name]``.
"""

from __future__ import annotations

import concurrent.futures
import enum
import itertools
import logging
import threading
from typing import Any

import torch

from stream_persia.core.data import PersiaBatch
from stream_persia.core.embedding_config import EmbeddingConfig
from stream_persia.errors import BadInput, InternalError, Misuse
from stream_persia.nn import checkpointing
from stream_persia.nn.batch import PersiaTrainingBatch, arrange, from_served
from stream_persia.nn.cluster import Cluster
from stream_persia.nn.seams import TrainerSeam

__all__ = ["EmbeddingCtx", "InferCtx", "PreprocessMode", "current_ctx", "eval_ctx"]

log = logging.getLogger(__name__)

_CTX_STACK: list[EmbeddingCtx] = []
_CTX_LOCK = threading.Lock()


def current_ctx() -> EmbeddingCtx:
    """The innermost context entered in this process (PERSIA's ``cnt_ctx``).

    Raises:
        Misuse: no context is active.
    """
    with _CTX_LOCK:
        if not _CTX_STACK:
            raise Misuse("no stream-persia context is active",
                         hint="create the DataLoader and iterate it inside "
                              "`with TrainCtx(...)` or `with eval_ctx(...)`")
        return _CTX_STACK[-1]


class PreprocessMode(enum.Enum):
    """How ``prepare_features`` builds tensors (PERSIA's values).

    TRAIN: embedding tensors require grad. EVAL: they do not. INFERENCE: as EVAL, and
    batches may come without labels.
    """

    TRAIN = 1
    EVAL = 2
    INFERENCE = 3


class EmbeddingCtx:
    """Embedding lookups and the model's forward for evaluation and inference.

    Args:
        preprocess_mode: :class:`PreprocessMode`.
        model: the dense ``torch.nn.Module`` (``forward(non_id_type_feature_tensors,
            id_type_feature_embedding_tensors)``).
        embedding_config: sent to every embedding server on enter when given.
        threadpool_worker_size: PERSIA's RPC thread pool size; accepted for compatibility
            (RPC here runs on one event loop thread).
        device_id: CUDA device for tensors and model; None: host memory.
        embedding_workers: ``host:port`` of every embedding worker (default: env
            ``PERSIA_EMBEDDING_WORKERS``).
        ready_timeout_s: how long entering waits for every role to answer.
        rpc_timeout_ms: default timeout of one RPC.
    """

    _need_servers = True

    def __init__(self, preprocess_mode: PreprocessMode, model: torch.nn.Module | None = None,
                 embedding_config: EmbeddingConfig | None = None, *,
                 threadpool_worker_size: int = 10, device_id: int | None = None,
                 embedding_workers: list[str] | None = None, ready_timeout_s: float = 300.0,
                 rpc_timeout_ms: float = 30_000):
        if not isinstance(preprocess_mode, PreprocessMode):
            raise Misuse(f"preprocess_mode must be a PreprocessMode, got {preprocess_mode!r}",
                         field="preprocess_mode")
        if embedding_config is not None and not isinstance(embedding_config, EmbeddingConfig):
            raise Misuse(f"embedding_config must be an EmbeddingConfig, got "
                         f"{type(embedding_config).__name__}", field="embedding_config")
        if device_id is not None and not (isinstance(device_id, int) and device_id >= 0):
            raise Misuse(f"device_id must be a CUDA device index or None, got {device_id!r}",
                         field="device_id")
        self.preprocess_mode = preprocess_mode
        self.model = model
        self.embedding_config = embedding_config
        self.threadpool_worker_size = threadpool_worker_size
        self.device_id = device_id
        self.device = torch.device("cpu") if device_id is None else torch.device(
            "cuda", device_id)
        self._worker_addresses = embedding_workers
        self._ready_timeout_s = ready_timeout_s
        self._rpc_timeout_ms = rpc_timeout_ms
        self.cluster: Cluster | None = None
        self._lookup_rr = itertools.count()
        self._dump_future: concurrent.futures.Future | None = None
        #: the inputs the model was trained with (:func:`~stream_persia.nn.batch.
        #: input_signature`): a restored checkpoint's (a TrainCtx: else its first
        #: batch's); batches are arranged to them. None: taken as they come.
        self.input_signature: dict[str, Any] | None = None
        #: the label names it was trained with, in order (None: not known)
        self.label_names: list[str | None] | None = None
        self._load_future: concurrent.futures.Future | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> EmbeddingCtx:
        self._enter()
        with _CTX_LOCK:
            _CTX_STACK.append(self)
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        with _CTX_LOCK:
            if self in _CTX_STACK:
                _CTX_STACK.remove(self)
        self._exit(exc_type is None)

    def _enter(self) -> None:
        if self.cluster is not None:
            raise Misuse(f"{type(self).__name__} entered twice")
        if self.device_id is not None and not torch.cuda.is_available():
            raise Misuse(f"device_id={self.device_id} but CUDA is not available",
                         field="device_id", hint="pass device_id=None to run on the CPU")
        self.cluster = Cluster(self._worker_addresses, rpc_timeout_ms=self._rpc_timeout_ms,
                               ready_timeout_s=self._ready_timeout_s,
                               name=f"{type(self).__name__.lower()}-rpc")
        try:
            self.cluster.start(need_servers=self._need_servers)
            self._configure_servers()
        except BaseException:
            self.cluster.close()
            self.cluster = None
            raise

    def _configure_servers(self) -> None:
        if self.embedding_config is not None and self._need_servers:
            self.configure_embedding_parameter_servers(self.embedding_config)

    def _exit(self, clean: bool) -> None:
        cluster, self.cluster = self.cluster, None
        if cluster is not None:
            cluster.close()

    def require_cluster(self) -> Cluster:
        """The context's RPC clients and loop thread (:class:`~stream_persia.nn.cluster.
        Cluster`).

        Raises:
            Misuse: the context is not entered.
        """
        if self.cluster is None:
            raise Misuse(f"{type(self).__name__} is not entered",
                         hint=f"use `with {type(self).__name__}(...) as ctx:`")
        return self.cluster

    @property
    def is_training(self) -> bool:
        return self.preprocess_mode is PreprocessMode.TRAIN

    def as_trainer(self) -> TrainerSeam | None:
        """This context as a trainer (a ``TrainCtx``), or None: how checkpoints and the
        DataLoader tell training from evaluation (:mod:`stream_persia.nn.seams`)."""
        return None

    # ------------------------------------------------------------------ features
    def prepare_features(self, persia_training_batch: PersiaTrainingBatch
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                    list[torch.Tensor] | None]:
        """Tensors on the context's device: ``(non_id_type_feature_tensors,
        id_type_feature_embedding_tensors, label_tensors)``.

        In TRAIN mode (and for batches that require grad) the embedding tensors are
        leaves that require grad, the same ones each time the batch is prepared (a
        forward twice, a ``prepare_features`` after ``forward``); their gradients, summed
        over every use, are what ``backward`` sends back.

        Raises:
            BadInput: an EVAL batch without labels (INFERENCE allows none); once the
                model's inputs are known (a ``TrainCtx`` after its first batch, or any
                context after ``load_checkpoint``), a batch that lacks a slot or named
                feature of the batches trained, or has one they had not, or a non-ID
                feature of another per-sample width (names the field); in a
                ``TrainCtx``, the same for labels.
        """
        batch = persia_training_batch
        if not isinstance(batch, PersiaTrainingBatch):
            raise BadInput(f"expected a PersiaTrainingBatch, got {type(batch).__name__}",
                           field="persia_training_batch")
        self._arrange(batch)
        dev = self.device
        non_blocking = dev.type == "cuda"
        non_id = [t.to(dev, non_blocking=non_blocking) for t in batch.non_id_type_features]
        if batch.labels is None:
            if self.preprocess_mode is not PreprocessMode.INFERENCE:
                raise BadInput("the batch has no labels; only INFERENCE mode accepts that",
                               field="labels", hint="add Label(...) to the PersiaBatch")
            labels = None
        else:
            labels = [t.to(dev, non_blocking=non_blocking) for t in batch.labels]
        grad = self.is_training and batch.requires_grad
        # A batch prepared again (forward twice, prepare_features after forward) gets the
        # leaves it got first: gradients of every use meet in them, and backward sends them.
        held = batch.leaves if grad and batch.leaves is not None else {}
        emb_tensors, leaves = [], []
        batch.masks = {}
        for slot in batch.id_type_feature_embeddings:
            leaf = held.get(slot.name)
            if leaf is None:
                leaf = slot.emb.to(dev, non_blocking=non_blocking)
                if grad:
                    leaf = leaf.detach().requires_grad_()
            leaves.append((slot.name, leaf))
            if slot.kind == "sum":
                emb_tensors.append(leaf)
                continue
            if slot.index is None or slot.mask is None:   # from_served gives a raw slot both
                raise InternalError(f"raw slot {slot.name!r} has no index or mask")
            index = slot.index.to(dev, non_blocking=non_blocking)
            mask = slot.mask.to(dev, non_blocking=non_blocking)
            # embedding() backward gives a dense (n + 1, dim) gradient: one row per id.
            gathered = torch.nn.functional.embedding(index, leaf)
            gathered.mask = mask  # type: ignore[attr-defined]  # the documented tensor.mask
            batch.masks[slot.name] = mask
            emb_tensors.append(gathered)
        if grad:
            batch.leaves = dict(leaves)
        self._prepared(batch, leaves if grad else None)
        return non_id, emb_tensors, labels

    def _arrange(self, batch: PersiaTrainingBatch) -> None:
        """Put the batch's inputs in the order the model was trained on, when known
        (:func:`stream_persia.nn.batch.arrange`)."""
        if self.input_signature is not None:
            arrange(batch, self.input_signature, self.label_names,
                    strict_labels=self.as_trainer() is not None)

    def _prepared(self, batch: PersiaTrainingBatch, leaves: list | None) -> None:
        """Hook for TrainCtx: remember the leaves of the batch being trained."""

    def forward(self, batch: PersiaTrainingBatch
                ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """``prepare_features``, then the model: returns ``(output, label_tensors)``."""
        model = self.model
        if model is None:
            raise Misuse(f"{type(self).__name__} has no model", field="model",
                         hint="pass model=... to the context")
        non_id, emb, labels = self.prepare_features(batch)
        with self._autocast():
            output = model(non_id, emb)
        return output, labels

    def _autocast(self) -> Any:
        return torch.autocast(self.device.type, enabled=False)

    # ------------------------------------------------------------------ lookups
    def _lookup_mode(self) -> str:
        return "infer" if self.preprocess_mode is PreprocessMode.INFERENCE else "eval"

    def submit_lookup(self, persia_batch: PersiaBatch, device_id: int | None = None
                      ) -> concurrent.futures.Future[PersiaTrainingBatch]:
        """Start looking a batch up (never inserts); a future of the training batch."""
        if not isinstance(persia_batch, PersiaBatch):
            raise BadInput(f"expected a PersiaBatch, got {type(persia_batch).__name__}",
                           field="persia_batch")
        cluster = self.require_cluster()
        wi = next(self._lookup_rr) % len(cluster.workers)
        pin = self.device.type == "cuda"
        mode = self._lookup_mode()

        async def lookup() -> PersiaTrainingBatch:
            served = await cluster.workers[wi].call(
                "lookup_batch", {"batch": persia_batch.to_wire(), "mode": mode})
            return _to_device(from_served(served, wi, pin=pin), device_id)

        return cluster.loop.submit(lookup())

    def get_embedding_from_data(self, persia_batch: PersiaBatch, device_id: int | None = None
                                ) -> PersiaTrainingBatch:
        """Look the batch's embeddings up (evaluation/inference: unknown ids give zeros)."""
        return self.submit_lookup(persia_batch, device_id).result()

    def get_embedding_from_bytes(self, data: bytes, device_id: int | None = None
                                 ) -> PersiaTrainingBatch:
        """As :meth:`get_embedding_from_data`, from ``PersiaBatch.to_bytes()`` output."""
        return self.get_embedding_from_data(PersiaBatch.from_bytes(data), device_id)

    # ------------------------------------------------------------------ servers
    def configure_embedding_parameter_servers(self, embedding_config: EmbeddingConfig) -> None:
        """Apply ``embedding_config`` on every embedding server."""
        cluster = self.require_cluster()
        cluster.run(cluster.configure_servers({"embedding_config": embedding_config.to_dict()}))

    def get_embedding_size(self) -> list[int]:
        """Embedding rows held by each embedding server, in server order."""
        cluster = self.require_cluster()
        return [int(n) for n in cluster.run(cluster.call_servers("size"))]

    def clear_embeddings(self) -> None:
        """Remove every embedding row from every embedding server."""
        cluster = self.require_cluster()
        cluster.run(cluster.call_servers("clear"))

    # ------------------------------------------------------------------ checkpoints
    def dump_embedding(self, dst_dir: str, blocking: bool = True) -> None:
        """Write the embedding rows (with optimizer state) to ``dst_dir`` as a checkpoint
        without dense files. ``blocking=False`` returns at once; see
        :meth:`wait_for_dump_embedding`."""
        self._dump_future = checkpointing.dump_embedding(self, dst_dir, blocking)
        if blocking:
            self.wait_for_dump_embedding()

    def wait_for_dump_embedding(self) -> None:
        """Wait for the embedding dump started by :meth:`dump_embedding`; raises its error."""
        fut, self._dump_future = self._dump_future, None
        if fut is not None:
            fut.result()

    def load_embedding(self, src_dir: str, blocking: bool = True) -> None:
        """Replace every server's rows by those of the checkpoint at ``src_dir`` (any
        number of servers). ``blocking=False``: see :meth:`wait_for_load_embedding`."""
        self._load_future = checkpointing.load_embedding(self, src_dir, blocking)
        if blocking:
            self.wait_for_load_embedding()

    def wait_for_load_embedding(self) -> None:
        """Wait for the load started by :meth:`load_embedding`; raises its error."""
        fut, self._load_future = self._load_future, None
        if fut is not None:
            fut.result()

    def dump_checkpoint(self, dst_dir: str, dense_filename: str = "dense.pt",
                        jit_dense_filename: str = "jit_dense.pt", blocking: bool = True,
                        with_jit_model: bool = False) -> None:
        """Write the dense model and the embeddings to ``dst_dir`` (atomically)."""
        checkpointing.dump_checkpoint(self, dst_dir, dense_filename=dense_filename,
                                      jit_dense_filename=jit_dense_filename,
                                      opt_filename=None, with_jit_model=with_jit_model)

    def load_checkpoint(self, src_dir: str, map_location: str | None = None,
                        dense_filename: str = "dense.pt", blocking: bool = True) -> None:
        """Load the dense model and the embeddings from ``src_dir``."""
        checkpointing.load_checkpoint(self, src_dir, map_location=map_location,
                                      dense_filename=dense_filename, opt_filename=None)

    def dump_torch_state_dict(self, torch_instance: Any, dst_dir: str, file_name: str,
                              is_jit: bool = False) -> None:
        """Save a model's or optimizer's state dict (or a scripted model) to a file."""
        checkpointing.dump_torch_state_dict(torch_instance, dst_dir, file_name, is_jit)

    def load_torch_state_dict(self, torch_instance: Any, src_dir: str,
                              map_location: str | None = None,
                              file_name: str = "dense.pt") -> None:
        """Load a state dict saved by :meth:`dump_torch_state_dict` into ``torch_instance``."""
        checkpointing.load_torch_state_dict(torch_instance, src_dir, map_location, file_name)


def _to_device(batch: PersiaTrainingBatch, device_id: int | None) -> PersiaTrainingBatch:
    if device_id is None:
        return batch
    dev = torch.device("cuda", device_id)
    batch.non_id_type_features = [t.to(dev) for t in batch.non_id_type_features]
    if batch.labels is not None:
        batch.labels = [t.to(dev) for t in batch.labels]
    for s in batch.id_type_feature_embeddings:
        s.emb = s.emb.to(dev)
        if s.index is not None and s.mask is not None:   # a raw slot: both, or neither
            s.index, s.mask = s.index.to(dev), s.mask.to(dev)
    return batch


def eval_ctx(*args: Any, **kwargs: Any) -> EmbeddingCtx:
    """An :class:`EmbeddingCtx` in EVAL mode (PERSIA's ``eval_ctx``)."""
    return EmbeddingCtx(PreprocessMode.EVAL, *args, **kwargs)


class InferCtx(EmbeddingCtx):
    """Online inference against given embedding workers (PERSIA's ``InferCtx``).

    Looks ids up without inserting or refreshing them (``mode="infer"``); batches need no
    labels. Only the embedding workers are contacted on enter.

    Args:
        embedding_worker_address_list: ``host:port`` of the embedding workers.
        *args, **kwargs: as for :class:`EmbeddingCtx` (``model``, ``device_id``, ...).
    """

    _need_servers = False

    def __init__(self, embedding_worker_address_list: list[str], *args: Any, **kwargs: Any):
        if not embedding_worker_address_list:
            raise Misuse("InferCtx needs at least one embedding worker address",
                         field="embedding_worker_address_list")
        kwargs["embedding_workers"] = [a.replace(" ", "")
                                       for a in embedding_worker_address_list]
        super().__init__(PreprocessMode.INFERENCE, *args, **kwargs)

    def wait_for_serving(self) -> None:
        """Wait until every embedding worker answers (entering the context already did)."""
        cluster = self.require_cluster()
        cluster.run(cluster.wait_workers_ready())
