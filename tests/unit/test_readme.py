"""Every code block in README.md and the docs pages works as written, and every link resolves.

The pages: README.md, every ``docs/*.md`` page, and ``docs/architecture.md`` or a
``docs/results/`` page only where it holds a ```python or ```bash block (they hold plain
illustrations and recorded output otherwise).

* A ```python block runs in a fresh interpreter (a subprocess, in an empty directory) and must
  exit 0; when the next block is a ```text block preceded by ``<!-- output -->``, the python
  block's stdout must equal it exactly.
* A python block that truly cannot run here (it needs CUDA, say) is preceded, on the line right
  before its fence, by ``<!-- not-run: REASON -->``; it must still compile. A block that
  imports Hugging Face ``transformers`` (the optional ``hf`` extra, installed in CI) is skipped
  where it is not installed. No other block is skipped.
* A ```bash block's ``freezeframe ...`` lines must parse with the CLI's own parser; the quick
  ones (``config``, ``demo``) are run and must exit 0.
* The two commands (``make bench``, ``make test``) are the README's first bash block: Makefile
  targets whose recipes, as ``make -n`` prints them, run ``freezeframe bench --preset tiny`` and
  ``pytest -q -n auto --dist loadfile`` in the project's virtualenv.
* Every relative link in README.md and ``docs/*.md`` (``[text](path)``, ``[text](path#anchor)``,
  ``[text](#anchor)``, outside code) names a file or folder that exists, and an anchor names a
  heading of the page it points into.
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
from urllib.parse import unquote

import pytest

from freezeframe import cli

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"

LANGUAGES = ("python", "bash", "text")
NOT_RUN = re.compile(r"<!-- not-run: (?P<reason>\S.*?) -->")
OUTPUT_MARKER = "<!-- output -->"
QUICK_COMMANDS = ("config", "demo")
TIMEOUT_S = 240
# Pages moved out of the README: their blocks must stay checked.
MOVED_PAGES = ("guarantees.md", "cache.md", "runner.md", "micro_batching.md", "planning.md",
               "status.md", "configuration.md", "hf.md", "torch_compile.md", "cli.md")


@dataclasses.dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    marker: str  # the line right before the opening fence, stripped
    page: str = "README.md"  # the page, relative to the repository root

    @property
    def not_run_reason(self) -> str | None:
        match = NOT_RUN.fullmatch(self.marker)
        return match.group("reason") if match else None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse_blocks(text: str, page: str = "README.md") -> list[Block]:
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
            raise AssertionError(f"{page} line {start + 1}: unclosed code fence")
        blocks.append(Block(lang=match.group(1), code="\n".join(body) + "\n", line=start + 1,
                            marker=lines[start - 1].strip() if start else "", page=page))
        i += 1
    return blocks


def expected_outputs(blocks: list[Block]) -> dict[int, str]:
    """python block line -> the stdout its ``<!-- output -->`` text block documents."""
    out: dict[int, str] = {}
    for prev, block in itertools.pairwise(blocks):
        if block.marker == OUTPUT_MARKER:
            assert block.lang == "text" and prev.lang == "python", (
                f"{block.where}: {OUTPUT_MARKER} must mark a ```text block right after a "
                "```python block")
            out[prev.line] = block.code
    return out


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _runs_code(path: Path) -> bool:
    return any(b.lang in ("python", "bash") for b in parse_blocks(path.read_text(), _rel(path)))


def code_pages() -> list[Path]:
    """README.md, every docs/*.md page but architecture.md, and architecture.md and the
    docs/results/ pages where they hold python or bash blocks."""
    pages = [README]
    for path in sorted(DOCS.glob("*.md")):
        if path.name != "architecture.md" or _runs_code(path):
            pages.append(path)
    pages += [p for p in sorted((DOCS / "results").rglob("*.md")) if _runs_code(p)]
    return pages


PAGES = code_pages()
PAGE_BLOCKS = {_rel(p): parse_blocks(p.read_text(), _rel(p)) for p in PAGES}
PAGE_OUTPUTS = {page: expected_outputs(blocks) for page, blocks in PAGE_BLOCKS.items()}
ALL_BLOCKS = [b for blocks in PAGE_BLOCKS.values() for b in blocks]
PYTHON = [b for b in ALL_BLOCKS if b.lang == "python"]
BASH = [b for b in ALL_BLOCKS if b.lang == "bash"]
README_BLOCKS = PAGE_BLOCKS["README.md"]
README_PYTHON = [b for b in README_BLOCKS if b.lang == "python"]
README_BASH = [b for b in README_BLOCKS if b.lang == "bash"]


def test_pages_checked() -> None:
    checked = set(PAGE_BLOCKS)
    assert {f"docs/{name}" for name in MOVED_PAGES} <= checked
    # Every page under docs/ with a block that runs is checked.
    for path in sorted(DOCS.rglob("*.md")):
        if _runs_code(path):
            assert _rel(path) in checked, _rel(path)


def test_readme_layout() -> None:
    # a front page: the two commands, the runnable example and the command line (the other
    # front doors' examples live on their pages, checked here too)
    assert len(README_PYTHON) >= 1 and len(README_BASH) >= 2
    assert len(README.read_text().splitlines()) <= 170


@pytest.mark.parametrize("page", list(PAGE_BLOCKS))
def test_page_layout(page: str) -> None:
    blocks = PAGE_BLOCKS[page]
    assert [b.where for b in blocks if b.lang not in LANGUAGES] == [], (
        f"{page}: every fenced block is ```python, ```bash or ```text")
    # A not-run marker sits right before a python fence, and nowhere else.
    text = (REPO / page).read_text().splitlines()
    markers = [i + 1 for i, line in enumerate(text) if "not-run" in line]
    marked = [b.line - 1 for b in blocks if b.lang == "python" and b.not_run_reason is not None]
    assert markers == marked, page
    for block in blocks:
        if block.lang == "python" and block.not_run_reason is not None:
            assert block.line not in PAGE_OUTPUTS[page], (
                f"{block.where}: a block that is not run cannot document output")


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


@pytest.mark.parametrize("block", PYTHON, ids=[b.where for b in PYTHON])
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    compile(block.code, block.where, "exec")
    if block.not_run_reason is not None:
        return  # marked <!-- not-run: ... --> (compiled above, like every block)
    if re.search(r"^\s*(import|from) transformers\b", block.code, re.MULTILINE) \
            and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs Hugging Face transformers (pip install -e '.[hf]')")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    env.pop("FREEZEFRAME_DEBUG", None)
    proc = subprocess.run([sys.executable, "-"], input=block.code, capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{block.where} failed:\n{proc.stderr[-4000:]}"
    outputs = PAGE_OUTPUTS[block.page]
    if block.line in outputs:
        assert proc.stdout == outputs[block.line], f"{block.where}: the documented output differs"


def _freezeframe_commands(block: Block) -> list[list[str]]:
    commands = []
    for line in block.code.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] == "freezeframe":
            commands.append(words[1:])
    return commands


@pytest.mark.parametrize("block", BASH, ids=[b.where for b in BASH])
def test_bash_block_commands_parse(block: Block, capsys: pytest.CaptureFixture[str]) -> None:
    commands = _freezeframe_commands(block)
    for argv in commands:
        parser = cli.build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{block.where}: `freezeframe {shlex.join(argv)}` does not "
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
                f"{block.where}: unexpected command {line!r}")
    assert sum(len(_freezeframe_commands(b)) for b in README_BASH) >= 3
    assert sum(len(_freezeframe_commands(b)) for b in BASH) >= 5


# ---------------------------------------------------------------------------- links

LINK_PAGES = [README, *sorted(DOCS.glob("*.md"))]
INLINE_LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
REFERENCE_LINK = re.compile(r"^[ \t]{0,3}\[[^\]]+]:[ \t]+(?P<target>\S+)", re.MULTILINE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose(text: str) -> str:
    """The text outside fenced blocks and inline code spans (each line kept, for line numbers)."""
    lines = text.splitlines()
    out: list[str] = []
    fenced = False
    for line in lines:
        if re.match(r"^\s*```", line):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "``", line))
    return "\n".join(out)


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings (lower case, punctuation dropped, spaces to
    hyphens, a repeated heading numbered -1, -2, ...)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose(text.replace("`", "")).splitlines():
        match = re.match(r"^#{1,6}\s+(?P<title>.+?)\s*#*\s*$", line)
        if match is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group("title").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def relative_links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every link that is neither a URL nor an e-mail address."""
    links = []
    prose = _prose(text)
    for pattern in (INLINE_LINK, REFERENCE_LINK):
        for match in pattern.finditer(prose):
            target = match.group("target").strip("<>")
            if SCHEME.match(target):
                continue
            links.append((prose.count("\n", 0, match.start()) + 1, target))
    return sorted(links)


def test_link_helpers() -> None:
    page = "\n".join([
        "# The `torch.compile` backend", "## The runner's contract", "## Usage", "## Usage",
        "See [a](docs/x.md#y), [b](#usage-1), ![c](img.png \"title\") and [d](https://e.org).",
        "`[not](a-link.md)`", "```", "[nor](this.md)", "```", "[ref]: ../other.md",
    ])
    assert heading_anchors(page) == {"the-torchcompile-backend", "the-runners-contract",
                                     "usage", "usage-1"}
    assert relative_links(page) == [(5, "#usage-1"), (5, "docs/x.md#y"), (5, "img.png"),
                                    (10, "../other.md")]


@pytest.mark.parametrize("page", LINK_PAGES, ids=[_rel(p) for p in LINK_PAGES])
def test_relative_links_resolve(page: Path) -> None:
    text = page.read_text()
    links = relative_links(text)
    broken = []
    for line, target in links:
        path_part, _, anchor = target.partition("#")
        path = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not path.exists():
            broken.append(f"{_rel(page)}:{line}: {target} (no such file)")
        elif anchor and path.suffix == ".md" and path.is_file() \
                and unquote(anchor) not in heading_anchors(path.read_text()):
            broken.append(f"{_rel(page)}:{line}: {target} (no heading #{anchor} in "
                          f"{path.relative_to(REPO).as_posix()})")
    assert broken == [], "\n".join(broken)
    if page == README:
        # The README's "Where to read next" links every docs page.
        linked = {(page.parent / t.partition("#")[0]).resolve() for _, t in links}
        assert {p.resolve() for p in DOCS.glob("*.md")} <= linked


# ---------------------------------------------------------------------------- the two commands

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
    # "## The two commands" opens the README after its intro, and its first block is theirs.
    headings = [line for line in README.read_text().splitlines() if line.startswith("## ")]
    assert headings[0] == "## The two commands"
    first = README_BASH[0]
    assert first is README_BLOCKS[0]
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
                           f"{venv_bin / 'python'} -m pytest -q -n auto --dist loadfile ;"), test
