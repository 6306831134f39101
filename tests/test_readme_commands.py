"""The commands README.md gives are commands that work: every benchmark line names a script
that exists and only flags that script defines (a README flag that the script rejects is a
broken promise to a new user)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _benchmark_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [line.split("#")[0].strip() for line in text.splitlines()
            if line.startswith("python3 load_tests/")]


def test_readme_benchmark_commands_use_flags_the_scripts_define():
    lines = _benchmark_lines()
    assert len(lines) >= 4, "the README's benchmark block moved: update this test"
    for line in lines:
        words = line.split()
        script = ROOT / words[1]
        assert script.is_file(), f"README runs {words[1]}, which does not exist"
        source = script.read_text()
        for flag in (w for w in words[2:] if w.startswith("--")):
            assert re.search(rf"add_argument\(\s*[\"']{re.escape(flag)}[\"']", source), (
                f"README runs `{line}`, but {words[1]} defines no {flag} option")
