"""The process of one NN rank: ``torchrun ... -m stream_persia.launch.rank SCRIPT ARGS...``.

``stream-persia launch nn-worker`` has torchrun start every rank through this module, which
runs the user's training script as ``python SCRIPT ARGS`` would (``__main__``, ``sys.argv``,
the script's folder first on ``sys.path``) after arranging how the rank stops
(:mod:`stream_persia.core.lifecycle`): SIGTERM, the node's stop file
(``PERSIA_NN_STOP_FILE``, created by ``launch nn-worker`` when it is asked to stop) or
``torchrun`` disappearing request a drain. While a ``TrainCtx`` is entered the rank then
stops training at the next step boundary (at the same step on every rank), returns its
untrained batches and waits for its gradient pushes, and the script goes on from the end of
its loop; before it, there is nothing to drain and the script is unwound; after it,
training is over and the script finishes its own work. Either way the rank exits 0. This module imports nothing heavy, so a stop that comes while the script
still imports torch is handled too.

Logging is set up as in every other role (``LOG_LEVEL``, which ``launch nn-worker`` sets
from its ``--log-level``; info by default), so what stream-persia logs in a rank (a periodic
checkpoint's line, say) reaches the role's log. A script that configures logging itself
calls ``logging.basicConfig(..., force=True)``.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
from pathlib import Path

from stream_persia.core.lifecycle import STOP_FILE_ENV, StopRequested, drain


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m stream_persia.launch.rank SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    entry = Path(argv[0])
    level = os.environ.get("LOG_LEVEL", "info").strip().upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        # A stop file present already raises StopRequested right here.
        drain.install(stop_file=os.environ.get(STOP_FILE_ENV) or None,
                      watch_parent=os.getppid())
        sys.argv = [str(entry), *argv[1:]]
        sys.path.insert(0, str(entry.parent.resolve()))
        runpy.run_path(str(entry), run_name="__main__")
    except StopRequested as stop:
        print(f"stream-persia rank {os.environ.get('RANK', '0')}: stopped ({stop.reason}) "
              "outside training: nothing to drain", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
