"""An NN rank script for test_nn_worker_ports: once both ranks joined the gloo process
group, rank 0 writes every TCP socket in LISTEN state of torchrun (its parent) and of the
ranks (torchrun's children) to ``<out>/listening.json`` as ``[pid, hex address]`` pairs
(/proc/net/tcp{,6} notation), then both ranks leave together."""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


def listening() -> list[list]:
    agent = os.getppid()
    inodes: dict[str, int] = {}
    for pid in [agent, *children(agent)]:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:   # LISTEN
                found.append([inodes[cols[9]], cols[1]])
    return found


dist.init_process_group("gloo")
if dist.get_rank() == 0:
    Path(sys.argv[1], "listening.json").write_text(json.dumps(listening()))
dist.barrier()
dist.destroy_process_group()
