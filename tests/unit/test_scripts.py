"""The checkout's scripts run the way the docs run them: ``python scripts/NAME.py`` from the
repository root, without PYTHONPATH (they import ``tests.helpers``, which no install provides)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# the README and the docs pages (docs/runner.md names these two)
DOCS = "\n".join(p.read_text(encoding="utf-8")
                 for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])


@pytest.mark.parametrize("script", ["capture_policies.py", "call_overhead.py", "count_calls.py"])
def test_script_runs_as_the_readme_runs_it(script: str) -> None:
    commands = re.findall(r"`(python scripts/[\w.]+)`", DOCS)
    command = f"python scripts/{script}"
    assert command in commands  # the docs' own words
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # --help: the imports run, the benchmark does not
    proc = subprocess.run([sys.executable, *command.split()[1:], "--help"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.startswith(f"usage: {script} [-h]")
