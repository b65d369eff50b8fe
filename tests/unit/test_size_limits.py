"""The house's size limits, as a test: no file in src/ over 600 lines, no function over 60, no
class over 400, and no private name imported from another package (DESIGN.md, "Layout").

A module that outgrows them holds more than one concept; split it where the concepts part
(see docs/architecture.md for each file's one job) rather than raising a limit here.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "freezeframe"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 400


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _over_limits(path: Path, src: Path = SRC) -> list[str]:
    text = path.read_text()
    rel = path.relative_to(src.parent)
    found = []
    lines = text.count("\n")
    if lines > MAX_FILE_LINES:
        found.append(f"{rel}: {lines} lines (limit {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            assert node.end_lineno is not None
            n = node.end_lineno - node.lineno + 1
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            if n > limit:
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                found.append(f"{rel}:{node.lineno}: {kind} {node.name} is {n} lines "
                             f"(limit {limit})")
    return found


def _package(module: str) -> str:
    """The package under freezeframe a module belongs to (``freezeframe.cache.files`` ->
    ``cache``; a top-level module is its own)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _private_imports(path: Path, src: Path = SRC) -> list[str]:
    rel = path.relative_to(src.parent)
    here = _package(".".join(rel.with_suffix("").parts))
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.ImportFrom) and node.module
                and node.module.startswith("freezeframe.") and node.level == 0):
            continue
        if _package(node.module) == here or node.module == "freezeframe._version":
            continue
        private = [a.name for a in node.names if a.name.startswith("_")]
        if any(part.startswith("_") for part in node.module.split(".")[1:]):
            private = [a.name for a in node.names]
        found += [f"{rel}:{node.lineno}: {node.module}.{name}" for name in private]
    return found


def test_the_limits_measure_what_they_say(tmp_path: Path) -> None:
    src = tmp_path / "freezeframe"
    src.mkdir()
    sample = src / "sample.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    sample.write_text(f"def long():\n{body}\n\n\ndef short():\n    return 1\n")
    assert _over_limits(sample, src) == [
        "freezeframe/sample.py:1: function long is 61 lines (limit 60)"]
    sample.write_text("from freezeframe.cache.files import _flock\n"
                      "from freezeframe.errors import ConfigError\n")
    assert _private_imports(sample, src) == [
        "freezeframe/sample.py:1: freezeframe.cache.files._flock"]


def test_no_file_function_or_class_is_over_its_limit() -> None:
    found = [line for path in _sources() for line in _over_limits(path)]
    assert found == []


def test_no_private_name_is_imported_from_another_package() -> None:
    found = [line for path in _sources() for line in _private_imports(path)]
    assert found == []
