"""Every code block in README.md works as written.

* A ```python block runs in a fresh interpreter (a subprocess, in an empty directory) and must
  exit 0; when the next block is a ```text block preceded by ``<!-- output -->``, the python
  block's stdout must equal it exactly.
* A python block that truly cannot run here (it needs CUDA, say) is preceded, on the line right
  before its fence, by ``<!-- not-run: REASON -->``; it must still compile. A block that
  imports Hugging Face ``transformers`` (the optional ``hf`` extra, installed in CI) is skipped
  where it is not installed. No other block is skipped.
* A ```bash block's ``freezeframe ...`` lines must parse with the CLI's own parser; the quick
  ones (``config``, ``demo``) are run and must exit 0.
* The two commands (``make bench``, ``make test``) are Makefile targets whose recipes, as
  ``make -n`` prints them, run ``freezeframe bench --preset tiny`` and ``pytest -q`` in the
  project's virtualenv.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from freezeframe import cli

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

LANGUAGES = ("python", "bash", "text")
NOT_RUN = re.compile(r"<!-- not-run: (?P<reason>\S.*?) -->")
OUTPUT_MARKER = "<!-- output -->"
QUICK_COMMANDS = ("config", "demo")
TIMEOUT_S = 240


@dataclasses.dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    marker: str  # the line right before the opening fence, stripped

    @property
    def not_run_reason(self) -> str | None:
        match = NOT_RUN.fullmatch(self.marker)
        return match.group("reason") if match else None


def parse_blocks(text: str) -> list[Block]:
    """The fenced blocks of a markdown text, in order."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = re.fullmatch(r"```(\S*)\s*", lines[i])
        if match is None:
            i += 1
            continue
        start = i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"README line {start + 1}: unclosed code fence")
        blocks.append(Block(lang=match.group(1), code="\n".join(body) + "\n", line=start + 1,
                            marker=lines[start - 1].strip() if start else ""))
        i += 1
    return blocks


def expected_outputs(blocks: list[Block]) -> dict[int, str]:
    """python block line -> the stdout its ``<!-- output -->`` text block documents."""
    out: dict[int, str] = {}
    for prev, block in itertools.pairwise(blocks):
        if block.marker == OUTPUT_MARKER:
            assert block.lang == "text" and prev.lang == "python", (
                f"README line {block.line}: {OUTPUT_MARKER} must mark a ```text block right "
                "after a ```python block")
            out[prev.line] = block.code
    return out


BLOCKS = parse_blocks(README.read_text())
PYTHON = [b for b in BLOCKS if b.lang == "python"]
BASH = [b for b in BLOCKS if b.lang == "bash"]
OUTPUTS = expected_outputs(BLOCKS)


def test_readme_layout() -> None:
    assert [b.lang for b in BLOCKS if b.lang not in LANGUAGES] == []
    assert len(PYTHON) >= 4 and len(BASH) >= 2
    # A not-run marker sits right before a python fence, and nowhere else.
    text = README.read_text().splitlines()
    markers = [i + 1 for i, line in enumerate(text) if "not-run" in line]
    marked = [b.line - 1 for b in PYTHON if b.not_run_reason is not None]
    assert markers == marked
    for block in PYTHON:
        if block.not_run_reason is not None:
            assert block.line not in OUTPUTS, "a block that is not run cannot document output"


def test_parse_blocks_markers_and_outputs() -> None:
    text = "\n".join([
        "intro", "```python", "print(1)", "```", "", OUTPUT_MARKER, "```text", "1", "```",
        "<!-- not-run: needs CUDA -->", "```python", "torch.cuda.init()", "```",
        "<!-- not-run: needs CUDA -->", "", "```python", "x = 1", "```",
    ])
    blocks = parse_blocks(text)
    assert [(b.lang, b.line, b.not_run_reason) for b in blocks] == [
        ("python", 2, None), ("text", 7, None), ("python", 11, "needs CUDA"),
        ("python", 16, None),  # a blank line between marker and fence: not marked
    ]
    assert expected_outputs(blocks) == {2: "1\n"}


@pytest.mark.parametrize("block", PYTHON, ids=[f"README.md:{b.line}" for b in PYTHON])
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    compile(block.code, f"README.md:{block.line}", "exec")
    if block.not_run_reason is not None:
        return  # marked <!-- not-run: ... --> (compiled above, like every block)
    if re.search(r"^\s*(import|from) transformers\b", block.code, re.MULTILINE) \
            and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs Hugging Face transformers (pip install -e '.[hf]')")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    env.pop("FREEZEFRAME_DEBUG", None)
    proc = subprocess.run([sys.executable, "-"], input=block.code, capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"README.md:{block.line} failed:\n{proc.stderr[-4000:]}"
    if block.line in OUTPUTS:
        assert proc.stdout == OUTPUTS[block.line]


def _freezeframe_commands(block: Block) -> list[list[str]]:
    commands = []
    for line in block.code.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] == "freezeframe":
            commands.append(words[1:])
    return commands


@pytest.mark.parametrize("block", BASH, ids=[f"README.md:{b.line}" for b in BASH])
def test_bash_block_commands_parse(block: Block, capsys: pytest.CaptureFixture[str]) -> None:
    commands = _freezeframe_commands(block)
    for argv in commands:
        parser = cli.build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"README.md:{block.line}: `freezeframe {shlex.join(argv)}` does not "
                        f"parse: {capsys.readouterr().err}")
        assert getattr(args, "func", None) is not None
        if args.command in QUICK_COMMANDS:
            code = cli.main(argv)
            captured = capsys.readouterr()
            assert code == 0, f"`freezeframe {shlex.join(argv)}` failed: {captured.err}"


def test_every_bash_block_names_a_command() -> None:
    for block in BASH:
        for line in block.code.splitlines():
            words = shlex.split(line, comments=True)
            assert not words or words[0] in ("freezeframe", "python3", "pip", "make"), (
                f"README.md:{block.line}: unexpected command {line!r}")
    assert sum(len(_freezeframe_commands(b)) for b in BASH) >= 4


# The Makefile's knobs, cleared from the environment so the dry run shows the defaults.
# MAKELEVEL and MAKEFLAGS too: under `make test` they would make this make print its directory.
MAKE_KNOBS = ("PYTHON", "VENV", "EXTRAS", "TESTS", "PYTEST_ARGS", "BENCH_ARGS", "MAKEFLAGS",
              "MAKELEVEL", "MFLAGS")


def _make_dry_run(target: str) -> str:
    """What ``make TARGET`` runs, the set-up aside (-o: the install stamp counts as up to date)."""
    make = shutil.which("make")
    assert make is not None, "the README's two commands need make (GNU make) on PATH"
    env = {k: v for k, v in os.environ.items() if k not in MAKE_KNOBS}
    proc = subprocess.run([make, "-n", "--no-print-directory", "-o",
                           ".venv/.freezeframe-installed", target], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"make -n {target}: {proc.stderr}"
    return proc.stdout


def test_two_commands_are_make_targets_running_the_main_job_and_the_tests() -> None:
    first = BASH[0]
    make_lines = [shlex.split(line, comments=True) for line in first.code.splitlines()]
    assert make_lines == [["make", "bench"], ["make", "test"]]

    venv_bin = REPO / ".venv" / "bin"
    bench = shlex.split(_make_dry_run("bench"))
    assert bench[:2] == [f'PATH={venv_bin}:$PATH', f"VIRTUAL_ENV={REPO / '.venv'}"]
    assert bench[2:] == ["freezeframe", "bench", "--preset", "tiny"]
    args = cli.build_parser().parse_args(bench[3:])
    assert (args.command, args.preset) == ("bench", "tiny")

    test = _make_dry_run("test").splitlines()[0]
    assert test.startswith(f'PATH="{venv_bin}:$PATH" VIRTUAL_ENV="{REPO / ".venv"}" '
                           f"{venv_bin / 'python'} -m pytest -q ;"), test
