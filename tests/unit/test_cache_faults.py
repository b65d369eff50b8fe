"""The compile cache attacked the way production does: files truncated, overwritten with random
bytes, half deleted, written by several processes at once, a writer killed with SIGKILL, paths
with spaces and non-ASCII. Every start is a fresh process (as a deployment's is), and every
output is compared with eager: each fault is a clean miss (counted) or a clear error, never a
wrong answer and never a start that keeps failing."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

_CHILD = r'''
import json, os, sys, time
import torch
from torch import nn
import freezeframe as ff
from freezeframe.cache import entry as ff_entry

cache_dir, backend = sys.argv[1], sys.argv[2]

if os.environ.get("FF_TEST_HANG_IN_WRITE"):
    real_write = ff_entry.atomic_write  # where CompileCache looks it up
    def hanging_write(path, data):  # half a file on disk, then wait to be killed
        tmp = path.parent / f".{path.name}.killed.tmp"
        tmp.write_bytes(data[: len(data) // 2])
        print("WRITING", flush=True)
        time.sleep(600)
    ff_entry.atomic_write = hanging_write


@torch.library.custom_op("cachefaults::mix", mutates_args=())
def mix(x: torch.Tensor) -> torch.Tensor:
    return x.flip(-1) * 2


@mix.register_fake
def _(x):
    return torch.empty_like(x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(torch.ops.cachefaults.mix(self.a(x))))


torch.manual_seed(0)
module = Model().eval()
cfg = ff.CompilationConfig(mode="piecewise", backend=backend, splitting_ops=["cachefaults::mix"],
                           cudagraph_mode="none", cache_dir=cache_dir)
model = ff.compile(module, cfg)
worst = 0.0
for n in (3, 5, 8):
    x = torch.randn(n, 8)
    with torch.no_grad():
        want = module(x)
    worst = max(worst, float((model(x) - want).abs().max()))
print(json.dumps({"diff": worst, "stats": model.stats.snapshot()}))
'''


def _start(cache_dir: Path, backend: str = "eager", **env: str) -> subprocess.Popen[str]:
    child_env = {k: v for k, v in os.environ.items() if k != "FREEZEFRAME_DISABLE_CACHE"}
    child_env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    child_env.update(env)
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(cache_dir), backend],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env)


def _run(cache_dir: Path, backend: str = "eager") -> dict[str, Any]:
    proc = _start(cache_dir, backend)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    result["log"] = err
    return result


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


def _damage(root: Path, how: str) -> int:
    rng = random.Random(0)
    files = _files(root)
    # half_deleted: every other file the load reads (usage.json, the entry's start counts, is
    # not read to load; counting it would leave the trace and its pointer both in place)
    deleted = [p for p in files if p.name != "usage.json"][::2]
    for path in files:
        data = path.read_bytes()
        if how == "truncate":
            path.write_bytes(data[: len(data) // 2])
        elif how == "random":
            path.write_bytes(rng.randbytes(max(len(data), 16)))
        elif how == "empty":
            path.write_bytes(b"")
        elif how == "half_deleted" and path in deleted:
            path.unlink()
    return len(files)


@pytest.fixture(scope="module")
def cold_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One cold start, in a root whose path has spaces and non-ASCII: the cache every damage
    test copies (each then damages its own copy)."""
    root = tmp_path_factory.mktemp("cold") / "my cache dir — ünïcode"
    return root, _run(root)


def _copy_of(cold: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    copy = tmp_path / cold[0].name  # spaces and non-ASCII too
    shutil.copytree(cold[0], copy)
    return copy


@pytest.mark.parametrize("how", ["truncate", "random", "empty", "half_deleted"])
def test_damaged_cache_files_are_clean_misses_and_get_rewritten(
        cold_cache: tuple[Path, dict[str, Any]], tmp_path: Path, how: str) -> None:
    root = _copy_of(cold_cache, tmp_path)
    assert _damage(root, how) >= 3  # the entry's index, trace and the model pointer
    damaged = _run(root)
    assert damaged["diff"] == 0.0, damaged["log"]
    assert damaged["stats"].get("traces_loaded", 0) == 0  # nothing damaged was trusted
    healed = _run(root)  # the damaged start wrote the cache again
    assert healed["diff"] == 0.0
    assert healed["stats"].get("traces_loaded") == 1


def test_several_processes_starting_at_once_share_one_cache(tmp_path: Path) -> None:
    procs = [_start(tmp_path) for _ in range(3)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["diff"] for r in results] == [0.0, 0.0, 0.0]
    warm = _run(tmp_path)
    assert warm["diff"] == 0.0 and warm["stats"].get("traces_loaded") == 1
    assert [p for p in tmp_path.rglob("*.tmp")] == []


def test_a_writer_killed_mid_write_leaves_a_cache_the_next_start_uses(tmp_path: Path) -> None:
    proc = _start(tmp_path, FF_TEST_HANG_IN_WRITE="1")
    assert proc.stdout is not None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "WRITING" in line or not line:
            break
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert len(list(tmp_path.rglob(".*.killed.tmp"))) == 1  # the half-written file it left
    after = _run(tmp_path)
    assert after["diff"] == 0.0, after["log"]
    again = _run(tmp_path)
    assert again["diff"] == 0.0 and again["stats"].get("traces_loaded") == 1


def test_a_cache_root_with_spaces_and_non_ascii(cold_cache: tuple[Path, dict[str, Any]],
                                               tmp_path: Path) -> None:
    cold = cold_cache[1]
    assert cold["diff"] == 0.0 and cold["stats"]["artifacts_saved"] == 1
    warm = _run(_copy_of(cold_cache, tmp_path))
    assert warm["diff"] == 0.0 and warm["stats"].get("traces_loaded") == 1
