"""The dense model served for inference, loaded from a checkpoint.

Two ways to get it:

1. ``dense.pt`` (a state dict) plus a model class given as ``module:Class`` (any callable
   returning an ``nn.Module``; e.g. the class named in the topology), when a class is
   given. DDP's ``module.`` prefix is stripped.
2. Otherwise ``jit_dense.pt`` (TorchScript, written with ``with_jit_model=True``), loaded
   with ``torch.jit.load``: no Python class needed.

The model is called as PERSIA's ``forward(non_id_type_feature_tensors,
id_type_feature_embedding_tensors)`` in eval mode under ``torch.inference_mode``. Its
output may be one tensor or a tuple/list/dict of tensors (multi-task heads); each head
must have one row per sample; floating heads are answered as float32, integer and bool
heads as they are. Head names: the dict keys, else ``manifest.extra["heads"]``,
else ``output`` (one tensor) or ``head_<i>``.
"""

from __future__ import annotations

import importlib
import io
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from stream_persia.checkpoint import Manifest, load_torch, read_manifest
from stream_persia.checkpoint._common import Location
from stream_persia.errors import BadInput, ConfigError, InternalError

__all__ = ["DenseModel", "load_dense", "checkpoint_id"]

log = logging.getLogger(__name__)


def checkpoint_id(manifest: Manifest) -> str:
    """A checkpoint's id: ``extra["id"]`` when the writer set one, else its directory name."""
    ident = manifest.extra.get("id") if isinstance(manifest.extra, dict) else None
    if isinstance(ident, str) and ident:
        return ident
    return Location(manifest.path or "").name


@dataclass(eq=False)
class DenseModel:
    """A loaded dense model and where it came from."""

    module: Any
    manifest: Manifest
    kind: str                      # "torchscript" | "state_dict"
    head_names: list[str] | None = None
    loaded_at: float = field(default_factory=time.time)
    step: int = -1   # the training step of these weights (-1: the manifest's)

    def __post_init__(self) -> None:
        self.version = checkpoint_id(self.manifest)   # resolved once: it is on every answer
        if self.step < 0:
            self.step = self.manifest.step

    def forward(self, non_id: list[torch.Tensor], embeddings: list[torch.Tensor],
                batch_size: int) -> dict[str, np.ndarray]:
        """Run the model; returns head name → array with ``batch_size`` rows: float32 for a
        floating head, the head's own dtype for an integer or bool one (say, an item id: one
        above 2**24 has no float32, which would silently name a neighbour).

        Raises:
            BadInput: the model rejected the inputs (shapes or dtypes it does not take).
            InternalError: its output is not a tensor (or tuple/list/dict of tensors) with
                one row per sample.
        """
        try:
            with torch.inference_mode():
                out = self.module(non_id, embeddings)
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            # TorchScript raises RuntimeError for shape/dtype mismatches; the inputs
            # passed schema checks, so what is left is a mismatch with this model.
            raise BadInput(f"the model rejected the request's features: "
                           f"{str(e).strip().splitlines()[-1][:300]}",
                           field="non_id_type_features",
                           hint="send the features (names, order, widths) the model was "
                                "trained with") from None
        heads = self._heads(out, batch_size)
        if self.head_names is None:
            self.head_names = list(heads)
        return heads

    def _heads(self, out: Any, batch_size: int) -> dict[str, np.ndarray]:
        if isinstance(out, torch.Tensor):
            names = self.head_names if self.head_names and len(self.head_names) == 1 \
                else ["output"]
            items = list(zip(names, [out], strict=True))
        elif isinstance(out, dict):
            items = [(str(k), v) for k, v in out.items()]
        elif isinstance(out, (tuple, list)):
            names = self.head_names if self.head_names and len(self.head_names) == len(out) \
                else [f"head_{i}" for i in range(len(out))]
            items = list(zip(names, out, strict=True))
        else:
            raise InternalError(f"the model returned {type(out).__name__}; expected a tensor "
                                f"or a tuple/list/dict of tensors")
        heads = {}
        for name, t in items:
            if not isinstance(t, torch.Tensor) or t.ndim == 0 or t.shape[0] != batch_size:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise InternalError(f"model head {name!r} is {got}; expected a tensor with "
                                    f"{batch_size} rows (one per sample)")
            t = t.detach().to("cpu")
            heads[name] = (t.numpy() if not (t.dtype.is_floating_point or t.dtype.is_complex)
                           else t.to(torch.float32).numpy())
        return heads


def _import_factory(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"model class {spec!r} cannot be imported: {e}", field="model_class",
                          hint="'package.module:Class', importable by the API process") from None
    if not callable(obj):
        raise ConfigError(f"model class {spec!r} is not callable", field="model_class")
    return obj


def _read_checked(manifest: Manifest, name: str) -> bytes:
    import hashlib

    loc = Location(manifest.path or "")
    entry = manifest.files[name]
    data = loc.fs.cat_file(loc.join(name))
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise BadInput(f"checkpoint {loc.url}: file {name} is corrupt or truncated",
                       field=f"files.{name}")
    return data


def load_dense(src: str, model_class: str | None = None) -> DenseModel:
    """Load the dense model of the checkpoint at ``src`` (blocking; call off the loop).

    Raises:
        BadInput: not a checkpoint, a corrupt file, or neither a TorchScript model nor
            (a state dict and ``model_class``).
        ConfigError: ``model_class`` cannot be imported or built.
    """
    manifest = read_manifest(src)
    heads = manifest.extra.get("heads") if isinstance(manifest.extra, dict) else None
    heads = [str(h) for h in heads] if isinstance(heads, list) else None
    if manifest.jit_filename is not None and (model_class is None
                                              or manifest.dense_filename is None):
        data = _read_checked(manifest, manifest.jit_filename)
        try:
            with warnings.catch_warnings():   # deprecated upstream, still the format PERSIA uses
                warnings.simplefilter("ignore", DeprecationWarning)
                module = torch.jit.load(io.BytesIO(data), map_location="cpu")
        except Exception as e:   # torch raises several types on bytes it cannot read
            raise BadInput(f"checkpoint {manifest.path}: {manifest.jit_filename} is not a "
                           f"TorchScript model: {type(e).__name__}: "
                           f"{(str(e).strip().splitlines() or [''])[-1][:200]}",
                           field="jit_filename") from None
        module.eval()
        return DenseModel(module, manifest, "torchscript", heads)
    if model_class is None or manifest.dense_filename is None:
        raise BadInput(f"checkpoint {manifest.path} has no TorchScript model "
                       f"(jit_dense.pt){'' if manifest.dense_filename else ' and no dense.pt'}",
                       field="checkpoint",
                       hint="dump it with with_jit_model=True, or give the model class "
                            "(PERSIA_API_MODEL_CLASS=module:Class) for its dense.pt")
    factory = _import_factory(model_class)
    try:
        module = factory()
    except Exception as e:  # user code: any failure is a configuration problem here
        raise ConfigError(f"model class {model_class!r} could not be built with no "
                          f"arguments: {e}", field="model_class") from None
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"model class {model_class!r} built a {type(module).__name__}, not "
                          f"a torch.nn.Module", field="model_class")
    state = load_torch(src, manifest.dense_filename, map_location="cpu")
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"],
                                                                         dict):
        state = state["state_dict"]
    if isinstance(state, dict) and state and all(str(k).startswith("module.") for k in state):
        state = {str(k)[len("module."):]: v for k, v in state.items()}
    try:
        module.load_state_dict(state)
    except Exception as e:   # a state dict of another model, or not a state dict at all
        raise BadInput(f"checkpoint {manifest.path}: {manifest.dense_filename} does not fit "
                       f"{model_class}: {type(e).__name__}: {e}",
                       field="dense_filename") from None
    module.eval()
    return DenseModel(module, manifest, "state_dict", heads)
