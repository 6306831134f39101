"""``stream-persia checkpoint inspect DIR [--json] [--verify]`` and ``checkpoint list ROOT``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from stream_persia.checkpoint.manifest import Manifest
from stream_persia.checkpoint.reader import list_checkpoints, read_manifest, verify
from stream_persia.config import flags


def add_parser(sub: Any) -> None:
    """Add the ``checkpoint`` command to the console script's sub-parsers."""
    ck = sub.add_parser("checkpoint", help="inspect and list checkpoints")
    cmds = ck.add_subparsers(dest="checkpoint_command", required=True)
    ins = cmds.add_parser("inspect", help="print a checkpoint's manifest")
    ins.add_argument("dir", help="checkpoint directory (local path or fsspec URL)")
    ins.add_argument("--json", action="store_true", help="print the manifest as JSON")
    ins.add_argument("--verify", action="store_true",
                     help="recompute every file's sha256 (exit 2 on a mismatch)")
    ls = cmds.add_parser("list", help="list the complete checkpoints under a root")
    ls.add_argument("root", help="directory holding checkpoint directories")
    ls.add_argument("--json", action="store_true", help="print the manifests as JSON")
    for p in (ins, ls):
        p.add_argument("--log-level", type=flags.log_level, default="warning",
                       help="debug, info, warning, error, critical (default warning)")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run a parsed ``checkpoint`` command; ``BadInput`` propagates (exit 2 in ``main``)."""
    out = out or sys.stdout
    if args.checkpoint_command == "inspect":
        manifest = read_manifest(args.dir)
        if args.verify:
            verify(args.dir)
        if args.json:
            print(json.dumps(manifest.to_dict(), indent=2), file=out)
        else:
            print(summary(manifest), file=out)
            if args.verify:
                print(f"verified: {len(manifest.files)} file(s) match their checksums", file=out)
        return 0
    found = list_checkpoints(args.root)
    if args.json:
        print(json.dumps([{"path": m.path, **m.to_dict()} for m in found], indent=2), file=out)
    elif not found:
        print(f"no complete checkpoints under {args.root}", file=out)
    else:
        print(f"{'STEP':>10}  {'CREATED':<20}  {'JOB':<16} {'SHARDS':>6} {'ROWS':>12}  PATH",
              file=out)
        for m in found:
            print(f"{m.step:>10}  {m.created_at:<20}  {m.job:<16} {m.shard_count:>6} "
                  f"{m.rows:>12,}  {m.path}", file=out)
    return 0


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def summary(m: Manifest) -> str:
    """A human summary of a manifest."""
    lines = [f"checkpoint {m.path}",
             f"  job:           {m.job}",
             f"  step:          {m.step}",
             f"  created:       {m.created_at}",
             f"  stream:        {m.stream}",
             f"  config digest: {m.config_digest or '-'}",
             f"  format:        {m.format_version}"]
    if m.offsets:
        lines.append("  offsets (next to consume):")
        for topic, parts in m.offsets.items():
            for p, o in parts.items():
                lines.append(f"    {topic}[{p}] = {o}")
    else:
        lines.append("  offsets:       none")
    lines.append(f"  embedding shards: {m.shard_count} ({m.rows:,} rows)")
    if m.server_config is not None:
        lines.append(f"  server config: {m.server_config['digest']} (optimizer "
                     f"{json.dumps(m.server_config['optimizer'], sort_keys=True)})")
    roles = {m.dense_filename: "dense", m.opt_filename: "optimizer",
             m.jit_filename: "jit"}
    lines.append(f"  files ({len(m.files)}, {_size(sum(e['bytes'] for e in m.files.values()))}):")
    width = max((len(n) for n in m.files), default=0)
    for name, e in sorted(m.files.items()):
        what = f"{e['rows']:,} rows" if "rows" in e else roles.get(name, "")
        lines.append(f"    {name:<{width}}  {_size(e['bytes']):>10}  {e['sha256'][:12]}  {what}"
                     .rstrip())
    if m.extra:
        lines.append(f"  extra: {json.dumps(m.extra, sort_keys=True)}")
    return "\n".join(lines)
