"""The stages import one way only: a module may import from its own package and from the stages
before it, never from a later one (docs/architecture.md draws the order)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "freezeframe"

# Each stage may use every stage on an earlier line.
STAGES: list[set[str]] = [
    {"_version", "errors", "sizes", "containers"},
    {"modes"},
    {"config", "config_fields", "batch", "stats", "planning", "planning_search",
     "planning_envelope", "planning_approximate"},
    {"context"},
    {"graphs"},
    {"cache"},
    {"compilation"},
    {"runtime", "ubatch"},
    {"models"},
    {"bench", "cli", "__init__", "__main__", "integrations"},
]


def _stage_of(module: str) -> int:
    parts = module.split(".")
    name = "__init__" if len(parts) == 1 else parts[1]
    for index, stage in enumerate(STAGES):
        if name in stage:
            return index
    raise AssertionError(f"{module}: package {name!r} is in no stage; add it to STAGES")


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every freezeframe module ``path`` imports (at any depth, TYPE_CHECKING included)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "freezeframe":  # from freezeframe import x: x is a module here
                found += [(node.lineno, f"freezeframe.{a.name}") for a in node.names]
            elif node.module.startswith("freezeframe."):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if a.name.startswith("freezeframe.")]
    return found


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts) if parts != ["freezeframe", "__init__"] else "freezeframe"


def test_no_module_imports_from_a_later_stage() -> None:
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        module = _module_name(path)
        here = _stage_of(module)
        for line, target in _imports(path):
            if _stage_of(target) > here:
                upward.append(f"{path.relative_to(SRC.parent)}:{line} imports {target}")
    assert upward == []


def test_every_package_is_in_a_stage() -> None:
    names = {p.stem if p.is_file() else p.name for p in SRC.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists())}
    staged = set().union(*STAGES)
    assert names - staged == set()
