"""``stream-persia run``'s command line: its flags, the topology settings they override,
and the checks made before any role starts.

A bad flag, topology ``run:`` setting or environment variable the roles would read is a
:class:`~stream_persia.errors.ConfigError` naming it (exit 2), raised here before
:mod:`stream_persia.launch.run` starts anything.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from stream_persia.config import flags, load_global_config
from stream_persia.config.kafka import ENV_KAFKA_ENABLE_IDEMPOTENCE, parse_switch
from stream_persia.errors import ConfigError
from stream_persia.launch.topology import MAX_REPLICAS, Topology

__all__ = ["PREDICT_SAMPLES", "SETTINGS_ENV", "SETTINGS_TYPES", "STOP_CHECKPOINT_S",
           "add_arguments", "check_args", "check_topology"]

# run flag -> environment variable read by the topology scripts (topologies/common.py)
SETTINGS_ENV = {
    "samples": "STREAM_PERSIA_SAMPLES", "epochs": "STREAM_PERSIA_EPOCHS",
    "batch_size": "STREAM_PERSIA_BATCH_SIZE", "eval_samples": "STREAM_PERSIA_EVAL_SAMPLES",
    "embedding_staleness": "EMBEDDING_STALENESS", "seed": "STREAM_PERSIA_SEED",
    "data": "STREAM_PERSIA_DATA",
}


#: The topology settings run flags override: flag dest -> its argparse type.
#: The same checks apply to a value from the environment (SETTINGS_ENV) that the roles
#: would otherwise read, so a bad one stops the run before any role starts.
SETTINGS_TYPES = {
    "samples": flags.size(0, note=" (0: the whole dataset of a file-backed topology)"),
    "epochs": flags.size(1),
    "batch_size": flags.size(1),
    "eval_samples": flags.size(0, note=" (0: the whole held-out split)"),
    "embedding_staleness": flags.size(1, note=" (1: synchronous)"),
    "seed": flags.size(0),
}

#: Eval samples predicted through the API at the end of a run, by default.
PREDICT_SAMPLES = 2048
#: Seconds a stop (Ctrl-C, SIGTERM, SIGHUP) waits for the final checkpoint by default.
STOP_CHECKPOINT_S = 60.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("topology", help="a topology directory (with topology.yml)")
    p.add_argument("--kafka", **flags.env("KAFKA_BOOTSTRAP_SERVERS", flags.addresses, None),
                   help="Kafka bootstrap servers: stream through Kafka (env "
                        "KAFKA_BOOTSTRAP_SERVERS; default: broker-less)")
    p.add_argument("--topic", type=flags.topic, default=None,
                   help="with --kafka: an existing samples topic (default: a fresh topic "
                        "<job>.<run>.samples, created with the admin client, or by the "
                        "broker's auto-creation where it has no admin API)")
    p.add_argument("--partitions", type=flags.integer(1, 1_000_000), default=None,
                   help="with --kafka and no --topic: partitions of the topic created here "
                        "(default: 4 × workers)")
    p.add_argument("--on-data-loss", choices=("fail", "skip"), default=None,
                   help="with --kafka: what embedding workers do with samples the broker "
                        "deleted before they were read (kafka.on_data_loss): fail (default: "
                        "stop the partition, and the run fails naming it) or skip (count "
                        "the loss and go on)")
    p.add_argument("--no-kafka-idempotence", action="store_true",
                   help="with --kafka: producers without idempotence "
                        "(kafka.enable_idempotence: false), for a broker that refuses "
                        "idempotent producers (Tansu 0.6; run stops and names this flag "
                        "when the broker refuses them); a retried send may then write a "
                        "batch twice")
    p.add_argument("--broker-timeout-s", type=_seconds, default=None,
                   help="with --kafka: fail a role once no broker answered for this long "
                        "(kafka.broker_timeout_ms; default 60)")
    for flag in ("samples", "epochs", "batch-size", "eval-samples", "seed"):
        dest = flag.replace("-", "_")
        p.add_argument(f"--{flag}", type=SETTINGS_TYPES[dest], default=None,
                       help=f"override run.{dest} (a whole number; 1e6 is accepted)")
    p.add_argument("--embedding-staleness", type=SETTINGS_TYPES["embedding_staleness"],
                   default=None,
                   help="batches an NN rank may hold unapplied (>= 1; 1: synchronous)")
    p.add_argument("--data", "--data-dir", "--data-file", dest="data", type=flags.nonempty,
                   default=None,
                   help="dataset location for topologies that read one")
    replicas = flags.integer(1, MAX_REPLICAS)
    p.add_argument("--embedding-servers", type=replicas, default=None, help="replicas (>= 1)")
    p.add_argument("--embedding-workers", type=replicas, default=None, help="replicas (>= 1)")
    p.add_argument("--nn-workers", type=replicas, default=None,
                   help="NN ranks on this machine (>= 1)")
    p.add_argument("--data-loaders", type=replicas, default=None, help="replicas (>= 1)")
    p.add_argument("--output-dir", type=flags.nonempty, default=None,
                   help="where logs, metrics, the checkpoint and the report go "
                        "(default: runs/<job>-<time>)")
    p.add_argument("--no-api", action="store_true", help="do not start the HTTP API")
    p.add_argument("--no-model-updates", action="store_true",
                   help="publish no model updates (model_updates.enabled: false): no "
                        "serving replica either; for measuring what publishing costs")
    p.add_argument("--concept-shift-at", type=flags.size(0), default=None,
                   help="drift: the topology's stream shifts from this sample on "
                        "(env STREAM_PERSIA_CONCEPT_SHIFT_AT; synthetic_ctr: the hidden CTR "
                        "of some ids, taobao_ple: the user and ad mix); the report's drift "
                        "says how progressive AUC reacted and how long the serving replica "
                        "took to follow")
    p.add_argument("--no-replica", action="store_true",
                   help="do not start the serving replica that follows training (its "
                        "freshness and served AUC are then not reported)")
    p.add_argument("--predict-samples", type=flags.integer(0), default=None,
                   help=f"eval samples predicted through the API at the end (0: none; "
                        f"default {PREDICT_SAMPLES})")
    p.add_argument("--no-gates", action="store_true", help="report gates but exit 0")
    p.add_argument("--timeout-s", type=flags.number(0, lo_open=True), default=3600.0,
                   help="give up after this long (seconds > 0)")
    p.add_argument("--stop-checkpoint-s", type=flags.number(0), default=STOP_CHECKPOINT_S,
                   help="on Ctrl-C, SIGTERM or SIGHUP: longest wait for the final checkpoint "
                        f"before every role is stopped (0: none; default {STOP_CHECKPOINT_S:g})")


def output_dir(topo: Topology, args: argparse.Namespace, default: Path) -> Path:
    """The run's output directory: ``--output-dir``, else the topology's
    ``run.output_dir`` (relative to the current directory, as the scripts read it), else
    ``default``; made absolute. A flag that overrides the file's value says so."""
    from_file = topo.run.get("output_dir")
    if args.output_dir:
        if from_file is not None and Path(from_file).resolve() != Path(args.output_dir).resolve():
            print(f"stream-persia run: note: --output-dir {args.output_dir} overrides "
                  f"{topo.directory / 'topology.yml'} run.output_dir {from_file!r}",
                  file=sys.stderr)
        return Path(args.output_dir).resolve()
    if from_file is None:
        return default.resolve()
    out = Path(from_file).resolve()
    if out.is_dir() and any(out.iterdir()):
        # One directory for every run of the topology: a second run would append to the
        # first's logs, find its checkpoints (its bootstrap one refused as existing) and,
        # with --kafka, reuse its samples topic (named after the directory).
        raise ConfigError(f"{topo.directory / 'topology.yml'}: run.output_dir: {out} already "
                          "holds a run", field="run.output_dir",
                          hint="remove it, or pass --output-dir for this run")
    return out


def check_topology(topo: Topology, args: argparse.Namespace) -> None:
    """The topology's ``run:`` settings and its global config, which the roles will read,
    and flags that need a role the topology does not start (ConfigError naming the file
    and key, or the flag)."""
    file = topo.directory / "topology.yml"
    for key in ("output_dir", "checkpoint_dir"):
        value = topo.run.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"{file}: run.{key}: must be a directory path, got {value!r}",
                              field=f"run.{key}")
    if topo.run.get("checkpoint_dir") is not None:
        # The API serves, and the report reloads, checkpoints only under the run's own
        # directory: run cannot put the final one elsewhere. Said, not silently ignored.
        print(f"stream-persia run: note: {file}: run.checkpoint_dir "
              f"{topo.run['checkpoint_dir']!r} is for running the scripts on their own; run "
              "puts the final checkpoint under its output directory (checkpoints/final)",
              file=sys.stderr)
    for key, parse in SETTINGS_TYPES.items():
        if key in topo.run and getattr(args, key) is None:
            value = topo.run[key]
            try:
                if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                    raise argparse.ArgumentTypeError(f"must be a whole number, got {value!r}")
                parse(str(value))
            except argparse.ArgumentTypeError as e:
                raise ConfigError(f"{file}: run.{key}: {e}", field=f"run.{key}",
                                  hint=f"fix it there, or override it with "
                                       f"--{key.replace('_', '-')}") from None
    # Every role reads the global config: a bad key (a periodic checkpoint setting, say)
    # fails here, naming the file and the key, rather than in the roles once started.
    load_global_config(topo.path(topo.global_config))
    if args.data is not None and not topo.data:
        raise ConfigError(f"--data: {topo.name} reads no dataset (its topology.yml has no "
                          "data: section)", field="--data", hint="drop --data")
    if args.data is not None and not Path(args.data).exists():
        raise ConfigError(f"--data: {args.data} does not exist", field="--data",
                          hint=f"the dataset {topo.name} reads (see its README)")
    if not topo.api and args.predict_samples:
        raise ConfigError(f"--predict-samples predicts through the API, which {topo.name} "
                          "does not start (roles.api: false)", field="--predict-samples")


def check_args(args: argparse.Namespace) -> None:
    """Checks between flags, and of the environment the roles would read; before any role
    starts. Raises ConfigError naming the flag or variable (exit 2)."""
    if args.topic is not None and not args.kafka:
        raise ConfigError("--topic needs --kafka (the broker-less stream has no topic)",
                          field="--topic", hint="add --kafka HOST:PORT, or drop --topic")
    if args.partitions is not None and (not args.kafka or args.topic is not None):
        raise ConfigError("--partitions only sets the partitions of a topic this run "
                          "creates (with --kafka and without --topic)", field="--partitions",
                          hint="drop --partitions" + (", or --topic" if args.topic else ""))
    for flag in ("on_data_loss", "broker_timeout_s", "no_kafka_idempotence"):
        if getattr(args, flag, None) not in (None, False) and not args.kafka:
            name = "--" + flag.replace("_", "-")
            raise ConfigError(f"{name} applies to Kafka only", field=name,
                              hint="add --kafka BOOTSTRAP, or remove it")
    if args.no_api and args.predict_samples:
        raise ConfigError("--predict-samples predicts through the API, which --no-api "
                          "leaves out", field="--predict-samples",
                          hint="drop one of the two flags")
    raw = os.environ.get(ENV_KAFKA_ENABLE_IDEMPOTENCE, "")
    if raw.strip():
        parse_switch(raw, ENV_KAFKA_ENABLE_IDEMPOTENCE)   # ConfigError naming it
    for key, var in SETTINGS_ENV.items():
        raw = os.environ.get(var, "").strip()
        if key in SETTINGS_TYPES and getattr(args, key) is None and raw:
            try:
                SETTINGS_TYPES[key](raw)
            except argparse.ArgumentTypeError as e:
                raise ConfigError(f"environment variable {var}: {e}", field=var,
                                  hint=f"unset it, or pass --{key.replace('_', '-')}") from None


def _seconds(raw: str) -> float:
    """An argparse type: seconds >= 1 (argparse names the flag in its error)."""
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 1.0 <= value <= 86_400.0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds in [1, 86400], "
                                         f"got {raw!r}")
    return value
