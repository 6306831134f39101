"""The NN worker's public API: PERSIA's names, signatures and defaults, and clear errors.

No sockets except where a test checks that an unreachable role is named.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

import stream_persia.ctx as ctx_mod
from stream_persia import env, logger, utils
from stream_persia.data import DataLoader, IterableDataset, StreamingDataset
from stream_persia.distributed import BaguaDistributedOption, DDPOption
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import Adagrad
from stream_persia.errors import BadInput, ConfigError, Misuse, PeerUnavailable

EMPTY = inspect.Parameter.empty


def params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


# ---------------------------------------------------------------------------- signatures
def test_ctx_module_exports_persias_names():
    for name in ("TrainCtx", "EmbeddingCtx", "eval_ctx", "InferCtx", "PreprocessMode",
                 "DataCtx", "cnt_ctx"):
        assert hasattr(ctx_mod, name), name
    assert [m.value for m in ctx_mod.PreprocessMode] == [1, 2, 3]
    assert [m.name for m in ctx_mod.PreprocessMode] == ["TRAIN", "EVAL", "INFERENCE"]


def test_data_loader_processes_do_not_import_torch():
    code = ("import sys; from stream_persia.ctx import DataCtx; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_train_ctx_signature_is_persias():
    assert params(ctx_mod.TrainCtx.__init__)[:10] == [
        ("self", EMPTY), ("embedding_optimizer", EMPTY), ("dense_optimizer", EMPTY),
        ("grad_scalar_update_factor", 4), ("backward_buffer_size", 10),
        ("backward_workers_size", 8), ("grad_update_buffer_size", 60),
        ("lookup_emb_directly", True), ("mixed_precision", True),
        ("distributed_option", None)]
    kw = dict(params(ctx_mod.TrainCtx.__init__))
    for name, default in (("model", None), ("embedding_config", None), ("device_id", None),
                          ("threadpool_worker_size", 10), ("embedding_workers", None)):
        assert kw[name] == default, name
    assert params(ctx_mod.TrainCtx.backward) == [
        ("self", EMPTY), ("loss", EMPTY), ("embedding_gradient_check_frequency", 20)]
    assert params(ctx_mod.TrainCtx.dump_checkpoint) == [
        ("self", EMPTY), ("dst_dir", EMPTY), ("dense_model_filename", "dense.pt"),
        ("jit_dense_model_filename", "jit_dense.pt"), ("opt_filename", "opt.pt"),
        ("blocking", True), ("with_jit_model", False)]
    assert params(ctx_mod.TrainCtx.load_checkpoint) == [
        ("self", EMPTY), ("src_dir", EMPTY), ("map_location", None),
        ("dense_model_filename", "dense.pt"), ("opt_filename", "opt.pt"), ("blocking", True)]


def test_embedding_ctx_signatures_are_persias():
    E = ctx_mod.EmbeddingCtx
    assert params(E.__init__)[:4] == [("self", EMPTY), ("preprocess_mode", EMPTY),
                                      ("model", None), ("embedding_config", None)]
    assert params(E.forward) == [("self", EMPTY), ("batch", EMPTY)]
    assert params(E.prepare_features) == [("self", EMPTY), ("persia_training_batch", EMPTY)]
    assert params(E.get_embedding_from_data) == [("self", EMPTY), ("persia_batch", EMPTY),
                                                 ("device_id", None)]
    assert params(E.get_embedding_from_bytes) == [("self", EMPTY), ("data", EMPTY),
                                                  ("device_id", None)]
    assert params(E.dump_embedding) == [("self", EMPTY), ("dst_dir", EMPTY), ("blocking", True)]
    assert params(E.load_embedding) == [("self", EMPTY), ("src_dir", EMPTY), ("blocking", True)]
    assert params(E.dump_checkpoint) == [
        ("self", EMPTY), ("dst_dir", EMPTY), ("dense_filename", "dense.pt"),
        ("jit_dense_filename", "jit_dense.pt"), ("blocking", True), ("with_jit_model", False)]
    assert params(E.load_checkpoint) == [
        ("self", EMPTY), ("src_dir", EMPTY), ("map_location", None),
        ("dense_filename", "dense.pt"), ("blocking", True)]
    for name in ("get_embedding_size", "clear_embeddings", "wait_for_dump_embedding",
                 "wait_for_load_embedding"):
        assert params(getattr(E, name)) == [("self", EMPTY)], name
    assert params(ctx_mod.InferCtx.__init__)[:2] == [("self", EMPTY),
                                                     ("embedding_worker_address_list", EMPTY)]
    assert ctx_mod.eval_ctx(embedding_workers=["127.0.0.1:1"]).preprocess_mode is \
        ctx_mod.PreprocessMode.EVAL


def test_data_signatures_are_persias():
    assert params(DataLoader.__init__)[:7] == [
        ("self", EMPTY), ("dataset", EMPTY), ("forward_buffer_size", 10),
        ("timeout_ms", 600_000), ("num_workers", 10), ("reproducible", False),
        ("embedding_staleness", None)]
    assert params(StreamingDataset.__init__) == [("self", EMPTY), ("buffer_size", 10)]
    assert params(EmbeddingConfig.__init__) == [
        ("self", EMPTY), ("emb_initialization", (-0.01, 0.01)), ("admit_probability", 1.0),
        ("weight_bound", 10.0)]
    for fn in (env.get_rank, env.get_local_rank, env.get_world_size, env.get_replica_index,
               env.get_replica_size):
        assert params(fn) == []
    assert params(utils.setup_seed) == [("seed", EMPTY)]


# ---------------------------------------------------------------------------- distributed
def test_bagua_is_refused_with_the_alternative():
    with pytest.raises(ConfigError) as err:
        BaguaDistributedOption("gradient_allreduce")
    assert "Bagua" in str(err.value) and "DDPOption" in str(err.value)
    assert err.value.field == "distributed_option"


def test_ddp_option_validates_and_picks_the_backend():
    assert DDPOption().resolve_backend(None) == "gloo"
    assert DDPOption().resolve_backend(0) == "nccl"
    assert DDPOption(init_method="env").initialization_method == "env"   # PERSIA docs' name
    with pytest.raises(ConfigError, match="needs CUDA"):
        DDPOption(backend="nccl").resolve_backend(None)
    with pytest.raises(ConfigError) as err:
        DDPOption(backend="mpi")
    assert err.value.field == "backend"
    with pytest.raises(ConfigError) as err:
        DDPOption(initialization_method="file")
    assert err.value.field == "init_file"


def test_train_ctx_rejects_wrong_arguments():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(Misuse) as err:
        ctx_mod.TrainCtx(torch.optim.SGD(model.parameters(), lr=0.1), opt, model=model)
    assert err.value.field == "embedding_optimizer"
    with pytest.raises(Misuse) as err:
        ctx_mod.TrainCtx(Adagrad(), opt)
    assert err.value.field == "model"
    with pytest.raises(Misuse) as err:
        ctx_mod.TrainCtx(Adagrad(), opt, model=model, distributed_option="nccl")
    assert err.value.field == "distributed_option"
    # PERSIA's default mixed_precision=True is ignored on the CPU (no GradScaler).
    ctx = ctx_mod.TrainCtx(Adagrad(), opt, model=model)
    assert ctx.mixed_precision is False and ctx.grad_scaler is None


def test_no_embedding_workers_are_looked_for_on_their_well_known_local_ports(monkeypatch):
    """Zero-config (issue 23): no address given, entering waits for embedding worker 0 on
    its well-known port (``PERSIA_BASE_PORT`` + 100), then names it and the variables; a
    bad base is a config error naming it."""
    monkeypatch.delenv("PERSIA_EMBEDDING_WORKERS", raising=False)
    base = min(utils.find_free_port(), 65000)   # nothing listens there, nor (surely) at +100
    monkeypatch.setenv("PERSIA_BASE_PORT", str(base))
    model = torch.nn.Linear(2, 1)
    ctx = ctx_mod.TrainCtx(Adagrad(), torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                           ready_timeout_s=0.5)
    with pytest.raises(PeerUnavailable) as err:
        with ctx:
            pass
    assert f"127.0.0.1:{base + 100}" in str(err.value)
    assert "PERSIA_EMBEDDING_WORKERS" in str(err.value)
    monkeypatch.setenv("PERSIA_BASE_PORT", "nope")
    with pytest.raises(ConfigError) as cerr:
        ctx_mod.TrainCtx(Adagrad(), torch.optim.SGD(model.parameters(), lr=0.1),
                         model=model).__enter__()
    assert cerr.value.field == "PERSIA_BASE_PORT"


def test_unreachable_worker_is_named_within_the_bound():
    port = utils.find_free_port()      # nothing listens there
    model = torch.nn.Linear(2, 1)
    ctx = ctx_mod.TrainCtx(Adagrad(), torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                           embedding_workers=[f"127.0.0.1:{port}"], ready_timeout_s=0.5)
    with pytest.raises(PeerUnavailable) as err:
        with ctx:
            pass
    assert f"embedding worker 0 127.0.0.1:{port}" in str(err.value)
    assert ctx.cluster is None


def test_data_loader_validates_and_needs_a_context():
    with pytest.raises(Misuse) as err:
        DataLoader([1, 2, 3])
    assert err.value.field == "dataset"
    for kw in ({"embedding_staleness": 0}, {"forward_buffer_size": 0}, {"timeout_ms": -1}):
        with pytest.raises(Misuse) as err:
            DataLoader(StreamingDataset(), **kw)
        assert err.value.field == next(iter(kw))
    assert DataLoader(StreamingDataset(), forward_buffer_size=6).staleness == 6
    with pytest.raises(Misuse, match="no stream-persia context"):
        iter(DataLoader(StreamingDataset()))
    with pytest.raises(Misuse, match="subclass it"):
        iter(IterableDataset())


# ---------------------------------------------------------------------------- env, logger
def test_env_reads_torchrun_and_replica_variables(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "REPLICA_INDEX", "REPLICA_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert (env.get_rank(), env.get_local_rank(), env.get_world_size()) == (0, 0, 1)
    assert (env.get_replica_index(), env.get_replica_size()) == (0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (env.get_rank(), env.get_local_rank(), env.get_world_size()) == (3, 1, 4)
    assert (env.get_replica_index(), env.get_replica_size()) == (3, 4)
    monkeypatch.setenv("REPLICA_INDEX", "0")
    monkeypatch.setenv("REPLICA_SIZE", "2")
    assert (env.get_replica_index(), env.get_replica_size()) == (0, 2)
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ConfigError) as err:
        env.get_rank()
    assert err.value.field == "RANK"
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="WORLD_SIZE='two'"):
        env.get_world_size()


def test_default_logger_is_configured_once():
    a = logger.get_default_logger("nn_worker_test")
    b = logger.get_default_logger("nn_worker_test", level="debug")
    assert a is b and len(a.handlers) == 1 and a.level == logging.DEBUG


# ---------------------------------------------------------------------------- utils
def _pairwise_auc(y: np.ndarray, s: np.ndarray) -> float:
    pos, neg = s[y == 1], s[y == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins) / (len(pos) * len(neg))


def test_roc_auc_matches_the_pairwise_definition_with_ties():
    rng = np.random.default_rng(0)
    for n, levels in itertools.product((2, 7, 300), (2, 5, 1000)):
        y = rng.integers(0, 2, size=n)
        y[0], y[1] = 0, 1
        s = rng.integers(0, levels, size=n).astype(np.float32)   # many ties
        assert utils.roc_auc(y, s) == pytest.approx(_pairwise_auc(y, s), abs=1e-12)
    assert utils.roc_auc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert utils.roc_auc([1, 1, 0, 0], [0.1, 0.2, 0.3, 0.4]) == 0.0
    assert utils.roc_auc(np.array([True, False]), [0.5, 0.5]) == 0.5


def test_roc_auc_refuses_undefined_cases():
    with pytest.raises(BadInput, match="both classes"):
        utils.roc_auc([1, 1], [0.2, 0.3])
    with pytest.raises(BadInput, match="0 or 1"):
        utils.roc_auc([0, 0.5], [0.2, 0.3])
    with pytest.raises(BadInput, match="NaN"):
        utils.roc_auc([0, 1], [0.2, float("nan")])
    with pytest.raises(BadInput) as err:
        utils.roc_auc([0, 1, 1], [0.2, 0.3])
    assert err.value.field == "scores"


def test_setup_seed_repeats_torch_and_numpy():
    utils.setup_seed(7)
    a = (torch.rand(3), np.random.rand(3))
    utils.setup_seed(7)
    b = (torch.rand(3), np.random.rand(3))
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1])


# ---------------------------------------------------------------------------- served batches
def _served_frame() -> dict:
    from stream_persia.core import wire

    served = {"batch_id": 7, "requires_grad": True, "meta": b"m", "batch_size": 2,
              "non_id_type_features": [{"name": "d", "data": np.ones((2, 3), np.float32)}],
              "labels": [{"name": "y", "data": np.array([[1.0], [0.0]], np.float32)}],
              "embeddings": [
                  {"name": "s", "kind": "sum", "emb": np.full((2, 4), 2.0, np.float32)},
                  {"name": "r", "kind": "raw", "emb": np.arange(12, dtype=np.float32).reshape(3, 4),
                   "index": np.array([[1, 2], [2, 0]], np.int64),
                   "mask": np.array([[True, True], [True, False]])}]}
    return wire.unpack(wire.pack(served))      # arrays come back as read-only frame views


def test_served_batches_become_writable_tensor_copies():
    from stream_persia.nn.batch import from_served

    served = _served_frame()
    assert not served["embeddings"][0]["emb"].flags.writeable
    tb = from_served(served, worker_index=1)
    assert (tb.batch_id, tb.worker_index, tb.requires_grad, tb.meta) == (7, 1, True, b"m")
    s, r = tb.id_type_feature_embeddings
    assert s.kind == "sum" and not s.is_raw_embedding() and s.emb.shape == (2, 4)
    assert r.is_raw_embedding() and r.index.dtype == torch.int64 and r.mask.dtype == torch.bool
    s.emb += 1      # writable, and a copy: the frame is untouched
    assert served["embeddings"][0]["emb"][0, 0] == 2.0
    assert tb.non_id_type_feature_names == ["d"] and tb.label_names == ["y"]


def test_served_batch_with_an_unknown_kind_names_the_field():
    from stream_persia.nn.batch import from_served

    served = dict(_served_frame())
    served["embeddings"] = [{"name": "s", "kind": "pooled", "emb": np.zeros((2, 4), np.float32)}]
    with pytest.raises(BadInput) as err:
        from_served(served)
    assert err.value.field == "embeddings[0].kind"
