"""``stream-persia checkpoint inspect DIR [--json] [--verify]``, ``checkpoint list ROOT
[--json]``, ``checkpoint clean ROOT`` and ``checkpoint compact SRC [--dst DIR]``.

Chains (incremental checkpoints): ``inspect`` shows the chain a restore of DIR reads (base
first, each member's step, rows after it, bytes and why it is a base if it was asked to be
a patch), and ``--verify`` checks every file of every member; ``--json`` adds
``chain_members`` (the same, base first) to the manifest when it has a ``chain``. ``list``
shows each checkpoint's kind (``base``/``patch``/``full``: no chain recorded), parent,
depth and bytes, with a patch's line marked under its base's; ``--json`` adds ``id`` and
``bytes`` to each manifest. ``clean ROOT [--dry-run]`` removes what killed writers left
under ROOT (:mod:`stream_persia.checkpoint.leftovers`). ``compact`` is :mod:`stream_persia.server.compaction`'s (the
console script runs it: this layer does not read shard files).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TextIO

from stream_persia.checkpoint._common import Location
from stream_persia.checkpoint.leftovers import IDLE_S, STALE_S, find_leftovers, sweep_abandoned
from stream_persia.checkpoint.manifest import Manifest
from stream_persia.checkpoint.reader import chain_of, list_checkpoints, read_manifest, verify
from stream_persia.config import flags
from stream_persia.errors import BadInput


def add_parser(sub: Any) -> None:
    """Add the ``checkpoint`` command to the console script's sub-parsers."""
    ck = sub.add_parser("checkpoint", help="inspect and list checkpoints")
    cmds = ck.add_subparsers(dest="checkpoint_command", required=True)
    ins = cmds.add_parser("inspect", help="print a checkpoint's manifest")
    ins.add_argument("dir", type=flags.nonempty, help="checkpoint directory (local path or fsspec URL)")
    ins.add_argument("--json", action="store_true", help="print the manifest as JSON")
    ins.add_argument("--verify", action="store_true",
                     help="recompute every file's sha256 (exit 2 on a mismatch)")
    ls = cmds.add_parser("list", help="list the complete checkpoints under a root")
    ls.add_argument("root", type=flags.nonempty, help="directory holding checkpoint directories")
    ls.add_argument("--json", action="store_true", help="print the manifests as JSON")
    cmp = cmds.add_parser("compact", help="compact a chain (a base and its patches) into a "
                                          "new full base, offline")
    # its arguments and its run are the server package's (it reads shard files):
    # stream_persia.server.compaction, which the console script dispatches to
    cmp.add_argument("src", type=flags.nonempty, help="a checkpoint of the chain (local path or fsspec URL): the "
                                 "chain up to it is compacted")
    cmp.add_argument("--dst", type=flags.nonempty, default=None,
                     help="the new base's directory (default: SRC's sibling "
                          "<name>-compacted); must not exist")
    cmp.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    cl = cmds.add_parser("clean", help="remove what killed writers left under a root (hidden "
                                       "staging, replaced and half-deleted checkpoints)")
    cl.add_argument("root", type=flags.nonempty,
                    help="local directory holding checkpoint directories")
    cl.add_argument("--dry-run", action="store_true",
                    help="list every leftover and what would be removed; remove nothing")
    cl.add_argument("--idle-s", type=flags.number(0.0), default=IDLE_S,
                    help="seconds unchanged after which a leftover whose writer is known "
                         f"to be gone is removed (default {IDLE_S:.0f})")
    cl.add_argument("--stale-s", type=flags.number(0.0), default=STALE_S,
                    help="seconds unchanged after which any staging directory is taken "
                         f"as abandoned (default {STALE_S:.0f})")
    for p in (ins, ls, cmp, cl):
        p.add_argument("--log-level", type=flags.log_level, default="warning",
                       help="debug, info, warning, error, critical (default warning)")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run a parsed ``checkpoint`` command; ``BadInput`` propagates (exit 2 in ``main``)."""
    out = out or sys.stdout
    if args.checkpoint_command == "inspect":
        manifest = read_manifest(args.dir)
        if args.verify:
            verify(args.dir)   # every member of its chain
        members, broken = _members(manifest, args.dir)
        if args.json:
            d = manifest.to_dict()
            if manifest.chain is not None:
                d["chain_members"] = members
            print(json.dumps(d, indent=2), file=out)
        else:
            print(summary(manifest), file=out)
            if manifest.chain is not None:
                print(chain_summary(members, broken), file=out)
            if args.verify:
                files = sum(len(m["files"]) for m in members) if members else len(manifest.files)
                print(f"verified: {files} file(s) of {max(len(members), 1)} checkpoint(s) "
                      "match their checksums", file=out)
        return 0
    if args.checkpoint_command == "clean":
        return _clean(args, out)
    found = list_checkpoints(args.root)
    if args.json:
        print(json.dumps([{"path": m.path, "id": Location(m.path or "").name,
                           "bytes": size_of(m), **m.to_dict()} for m in found], indent=2),
              file=out)
    elif not found:
        print(f"no complete checkpoints under {args.root}", file=out)
    else:
        print(f"{'STEP':>10}  {'CREATED':<27}  {'JOB':<12} {'SHARDS':>6} {'ROWS':>12} "
              f"{'SIZE':>10}  {'KIND':<5} {'DEPTH':>5}  {'PARENT':<24} PATH", file=out)
        for m in _grouped(found):
            c = m.chain
            kind = "full" if c is None else "patch" if c["parent"] else "base"
            mark = "  └ " if c is not None and c["parent"] else ""
            print(f"{m.step:>10}  {m.created_at:<27}  {m.job:<12} {m.shard_count:>6} "
                  f"{m.table_rows:>12,} {_size(size_of(m)):>10}  {kind:<5} "
                  f"{'-' if c is None else c['depth']:>5}  "
                  f"{(c or {}).get('parent') or '-':<24} {mark}{m.path}", file=out)
    return 0


def _clean(args: argparse.Namespace, out: TextIO) -> int:
    root = Location(args.root)
    if not root.local:
        raise BadInput(f"checkpoint clean: {args.root} is not a local directory (remote roots "
                       "have no hidden leftovers: their writers write in place)", field="root")
    if os.path.exists(root.path) and not os.path.isdir(root.path):
        raise BadInput(f"checkpoint clean: {args.root} is not a directory", field="root")
    found = find_leftovers(root.path, idle_s=args.idle_s, stale_s=args.stale_s)
    removed = {lo.path for lo in sweep_abandoned(root.path, idle_s=args.idle_s,
                                                 stale_s=args.stale_s, dry_run=args.dry_run)}
    if not found:
        print(f"no leftovers under {root.path}", file=out)
    for lo in found:
        what = ("would remove" if args.dry_run else "removed") if lo.path in removed \
            else "kept"
        print(f"{what:<12}  {lo.kind:<8}  {lo.path}  ({lo.why})", file=out)
    return 0


def size_of(m: Manifest) -> int:
    """Bytes of one checkpoint's files, as its manifest records them (a patch's own, not
    its chain's)."""
    return sum(int(e["bytes"]) for e in m.files.values())


def _members(manifest: Manifest, src: str) -> tuple[list[dict[str, Any]], str | None]:
    """The chain a restore of ``manifest`` reads, base first, as dicts (and why it is
    broken: then the members from the first readable one on, this one last)."""
    try:
        chain, broken = chain_of(manifest.path or src), None
    except BadInput as e:
        chain, broken = [manifest], e.message
    return [{"id": Location(m.path or "").name, "path": m.path, "step": m.step,
             "depth": (m.chain or {}).get("depth"), "parent": (m.chain or {}).get("parent"),
             "rows": m.table_rows, "rows_in_files": m.rows, "bytes": size_of(m),
             "full_because": (m.chain or {}).get("full_because"),
             "created_at": m.created_at, "files": sorted(m.files)}
            for m in chain], broken


def chain_summary(members: list[dict[str, Any]], broken: str | None = None) -> str:
    """The chain of a checkpoint, base first: one line per member."""
    total = sum(m["bytes"] for m in members)
    lines = [f"  chain ({len(members)} checkpoint(s), {_size(total)}; a restore reads them "
             "in this order):"]
    if broken is not None:
        lines.append(f"    BROKEN: {broken}")
    for m in members:
        arrow = "  " if m["parent"] is None else "→ "
        why = f"  (a base: {m['full_because']})" if m["full_because"] else ""
        lines.append(f"    {arrow}{m['id']}  depth {m['depth']}  step {m['step']}  "
                     f"{m['rows']:,} rows ({m['rows_in_files']:,} in its files)  "
                     f"{_size(m['bytes'])}{why}")
    return "\n".join(lines)


def _grouped(found: list[Manifest]) -> list[Manifest]:
    """``found`` (oldest first) with every chain's members together, after its base, in
    the order of its base (a patch whose base is not under the root stays in place)."""
    names = {Location(m.path or "").name for m in found}
    by_base: dict[str, list[Manifest]] = {}
    order: list[str] = []
    for m in found:
        base = m.chain["base"] if m.chain is not None and m.chain["base"] in names \
            else f"\0{m.path}"
        if base not in by_base:
            by_base[base] = []
            order.append(base)
        by_base[base].append(m)
    return [m for b in order for m in sorted(by_base[b], key=lambda m: (m.chain or {})
                                             .get("depth") or 0)]


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
