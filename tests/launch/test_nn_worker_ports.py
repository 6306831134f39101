"""``launch nn-worker`` on one host opens no port beyond loopback: torchrun's rendezvous
store (c10d TCPStore) binds every interface by itself, unauthenticated, whatever
``--master-addr`` says (:mod:`stream_persia.launch.torchrun`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def loopback(hex_address: str) -> bool:
    """Whether a /proc/net/tcp{,6} local address (``HEXIP:PORT``) is a loopback one."""
    ip = hex_address.split(":")[0]
    if len(ip) == 8:                                  # IPv4, little-endian
        return ip[6:8] == "7F"
    words = [ip[i:i + 8] for i in range(0, 32, 8)]    # IPv6: four little-endian words
    if words == ["00000000", "00000000", "00000000", "01000000"]:
        return True                                   # ::1
    return words[:3] == ["00000000", "00000000", "FFFF0000"] and words[3][6:8] == "7F"


def test_one_host_nn_worker_listens_on_loopback_only(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PERSIA_", "MASTER_"))}
    env["PERSIA_NN_WORKER_ENTRY"] = str(HERE / "listening_rank.py")
    out = subprocess.run(
        [sys.executable, "-m", "stream_persia.launch.cli", "launch", "nn-worker",
         "--nproc-per-node", "2", "--", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    found = json.loads((tmp_path / "listening.json").read_text())
    assert found, "torchrun's store at least listens"
    assert [f for f in found if not loopback(f[1])] == [], found
