"""The ``stream-persia`` console script.

Commands:

- ``launch <role>``: run one role of a job in this process. Roles: ``embedding-server``
  (PERSIA's ``embedding-parameter-server`` is accepted as an alias), ``embedding-worker``,
  ``data-loader``, ``nn-worker`` (the training script under torchrun: ``--nproc-per-node``,
  ``--nnodes``, ``--node-rank``; script from ``PERSIA_NN_WORKER_ENTRY`` by default).
- ``launch api``: the HTTP control plane and online inference (package ``api``; uvicorn).
- ``produce``: stream a dataset file into the samples topic (see ``stream_persia.loader.produce``).
- ``checkpoint inspect DIR [--json] [--verify]``, ``checkpoint list ROOT``: show checkpoints;
  ``checkpoint clean ROOT [--dry-run]``: remove what killed writers left (hidden directories)
  (see ``stream_persia.checkpoint``); exit 2 for a directory that is not a checkpoint.

Settings come from flags, then the environment (PERSIA's variable names: ``PERSIA_EMBEDDING_
CONFIG``, ``PERSIA_GLOBAL_CONFIG``, ``PERSIA_DATALOADER_ENTRY``, ``REPLICA_INDEX``,
``REPLICA_SIZE``; ours: ``PERSIA_EMBEDDING_SERVERS`` and ``PERSIA_EMBEDDING_WORKERS`` as
comma-separated ``host:port`` lists, ``KAFKA_BOOTSTRAP_SERVERS``, ``PERSIA_CHECKPOINT_ROOT``,
``PERSIA_BASE_PORT``, and the job's role secret ``PERSIA_ROLE_SECRET`` /
``PERSIA_ROLE_SECRET_FILE``, which every role needs to listen beyond loopback and every RPC
client presents), then the config files.

Zero-config on one host (:mod:`stream_persia.rpc.local_ports`): an embedding server or
worker given no ``--port`` listens on 127.0.0.1 at its role's well-known port (servers
``PERSIA_BASE_PORT`` + index, workers + 100 + index; base 10000), and a role given no peer
addresses finds its peers there, waiting for them, so PERSIA's Procfile runs as written
with ``persia-launcher`` replaced by ``stream-persia launch``.
Every flag is checked when parsed (:mod:`stream_persia.config.flags`), environment defaults
included, and each role takes only the flags it acts on: a bad one ends the command with
exit status 2 and a message naming it, before anything starts.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from stream_persia.config import flags
from stream_persia.config.global_config import MAX_STORE_THREADS
from stream_persia.core.embedding_config import MAX_CAPACITY
from stream_persia.core.logger import RepeatFilter
from stream_persia.errors import PersiaError
from stream_persia.rpc import local_ports

ROLE_ALIASES = {"embedding-parameter-server": "embedding-server"}
#: Default of ``launch embedding-worker --peer-timeout-s``.
PEER_TIMEOUT_S = 300.0


def _add_replica(p: argparse.ArgumentParser) -> None:
    """``--replica-index``/``--replica-size`` (PERSIA's ``REPLICA_INDEX``/``REPLICA_SIZE``;
    main() checks index < size)."""
    p.add_argument("--replica-index", **flags.env("REPLICA_INDEX", flags.integer(0), "0"),
                   help="index of this replica (env REPLICA_INDEX; default 0)")
    p.add_argument("--replica-size", **flags.env("REPLICA_SIZE", flags.integer(1), "1"),
                   help="number of replicas of this role (env REPLICA_SIZE; default 1)")


def _add_base_port(p: argparse.ArgumentParser) -> None:
    """``--base-port`` (env ``PERSIA_BASE_PORT``): where the well-known local ports start."""
    p.add_argument("--base-port",
                   **flags.env(local_ports.BASE_PORT_ENV,
                               flags.integer(local_ports.MIN_BASE_PORT,
                                             local_ports.MAX_BASE_PORT),
                               str(local_ports.DEFAULT_BASE_PORT)),
                   help="first of the job's well-known local ports: embedding server i "
                        "listens on base+i, embedding worker i on base+100+i, when started "
                        "with no --port, and roles given no addresses look for them there "
                        f"(env {local_ports.BASE_PORT_ENV}; default "
                        f"{local_ports.DEFAULT_BASE_PORT}; the same for every role of a job)")


def _add_listen(p: argparse.ArgumentParser, *, metrics: bool = True) -> None:
    """The RPC address a server role listens on, its metrics port and ready file."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=flags.port(), default=None,
                   help="RPC port, 0-65535 (0: any free port; default: this replica's "
                        "well-known local port, see --base-port)")
    if metrics:
        p.add_argument("--metrics-port", type=flags.port(zero="any free port, logged"),
                       default=None,
                       help="serve Prometheus metrics on this port (default: off)")
    p.add_argument("--ready-file", type=flags.nonempty, default=None,
                   help="write host:port here once listening (used by `run` and tests)")


def _add_common(p: argparse.ArgumentParser) -> None:
    _add_replica(p)
    _add_configs(p)
    _add_listen(p)
    _add_base_port(p)


def _add_checkpoint_root(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--checkpoint-root", type=flags.nonempty,
                   default=(os.environ.get("PERSIA_CHECKPOINT_ROOT")
                            or os.environ.get("PERSIA_CHECKPOINT_DIR") or None),
                   help=f"local directory or fsspec URL prefix of the job's checkpoints: {what} "
                        "(env PERSIA_CHECKPOINT_ROOT, else PERSIA_CHECKPOINT_DIR; none: "
                        "checkpoint requests are refused)")


def _add_configs(p: argparse.ArgumentParser) -> None:
    """The config paths and log level every role takes (PERSIA's variables)."""
    p.add_argument("--embedding-config",
                   **flags.env("PERSIA_EMBEDDING_CONFIG", flags.nonempty, None),
                   help="embedding_config.yml (env PERSIA_EMBEDDING_CONFIG)")
    p.add_argument("--global-config", **flags.env("PERSIA_GLOBAL_CONFIG", flags.nonempty, None),
                   help="global_config.yml (env PERSIA_GLOBAL_CONFIG)")
    _add_log_level(p, "info")


def _add_log_level(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--log-level", **flags.env("LOG_LEVEL", flags.log_level, default),
                   help=f"{', '.join(flags.LOG_LEVELS)} (env LOG_LEVEL; default {default})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stream-persia", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    launch = sub.add_parser("launch", help="run one role of a job in this process")
    roles = launch.add_subparsers(dest="role", required=True)

    es = roles.add_parser("embedding-server", aliases=["embedding-parameter-server"],
                          help="one shard of the embedding tables")
    _add_common(es)
    es.add_argument("--capacity", type=flags.integer(1, MAX_CAPACITY), default=None,
                    help=f"max embedding vectors on this shard, 1-{MAX_CAPACITY} (default: "
                         "global config embedding_parameter_server_config.capacity)")
    es.add_argument("--store-threads", type=flags.integer(1, MAX_STORE_THREADS), default=None,
                    help="internal shards of the store, each on its own thread: one per core "
                         "the server may use (default: global config "
                         "embedding_parameter_server_config.store_threads, 1)")
    _add_checkpoint_root(es, "dump and load read and write only below it")

    ew = roles.add_parser("embedding-worker", help="consumes samples, serves NN workers")
    _add_common(ew)
    ew.add_argument("--embedding-servers",
                    **flags.env("PERSIA_EMBEDDING_SERVERS", flags.addresses, None),
                    help="comma-separated host:port of every embedding server, in order "
                         "(env PERSIA_EMBEDDING_SERVERS; none: the servers' well-known "
                         "local ports, see --base-port)")
    ew.add_argument("--peer-timeout-s", type=flags.number(0, lo_open=True),
                    default=PEER_TIMEOUT_S,
                    help="with no --embedding-servers: longest wait for the servers to "
                         f"answer on their well-known ports (default {PEER_TIMEOUT_S:g})")
    ew.add_argument("--kafka", type=flags.addresses, default=None,
                    help="Kafka bootstrap servers (env KAFKA_BOOTSTRAP_SERVERS, then the "
                         "global config); none: broker-less, data loaders push over RPC")
    ew.add_argument("--topic", type=flags.topic, default=None,
                    help="samples topic (default: global config)")
    ew.add_argument("--num-partitions", type=flags.integer(1), default=None,
                    help="partitions of the samples topic (default: read from the broker)")
    _add_checkpoint_root(ew, "checkpoints requested through its mailbox go only below it")
    ew.add_argument("--on-data-loss", choices=("fail", "skip"), default=None,
                    help="samples the broker no longer has (retention, gaps): fail = stop "
                         "that partition and report it, skip = count the loss and read on "
                         "(default: kafka.on_data_loss of the global config, fail)")

    # A data loader listens on nothing: no --host/--port/--metrics-port/--ready-file.
    dl = roles.add_parser("data-loader", help="run a data loader script (DataCtx producer)")
    _add_replica(dl)
    _add_configs(dl)
    dl.add_argument("entry", nargs="?", default=os.environ.get("PERSIA_DATALOADER_ENTRY"),
                    help="the data loader script (env PERSIA_DATALOADER_ENTRY)")
    dl.add_argument("--embedding-workers",
                    **flags.env("PERSIA_EMBEDDING_WORKERS", flags.addresses, None),
                    help="broker-less mode: host:port of the embedding workers (env "
                         "PERSIA_EMBEDDING_WORKERS; none: their well-known local ports)")
    _add_base_port(dl)
    dl.add_argument("--kafka", type=flags.addresses, default=None,
                    help="Kafka bootstrap servers")

    # The API is one process with its own /metrics: no replica or metrics-port flags.
    ap = roles.add_parser("api", help="HTTP control plane and online inference (uvicorn)")
    _add_configs(ap)
    _add_listen(ap, metrics=False)
    ap.set_defaults(host=None, port=None)   # None: api.host / api.port of the global config
    ap.set_defaults(replica_index=0, replica_size=1)
    ap.add_argument("--embedding-workers",
                    **flags.env("PERSIA_EMBEDDING_WORKERS", flags.addresses, None),
                    help="host:port of the embedding workers (env PERSIA_EMBEDDING_WORKERS)")
    ap.add_argument("--embedding-servers",
                    **flags.env("PERSIA_EMBEDDING_SERVERS", flags.addresses, None),
                    help="host:port of the embedding servers, in replica order "
                         "(env PERSIA_EMBEDDING_SERVERS)")
    ap.add_argument("--checkpoint-dir", type=flags.nonempty, default=None,
                    help="where checkpoints started over HTTP go (env PERSIA_CHECKPOINT_DIR)")
    ap.add_argument("--model", type=flags.nonempty, default=None,
                    help="checkpoint to serve at start-up (env PERSIA_API_MODEL)")
    ap.add_argument("--model-class", type=flags.nonempty, default=None,
                    help="module:Class of the dense model for checkpoints without "
                         "jit_dense.pt (env PERSIA_API_MODEL_CLASS)")
    ap.add_argument("--embeddings", choices=("auto", "workers", "local", "replica"),
                    default=None,
                    help="served embeddings: through the workers, loaded from the "
                         "checkpoint into this process, or (replica) loaded from the newest "
                         "checkpoint and then following training's updates "
                         "(env PERSIA_API_EMBEDDINGS)")
    ap.add_argument("--table-rows", type=flags.integer(1), default=None,
                    help="replica: most embedding rows held, LRU beyond (env "
                         "PERSIA_API_TABLE_ROWS; default: the servers' capacity together)")
    ap.add_argument("--predict-auth", action="store_true",
                    help="require the bearer token on /v1/predict too "
                         "(env PERSIA_API_PREDICT_AUTH=1)")
    ap.add_argument("--batch-wait-ms", type=flags.number(0, 1000), default=None,
                    help="micro-batching: longest wait for concurrent requests, 0-1000 "
                         "(default 2)")
    ap.add_argument("--max-batch-rows", type=flags.integer(1), default=None,
                    help="micro-batching: most samples in one forward pass (default 1024)")

    nw = roles.add_parser("nn-worker", help="run the training script with torchrun (DDP)")
    nw.set_defaults(replica_index=0, replica_size=1)
    nw.add_argument("entry", nargs="?", default=os.environ.get("PERSIA_NN_WORKER_ENTRY"),
                    help="the training script (env PERSIA_NN_WORKER_ENTRY); its own "
                         "arguments go after `--`")
    # Arguments for the script follow `--` (split off in main(): argparse cannot tell them
    # from this command's options when they come after the positional script path).
    nw.set_defaults(script_args=[])
    nw.add_argument("--nproc-per-node", **flags.env("NPROC_PER_NODE", flags.integer(1), "1"),
                    help="processes (ranks) on this node, one per GPU (env NPROC_PER_NODE; "
                         "default 1)")
    nw.add_argument("--nnodes", **flags.env("NNODES", flags.integer(1), "1"),
                    help="number of NN worker nodes (env NNODES; default 1)")
    nw.add_argument("--node-rank", **flags.env("NODE_RANK", flags.integer(0), "0"),
                    help="index of this node, below --nnodes (env NODE_RANK; default 0)")
    nw.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR") or "127.0.0.1",
                    help="rendezvous host: node 0's address (env MASTER_ADDR)")
    nw.add_argument("--master-port",
                    **flags.env("MASTER_PORT", flags.port(zero="a free port, one node only"),
                                "0"),
                    help="rendezvous port (env MASTER_PORT; one node: a free port)")
    nw.add_argument("--embedding-workers",
                    **flags.env("PERSIA_EMBEDDING_WORKERS", flags.addresses, None),
                    help="host:port of the embedding workers (env PERSIA_EMBEDDING_WORKERS; "
                         "none: their well-known local ports)")
    _add_base_port(nw)
    nw.add_argument("--drain-timeout-s", type=flags.number(0, lo_open=True), default=60.0,
                    help="on SIGTERM/SIGINT: longest wait for the ranks to stop at a step "
                         "boundary and finish before torchrun is stopped (default 60)")
    _add_configs(nw)

    from stream_persia.loader import produce

    produce.add_arguments(sub.add_parser(
        "produce", help="stream a dataset file (CSV/TSV/npz) through a mapping into a job"))

    from stream_persia.checkpoint import command as checkpoint_command

    checkpoint_command.add_parser(sub)

    from stream_persia.launch import run, run_args

    rp = sub.add_parser("run", help="run every role of a topology on this machine, end to end",
                        description=run.__doc__.split("\n\n")[0])
    run_args.add_arguments(rp)
    _add_log_level(rp, "warning")
    return parser


def _split(raw: str | None) -> list[str]:
    """A checked ``host:port,...`` flag (:func:`stream_persia.config.flags.addresses`) as a list."""
    return [a for a in (raw or "").split(",") if a]


def check_launch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse types cannot check alone (a flag against another); exit 2 on error."""
    if not args.replica_index < args.replica_size:
        parser.error(f"argument --replica-index: --replica-index {args.replica_index} must be "
                     f"in [0, --replica-size={args.replica_size}) (flags or REPLICA_INDEX / "
                     "REPLICA_SIZE)")
    if args.role == "nn-worker" and not args.node_rank < args.nnodes:
        parser.error(f"argument --node-rank: --node-rank {args.node_rank} must be below "
                     f"--nnodes {args.nnodes} (flags or NODE_RANK / NNODES)")
    if args.role == "nn-worker" and args.nnodes > 1 and not args.master_port:
        parser.error("argument --master-port: needed with --nnodes > 1 (every node must use "
                     "the same rendezvous port; flag or MASTER_PORT)")
    if args.role == "embedding-server" and args.capacity is not None \
            and args.store_threads is not None and args.store_threads > args.capacity:
        parser.error(f"argument --store-threads: {args.store_threads} store threads cannot "
                     f"share a capacity of {args.capacity} rows (each holds at least one)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if argv[:2] == ["launch", "nn-worker"] and "--" in argv:
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if script_args:
        args.script_args = script_args
    if args.command == "launch":
        check_launch(parser, args)
    root, before = logging.getLogger(), set(logging.getLogger().handlers)
    logging.basicConfig(
        level=flags.level_of(args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in set(root.handlers) - before:   # ours only: a dead broker's flood of one
        handler.addFilter(RepeatFilter())        # line (not a host's, e.g. pytest's)
    try:
        if args.command == "launch":
            from stream_persia.launch import roles as launch

            role = ROLE_ALIASES.get(args.role, args.role)
            for name in ("embedding_servers", "embedding_workers"):
                if hasattr(args, name):
                    setattr(args, name, _split(getattr(args, name)))
            if hasattr(args, "base_port"):
                # For what the role starts (the scripts' DataCtx / TrainCtx, torchrun's ranks).
                os.environ[local_ports.BASE_PORT_ENV] = str(args.base_port)
            args.well_known_port = role in local_ports.ROLE_OFFSETS and args.port is None
            if args.well_known_port:
                args.port = local_ports.well_known_port(role, args.replica_index,
                                                        args.base_port)
            return launch.ROLES[role](args)
        if args.command == "produce":
            from stream_persia.loader import produce

            return produce.main(args)
        if args.command == "checkpoint" and args.checkpoint_command == "compact":
            from stream_persia.server import compaction

            return compaction.main(args)
        if args.command == "checkpoint":
            from stream_persia.checkpoint import command as checkpoint_command

            return checkpoint_command.run(args)
        if args.command == "run":
            from stream_persia.launch import run

            return run.main(args)
    except PersiaError as e:
        print(f"stream-persia: {e}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
