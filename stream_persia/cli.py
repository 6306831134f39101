"""The ``stream-persia`` console script.

Commands:

- ``launch <role>``: run one role of a job in this process. Roles: ``embedding-server``
  (PERSIA's ``embedding-parameter-server`` is accepted as an alias), ``embedding-worker``,
  ``data-loader``.
- ``produce``: stream a dataset file into the samples topic (see ``stream_persia.produce``).

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
    p.add_argument("--embedding-config", default=os.environ.get("PERSIA_EMBEDDING_CONFIG"),
                   help="embedding_config.yml (env PERSIA_EMBEDDING_CONFIG)")
    p.add_argument("--global-config", default=os.environ.get("PERSIA_GLOBAL_CONFIG"),
                   help="global_config.yml (env PERSIA_GLOBAL_CONFIG)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="RPC port (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (default: off)")
    p.add_argument("--ready-file", default=None,
                   help="write host:port here once listening (used by `run` and tests)")
    p.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "info"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stream-persia", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    launch = sub.add_parser("launch", help="run one role of a job in this process")
    roles = launch.add_subparsers(dest="role", required=True)

    es = roles.add_parser("embedding-server", aliases=["embedding-parameter-server"],
                          help="one shard of the embedding tables")
    _add_common(es)
    es.add_argument("--capacity", type=int, default=None,
                    help="max embedding vectors on this shard (default: global config)")

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

    dl = roles.add_parser("data-loader", help="run a data loader script (DataCtx producer)")
    _add_common(dl)
    dl.add_argument("entry", nargs="?", default=os.environ.get("PERSIA_DATALOADER_ENTRY"),
                    help="the data loader script (env PERSIA_DATALOADER_ENTRY)")
    dl.add_argument("--embedding-workers", default=os.environ.get("PERSIA_EMBEDDING_WORKERS"),
                    help="broker-less mode: host:port of the embedding workers")
    dl.add_argument("--kafka", default=None, help="Kafka bootstrap servers")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
            if role == "data-loader":
                args.embedding_workers = _addresses(args.embedding_workers,
                                                    "--embedding-workers")
            return launch.ROLES[role](args)
    except PersiaError as e:
        print(f"stream-persia: {e}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
