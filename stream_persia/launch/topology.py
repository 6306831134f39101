"""``topology.yml``: which roles a job runs, how many, its entry scripts and defaults.

Schema (every key but ``name`` has a default; unknown keys are errors)::

    name: synthetic_ctr                 # job name (letters, digits, _ . -)
    description: text
    roles:
      embedding_servers: 1
      embedding_workers: 1
      nn_workers: {nproc_per_node: 1}   # NN ranks on this machine (torchrun)
      data_loaders: 1
      api: true                         # start the HTTP API and serve the final checkpoint
    entry: {data_loader: data_loader.py, nn_worker: train.py}
    config: {embedding: embedding_config.yml, global: global_config.yml}
    run: {samples, epochs, batch_size, eval_samples, embedding_staleness, seed, ...}
    data: {flag: --data-dir, default: ../shared/data/adult, required: false}
    serving: {model: "model:DNN", model_kwargs: {}}
    tasks: [click]
    gates: [{metric: bayes_lift.click, min: 0.95}]

A key given twice in one mapping is an error (PyYAML would keep the last one silently).

Paths are relative to the topology directory, except ``data.default`` (relative to the
directory ``stream-persia run`` is started from, normally the project root).
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from stream_persia.config import parse_yaml
from stream_persia.config.files import read_text
from stream_persia.errors import ConfigError

__all__ = ["Topology", "Gate", "load_topology", "RUN_KEYS", "MAX_REPLICAS"]

_ROLE_KEYS = {"embedding_servers", "embedding_workers", "nn_workers", "data_loaders", "api"}
#: The settings ``run:`` may hold (``topologies/common.py`` reads them; each has a flag or
#: environment variable that overrides it).
RUN_KEYS = ("samples", "epochs", "batch_size", "eval_samples", "embedding_staleness", "seed",
            "reproducible", "output_dir", "checkpoint_dir", "data")
_TOP_KEYS = {"name", "description", "roles", "entry", "config", "run", "data", "serving",
             "tasks", "gates"}


@dataclass(frozen=True)
class Gate:
    """An accuracy gate: ``metric`` is a dotted path into the report (``auc.click``)."""

    metric: str
    min: float

    def check(self, report: dict[str, Any]) -> tuple[bool, float | None]:
        value: Any = report
        for part in self.metric.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if not isinstance(value, (int, float)):
            return False, None
        return float(value) >= self.min, float(value)


@dataclass(frozen=True)
class Topology:
    directory: Path
    name: str
    description: str = ""
    embedding_servers: int = 1
    embedding_workers: int = 1
    nproc_per_node: int = 1
    data_loaders: int = 1
    api: bool = True
    data_loader_entry: str = "data_loader.py"
    nn_worker_entry: str = "train.py"
    embedding_config: str = "embedding_config.yml"
    global_config: str = "global_config.yml"
    run: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    serving: dict[str, Any] = field(default_factory=dict)
    tasks: tuple[str, ...] = ()
    gates: tuple[Gate, ...] = ()

    def path(self, rel: str) -> Path:
        return (self.directory / rel).resolve()


def _err(file: Path, key: str, detail: str, hint: str | None = None) -> ConfigError:
    return ConfigError(f"{file}: {key}: {detail}", field=key, hint=hint)


#: The most replicas of one role a topology may ask for (``run``'s flags have the same
#: bound): each is a process on this machine.
MAX_REPLICAS = 1024


def _count(file: Path, key: str, value: Any, lo: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= MAX_REPLICAS:
        raise _err(file, key, f"expected an integer in [{lo}, {MAX_REPLICAS}], got {value!r}")
    return value


def _mapping(file: Path, key: str, value: Any, allowed: set[str] | None = None) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _err(file, key, f"expected a mapping, got {type(value).__name__}")
    if allowed is not None and set(value) - allowed:
        raise _err(file, key, f"unknown key(s) {sorted(map(str, set(value) - allowed))}",
                   f"accepted: {sorted(allowed)}")
    return value


def load_topology(directory: str | Path) -> Topology:
    """Read and validate ``<directory>/topology.yml`` (errors name the file and key)."""
    d = Path(directory)
    file = d / "topology.yml"
    if not file.is_file():
        raise ConfigError(f"{d} is not a topology: {file} does not exist",
                          field="topology", hint="pass a directory such as "
                                                 "topologies/synthetic_ctr")
    try:
        raw = parse_yaml(read_text(file, "topology.yml"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{file}: not valid YAML: {e}", field="topology") from None
    top = _mapping(file, "<top>", raw, _TOP_KEYS)
    description = top.get("description")
    if description is not None and not isinstance(description, str):
        raise _err(file, "description", f"expected text, got {description!r}")
    tasks = top.get("tasks")
    if tasks is None:
        tasks = []
    if not isinstance(tasks, list) or not all(isinstance(t, str) and t.strip() for t in tasks):
        # A bare `tasks: click` would be read letter by letter; `tasks: [yes]` as true.
        raise _err(file, "tasks", f"expected a list of task (label) names, got {tasks!r}",
                   f"write it as [{tasks}]" if isinstance(tasks, str) else
                   "quote names YAML reads as other values (yes, no, on, off, numbers)")
    gate_list = top.get("gates")
    if gate_list is not None and not isinstance(gate_list, list):
        raise _err(file, "gates", f"expected a list of {{metric, min}}, got {gate_list!r}",
                   "write each gate as a list item: - {metric: auc.click, min: 0.9}")
    name = top.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise _err(file, "name", f"expected a job name of letters, digits, _ . -, got {name!r}")
    roles = _mapping(file, "roles", top.get("roles"), _ROLE_KEYS)
    nn = roles.get("nn_workers", {"nproc_per_node": 1})
    if isinstance(nn, int) and not isinstance(nn, bool):
        nn = {"nproc_per_node": nn}
    nn = _mapping(file, "roles.nn_workers", nn, {"nproc_per_node"})
    entry = _mapping(file, "entry", top.get("entry"), {"data_loader", "nn_worker"})
    config = _mapping(file, "config", top.get("config"), {"embedding", "global"})
    gates = []
    for i, g in enumerate(top.get("gates") or []):
        g = _mapping(file, f"gates[{i}]", g, {"metric", "min"})
        low = g.get("min")
        if not isinstance(g.get("metric"), str) or isinstance(low, bool) \
                or not isinstance(low, (int, float)) or not math.isfinite(low):
            raise _err(file, f"gates[{i}]", f"needs a metric (str) and a finite min (number), "
                       f"got {g!r}")
        gates.append(Gate(g["metric"], float(g["min"])))
    api = roles.get("api", True)
    if not isinstance(api, bool):
        raise _err(file, "roles.api", f"expected true or false, got {api!r}")
    data = _mapping(file, "data", top.get("data"), {"flag", "default", "required"})
    if not isinstance(data.get("required", False), bool):
        # `required: "false"` would be a non-empty string, so true.
        raise _err(file, "data.required", f"expected true or false, got "
                   f"{data['required']!r}")
    if "flag" in data and not isinstance(data["flag"], str):
        raise _err(file, "data.flag", f"expected text, got {data['flag']!r}")
    if data.get("default") is not None and not isinstance(data["default"], str):  # null: none
        raise _err(file, "data.default", f"expected text, got {data['default']!r}")
    serving = _mapping(file, "serving", top.get("serving"), {"model", "model_kwargs"})
    model = serving.get("model")
    if model is not None and not (isinstance(model, str)
                                  and re.fullmatch(r"[\w.]+:[\w.]+", model.strip())):
        raise _err(file, "serving.model", f"expected module:Class, got {model!r}",
                   "e.g. model:DNN, importable with the topology directory on sys.path")
    kwargs = serving.get("model_kwargs")
    if kwargs is not None and not (isinstance(kwargs, dict)
                                   and all(isinstance(k, str) for k in kwargs)):
        raise _err(file, "serving.model_kwargs", f"expected a mapping of argument names to "
                   f"values, got {kwargs!r}", "{} builds the model with no arguments")
    run = _mapping(file, "run", top.get("run"))
    unknown = sorted(str(k) for k in set(run) - set(RUN_KEYS))
    if unknown:
        # The scripts refuse them too, but only once every role has started.
        hint = difflib.get_close_matches(unknown[0], RUN_KEYS, n=1)
        raise _err(file, f"run.{unknown[0]}", "unknown run setting",
                   (f"did you mean {hint[0]!r}? " if hint else "")
                   + f"accepted: {', '.join(RUN_KEYS)}")
    topo = Topology(
        directory=d.resolve(), name=name, description=description or "",
        embedding_servers=_count(file, "roles.embedding_servers",
                                 roles.get("embedding_servers", 1)),
        embedding_workers=_count(file, "roles.embedding_workers",
                                 roles.get("embedding_workers", 1)),
        nproc_per_node=_count(file, "roles.nn_workers.nproc_per_node",
                              nn.get("nproc_per_node", 1)),
        data_loaders=_count(file, "roles.data_loaders", roles.get("data_loaders", 1)),
        api=api,
        data_loader_entry=str(entry.get("data_loader", "data_loader.py")),
        nn_worker_entry=str(entry.get("nn_worker", "train.py")),
        embedding_config=str(config.get("embedding", "embedding_config.yml")),
        global_config=str(config.get("global", "global_config.yml")),
        run=run,
        data=data,
        serving=serving,
        tasks=tuple(tasks),
        gates=tuple(gates))
    for key, rel in (("entry.data_loader", topo.data_loader_entry),
                     ("entry.nn_worker", topo.nn_worker_entry),
                     ("config.embedding", topo.embedding_config),
                     ("config.global", topo.global_config)):
        if not topo.path(rel).is_file():
            raise _err(file, key, f"{topo.path(rel)} does not exist")
    return topo
