"""The files that come back from a GPU machine: what ``--out`` holds, rewritten after every
step so that a run stopped at any point leaves them.

The device tool returns at most 8 files from ``$OUT``, 16 MiB each and 64 MiB together, none
deeper than two folders, each named in letters, digits, ``.``, ``_`` and ``-``
(``/work/.library/device/README.md``). ``gpu_check`` writes these into ``--out`` and nothing
else:

* ``README.md``: the report, a table per step (``gpu_report``);
* ``gpu_check.json``: every step's result and figures (``gpu_report``);
* ``bench.json``: the bench's ``results.json``, every mode and row;
* ``console.log``: what ``gpu_check`` printed;
* ``raw.tar.gz``: everything the steps wrote (each test tier's log, which names every test it
  ran, the probes' JSON, the bench's table and plot, the profiler trace), so the file limit
  loses nothing. A member that would take the archive over the per-file limit is left out and
  named in ``gpu_check.json``.

:func:`check_layout` lists what in ``--out`` breaks those limits; ``gpu_check`` fails on it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["LIMITS", "RETURN_FILES", "Limits", "check_layout", "pack"]

RETURN_FILES = ("README.md", "gpu_check.json", "bench.json", "console.log", "raw.tar.gz")
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclasses.dataclass(frozen=True)
class Limits:
    files: int = 8
    file_bytes: int = 16 << 20
    total_bytes: int = 64 << 20
    depth: int = 2  # folders below the out directory


LIMITS = Limits()


def check_layout(out: Path, limits: Limits = LIMITS) -> list[str]:
    """What in ``out`` the return path would not bring back (empty: everything comes back)."""
    problems = []
    files = sorted(p for p in out.rglob("*") if not p.is_dir())
    if len(files) > limits.files:
        problems.append(f"{len(files)} files in {out}, more than the {limits.files} that "
                        "come back")
    total = 0
    for path in files:
        rel = path.relative_to(out)
        if path.is_symlink() or not path.is_file():
            problems.append(f"{rel}: not a plain file")
            continue
        size = path.stat().st_size
        total += size
        if len(rel.parts) - 1 > limits.depth:
            problems.append(f"{rel}: {len(rel.parts) - 1} folders deep, more than "
                            f"{limits.depth}")
        if size > limits.file_bytes:
            problems.append(f"{rel}: {size} bytes, more than {limits.file_bytes}")
        bad = [part for part in rel.parts if not _NAME.match(part)]
        if bad:
            problems.append(f"{rel}: name {bad[0]!r} has characters besides letters, digits, "
                            "'.', '_' and '-'")
    if total > limits.total_bytes:
        problems.append(f"{total} bytes in all, more than {limits.total_bytes}")
    return problems


def _replace(target: Path, write: Callable[[Path], object]) -> None:
    partial = target.with_name(f".{target.name}.partial")
    write(partial)
    os.replace(partial, target)


def pack(raw: Path, out: Path, bench_results: Path | None, console: Sequence[str],
         limits: Limits = LIMITS) -> list[str]:
    """Write ``bench.json``, ``console.log`` and ``raw.tar.gz`` into ``out`` (the report's two
    files are written by the report); returns the members left out of the archive."""
    out.mkdir(parents=True, exist_ok=True)
    if bench_results is not None and bench_results.is_file():
        _replace(out / "bench.json", lambda p: shutil.copyfile(bench_results, p))
    _replace(out / "console.log", lambda p: p.write_text("\n".join(console) + "\n"))
    members = sorted((p for p in raw.rglob("*") if p.is_file()), key=lambda p: str(p))
    left_out: list[str] = []
    while True:
        kept = [p for p in members if str(p.relative_to(raw)) not in left_out]
        _replace(out / "raw.tar.gz", functools.partial(_archive, raw, kept))
        if (out / "raw.tar.gz").stat().st_size <= limits.file_bytes or not kept:
            return left_out
        largest = max(kept, key=lambda p: p.stat().st_size)
        left_out.append(str(largest.relative_to(raw)))


def _archive(raw: Path, members: Sequence[Path], target: Path) -> None:
    """A gzipped tar of ``members`` (files under ``raw``), each under ``raw/`` in it."""
    with tarfile.open(target, "w:gz", compresslevel=6) as tar:
        for path in members:
            tar.add(path, arcname=str(Path("raw") / path.relative_to(raw)))
