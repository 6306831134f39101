"""The ``stream-persia`` console script.

Commands:

- ``launch <role>``: run one role of a job in this process. Roles: ``embedding-server``
  (PERSIA's ``embedding-parameter-server`` is accepted as an alias), ``embedding-worker``,
  ``data-loader``, ``nn-worker`` (the training script under torchrun: ``--nproc-per-node``,
  ``--nnodes``, ``--node-rank``; script from ``PERSIA_NN_WORKER_ENTRY`` by default).
- ``launch api``: the HTTP control plane and online inference (package ``api``; uvicorn).
- ``produce``: stream a dataset file into the samples topic (see ``stream_persia.produce``).
- ``checkpoint inspect DIR [--json] [--verify]``, ``checkpoint list ROOT``: show checkpoints
  (see ``stream_persia.checkpoint``); exit 2 for a directory that is not a checkpoint.

Settings come from flags, then the environment (PERSIA's variable names: ``PERSIA_EMBEDDING_
CONFIG``, ``PERSIA_GLOBAL_CONFIG``, ``PERSIA_DATALOADER_ENTRY``, ``REPLICA_INDEX``,
``REPLICA_SIZE``; ours: ``PERSIA_EMBEDDING_SERVERS`` and ``PERSIA_EMBEDDING_WORKERS`` as
comma-separated ``host:port`` lists, ``KAFKA_BOOTSTRAP_SERVERS``), then the config files.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from stream_persia.errors import PersiaError

ROLE_ALIASES = {"embedding-parameter-server": "embedding-server"}


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(
            f"stream-persia: environment variable {name}={raw!r} is not an integer") from None


def _positive_int(raw: str) -> int:
    """An argparse type: an integer >= 1 (argparse names the flag in its error)."""
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {raw!r}")
    return value


def _addresses(raw: str | None, flag: str) -> list[str]:
    if not raw:
        return []
    out = [a.strip() for a in raw.split(",") if a.strip()]
    for a in out:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit() or not (0 < int(port) < 65536):
            raise SystemExit(f"stream-persia: {flag}: {a!r} is not host:port")
    return out


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica-index", type=int, default=_env_int("REPLICA_INDEX", 0),
                   help="index of this replica (env REPLICA_INDEX; default 0)")
    p.add_argument("--replica-size", type=int, default=_env_int("REPLICA_SIZE", 1),
                   help="number of replicas of this role (env REPLICA_SIZE; default 1)")
    _add_configs(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="RPC port (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (default: off)")
    p.add_argument("--ready-file", default=None,
                   help="write host:port here once listening (used by `run` and tests)")


def _add_configs(p: argparse.ArgumentParser) -> None:
    """The config paths and log level every role takes (PERSIA's variables)."""
    p.add_argument("--embedding-config", default=os.environ.get("PERSIA_EMBEDDING_CONFIG"),
                   help="embedding_config.yml (env PERSIA_EMBEDDING_CONFIG)")
    p.add_argument("--global-config", default=os.environ.get("PERSIA_GLOBAL_CONFIG"),
                   help="global_config.yml (env PERSIA_GLOBAL_CONFIG)")
    p.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "info"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stream-persia", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    launch = sub.add_parser("launch", help="run one role of a job in this process")
    roles = launch.add_subparsers(dest="role", required=True)

    es = roles.add_parser("embedding-server", aliases=["embedding-parameter-server"],
                          help="one shard of the embedding tables")
    _add_common(es)
    es.add_argument("--capacity", type=_positive_int, default=None,
                    help="max embedding vectors on this shard (default: global config)")
    es.add_argument("--store-threads", type=_positive_int, default=None,
                    help="internal shards of the store, each on its own thread: one per core "
                         "the server may use (default: global config "
                         "embedding_parameter_server_config.store_threads, 1)")

    ew = roles.add_parser("embedding-worker", help="consumes samples, serves NN workers")
    _add_common(ew)
    ew.add_argument("--embedding-servers", default=os.environ.get("PERSIA_EMBEDDING_SERVERS"),
                    help="comma-separated host:port of every embedding server, in order "
                         "(env PERSIA_EMBEDDING_SERVERS)")
    ew.add_argument("--kafka", default=None,
                    help="Kafka bootstrap servers (env KAFKA_BOOTSTRAP_SERVERS, then the "
                         "global config); none: broker-less, data loaders push over RPC")
    ew.add_argument("--topic", default=None, help="samples topic (default: global config)")
    ew.add_argument("--num-partitions", type=int, default=None,
                    help="partitions of the samples topic (default: read from the broker)")
    ew.add_argument("--on-data-loss", choices=("fail", "skip"), default=None,
                    help="samples the broker no longer has (retention, gaps): fail = stop "
                         "that partition and report it, skip = count the loss and read on "
                         "(default: kafka.on_data_loss of the global config, fail)")

    dl = roles.add_parser("data-loader", help="run a data loader script (DataCtx producer)")
    _add_common(dl)
    dl.add_argument("entry", nargs="?", default=os.environ.get("PERSIA_DATALOADER_ENTRY"),
                    help="the data loader script (env PERSIA_DATALOADER_ENTRY)")
    dl.add_argument("--embedding-workers", default=os.environ.get("PERSIA_EMBEDDING_WORKERS"),
                    help="broker-less mode: host:port of the embedding workers")
    dl.add_argument("--kafka", default=None, help="Kafka bootstrap servers")

    ap = roles.add_parser("api", help="HTTP control plane and online inference (uvicorn)")
    _add_common(ap)
    ap.set_defaults(host=None, port=None)   # None: api.host / api.port of the global config
    ap.add_argument("--embedding-workers", default=os.environ.get("PERSIA_EMBEDDING_WORKERS"),
                    help="host:port of the embedding workers (env PERSIA_EMBEDDING_WORKERS)")
    ap.add_argument("--embedding-servers", default=os.environ.get("PERSIA_EMBEDDING_SERVERS"),
                    help="host:port of the embedding servers, in replica order "
                         "(env PERSIA_EMBEDDING_SERVERS)")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="where checkpoints started over HTTP go (env PERSIA_CHECKPOINT_DIR)")
    ap.add_argument("--model", default=None,
                    help="checkpoint to serve at start-up (env PERSIA_API_MODEL)")
    ap.add_argument("--model-class", default=None,
                    help="module:Class of the dense model for checkpoints without "
                         "jit_dense.pt (env PERSIA_API_MODEL_CLASS)")
    ap.add_argument("--embeddings", choices=("auto", "workers", "local"), default=None,
                    help="served embeddings: through the workers, or loaded from the "
                         "checkpoint into this process (env PERSIA_API_EMBEDDINGS)")
    ap.add_argument("--predict-auth", action="store_true",
                    help="require the bearer token on /v1/predict too "
                         "(env PERSIA_API_PREDICT_AUTH=1)")
    ap.add_argument("--batch-wait-ms", type=float, default=None,
                    help="micro-batching: longest wait for concurrent requests (default 2)")
    ap.add_argument("--max-batch-rows", type=int, default=None,
                    help="micro-batching: most samples in one forward pass (default 1024)")

    nw = roles.add_parser("nn-worker", help="run the training script with torchrun (DDP)")
    nw.set_defaults(replica_index=0, replica_size=1)
    nw.add_argument("entry", nargs="?", default=os.environ.get("PERSIA_NN_WORKER_ENTRY"),
                    help="the training script (env PERSIA_NN_WORKER_ENTRY); its own "
                         "arguments go after `--`")
    # Arguments for the script follow `--` (split off in main(): argparse cannot tell them
    # from this command's options when they come after the positional script path).
    nw.set_defaults(script_args=[])
    nw.add_argument("--nproc-per-node", type=int, default=_env_int("NPROC_PER_NODE", 1),
                    help="processes (ranks) on this node, one per GPU (default 1)")
    nw.add_argument("--nnodes", type=int, default=_env_int("NNODES", 1),
                    help="number of NN worker nodes (default 1)")
    nw.add_argument("--node-rank", type=int, default=_env_int("NODE_RANK", 0),
                    help="index of this node (default 0)")
    nw.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                    help="rendezvous host: node 0's address (env MASTER_ADDR)")
    nw.add_argument("--master-port", type=int, default=_env_int("MASTER_PORT", 0),
                    help="rendezvous port (env MASTER_PORT; one node: a free port)")
    nw.add_argument("--embedding-workers", default=os.environ.get("PERSIA_EMBEDDING_WORKERS"),
                    help="host:port of the embedding workers (env PERSIA_EMBEDDING_WORKERS)")
    _add_configs(nw)

    from stream_persia import produce

    produce.add_arguments(sub.add_parser(
        "produce", help="stream a dataset file (CSV/TSV/npz) through a mapping into a job"))

    from stream_persia.checkpoint import command as checkpoint_command

    checkpoint_command.add_parser(sub)

    from stream_persia import run

    rp = sub.add_parser("run", help="run every role of a topology on this machine, end to end",
                        description=run.__doc__.split("\n\n")[0])
    run.add_arguments(rp)
    rp.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "warning"))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if argv[:2] == ["launch", "nn-worker"] and "--" in argv:
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    if script_args:
        args.script_args = script_args
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "launch":
            from stream_persia import launch

            role = ROLE_ALIASES.get(args.role, args.role)
            if not (0 <= args.replica_index < args.replica_size):
                raise SystemExit(f"stream-persia: --replica-index {args.replica_index} must be "
                                 f"in [0, --replica-size={args.replica_size})")
            if role == "embedding-worker":
                args.embedding_servers = _addresses(args.embedding_servers,
                                                    "--embedding-servers")
            if role in ("data-loader", "nn-worker"):
                args.embedding_workers = _addresses(args.embedding_workers,
                                                    "--embedding-workers")
            if role == "api":
                args.embedding_workers = _addresses(args.embedding_workers,
                                                    "--embedding-workers")
                args.embedding_servers = _addresses(args.embedding_servers,
                                                    "--embedding-servers")
            return launch.ROLES[role](args)
        if args.command == "produce":
            from stream_persia import produce

            return produce.main(args)
        if args.command == "checkpoint":
            from stream_persia.checkpoint import command as checkpoint_command

            return checkpoint_command.run(args)
        if args.command == "run":
            from stream_persia import run

            return run.main(args)
    except PersiaError as e:
        print(f"stream-persia: {e}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
