"""PERSIA's import paths keep working: a PERSIA job ports by changing ``persia`` to
``stream_persia``. Each path is a re-export of the module that holds the code; these tests pin
that every name PERSIA's documents use is there and is the very object of its home module."""

import importlib

import pytest

# PERSIA path -> (home module, names PERSIA's API reference and examples use)
PATHS = {
    "stream_persia.ctx": ("stream_persia.nn.train_ctx", ["TrainCtx"]),
    "stream_persia.data": ("stream_persia.nn.data",
                           ["DataLoader", "IterableDataset", "StreamingDataset",
                            "PersiaDataset"]),
    "stream_persia.distributed": ("stream_persia.nn.distributed",
                                  ["DDPOption", "BaguaDistributedOption",
                                   "get_default_distributed_option"]),
    "stream_persia.env": ("stream_persia.nn.env",
                          ["get_rank", "get_world_size", "get_local_rank",
                           "get_replica_index", "get_replica_size"]),
    "stream_persia.utils": ("stream_persia.nn.utils", ["setup_seed", "find_free_port"]),
    "stream_persia.logger": ("stream_persia.core.logger",
                             ["get_default_logger", "get_logger"]),
    "stream_persia.embedding": ("stream_persia.core.embedding_config", ["EmbeddingConfig"]),
    "stream_persia.embedding.data": ("stream_persia.core.data",
                                     ["PersiaBatch", "IDTypeFeature",
                                      "IDTypeFeatureWithSingleID", "NonIDTypeFeature",
                                      "Label"]),
    "stream_persia.embedding.optim": ("stream_persia.core.optim", ["SGD", "Adam", "Adagrad"]),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_persia_path_re_exports_its_home(path):
    home_name, names = PATHS[path]
    mod, home = importlib.import_module(path), importlib.import_module(home_name)
    for name in names:
        assert getattr(mod, name) is getattr(home, name), f"{path}.{name}"
    for name in getattr(mod, "__all__", []):
        assert hasattr(mod, name), f"{path}.__all__ names {name}, which it lacks"


def test_the_context_entry_points_of_persia_ctx():
    ctx = importlib.import_module("stream_persia.ctx")
    from stream_persia.loader.data_ctx import DataCtx
    from stream_persia.nn import embedding_ctx
    assert ctx.DataCtx is DataCtx
    for name in ("EmbeddingCtx", "InferCtx", "PreprocessMode", "eval_ctx"):
        assert getattr(ctx, name) is getattr(embedding_ctx, name)
    assert ctx.cnt_ctx is embedding_ctx.current_ctx


@pytest.mark.parametrize("path", ["stream_persia.data", "stream_persia.distributed",
                                  "stream_persia.env", "stream_persia.utils",
                                  "stream_persia.logger", "stream_persia.embedding",
                                  "stream_persia.embedding.data",
                                  "stream_persia.embedding.optim"])
def test_a_persia_path_is_only_a_re_export(path):
    """The code lives in one home: a PERSIA path defines nothing of its own."""
    mod = importlib.import_module(path)
    own = [n for n, v in vars(mod).items()
           if getattr(v, "__module__", None) == path and not n.startswith("__")]
    assert own == [], f"{path} defines {own}: move them to its home module"
