"""Type checks run with the tests (STYLE.md habit 10): a mypy error fails the suite.

mypy checks the package as it installs: ``stream_persia`` with the API as
``stream_persia.api``. The API's folder is the top-level ``api/``, mapped to
``stream_persia.api`` by setuptools' package-dir, and mypy cannot follow that mapping (an
editable install makes it with an import hook, which mypy does not run; a plain ``mypy api``
would check it as a top-level ``api``). So the test lays the package out in a temporary
folder, ``stream_persia/`` holding links to each entry of the checkout's ``stream_persia/``
and ``api -> <checkout>/api``, and runs ``mypy -p stream_persia`` there with the checkout's
``setup.cfg`` (the ``[mypy]`` section). Errors name the files as
``stream_persia/api/...``; the cache is the checkout's ``.mypy_cache`` (git ignores it),
which mypy validates by content, so a warm run takes seconds.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def package_as_installed(dest: Path) -> Path:
    """Link ``dest/stream_persia`` to the checkout's package with ``api/`` as its ``api``.

    A checkout may hold a ``stream_persia/api`` link of its own (git ignores it): it is
    replaced by the one to ``api/``, so both layouts check the same files.
    """
    pkg = dest / "stream_persia"
    pkg.mkdir(parents=True)
    for entry in (ROOT / "stream_persia").iterdir():
        if entry.name not in ("api", "__pycache__"):
            (pkg / entry.name).symlink_to(entry)
    (pkg / "api").symlink_to(ROOT / "api", target_is_directory=True)
    return dest


# A cold cache (a fresh clone) reads torch's and numpy's types too: ~45 s of CPU where a
# warm one takes a few seconds, and longer on a loaded machine.
@pytest.mark.timeout(600)
def test_mypy_clean(tmp_path):
    # mypy is in the [test] extra: a missing mypy fails here rather than skipping the check
    assert importlib.util.find_spec("mypy") is not None, (
        "mypy is not installed; `pip install -e '.[test]'` installs it")
    root = package_as_installed(tmp_path / "src")
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}   # the layout decides
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "setup.cfg"),
         "--cache-dir", str(ROOT / ".mypy_cache"), "-p", "stream_persia"],
        cwd=root, env=env, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, f"mypy found errors:\n{proc.stdout}{proc.stderr}"
