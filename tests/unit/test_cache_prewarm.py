"""``freezeframe cache prewarm`` fills the cache for a config and a built-in model in a separate
step, and ``freezeframe cache list/info`` show each entry's starts, piece hits and misses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import freezeframe as ff
from freezeframe.cache import entry as ff_entry
from freezeframe.cache import files as ff_files
from freezeframe.cache import inspect as ff_inspect
from freezeframe.cli import main
from freezeframe.models.prewarm import prewarm_spec


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ff_files.ENV_DISABLE_CACHE, raising=False)
    monkeypatch.delenv(ff_files.ENV_CACHE_DIR, raising=False)


CONFIG = '{"backend": "eager", "cudagraph_mode": "none", "max_num_tokens": 64}'


def test_prewarm_then_a_start_loads_what_it_saved(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "c"
    assert main(["cache", "prewarm", CONFIG, "--model", "example", "--layers", "3",
                 "--dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert "prewarmed example (ExampleMLP) with backend eager" in out
    assert ("pieces: 4 capturable, 3 distinct; compiles: 3; piece hits: 0, misses: 0; "
            "saved trace loaded: no; files saved: 1") in out
    (entry,) = ff_inspect.list_entries(root)
    assert entry.has_trace and entry.usage["starts"] == 1 and entry.usage["trace_loads"] == 0

    # a later process builds the same spec with the same config: Dynamo does not run
    spec = prewarm_spec("example", layers=3)
    cfg = ff.CompilationConfig(mode="piecewise", backend="eager", cudagraph_mode="none",
                               max_num_tokens=64, splitting_ops=["freezeframe_example::mix"],
                               cache_dir=str(root))
    model = ff.compile(spec.module, cfg, dynamic_arg_dims=spec.dynamic_arg_dims)
    with model.stats.expect(traces_loaded=1, artifacts_saved=0):
        got = spec.first_call(model)
    x = spec.module.example_input(5)
    with torch.no_grad():
        assert torch.equal(got, spec.module(x))
    assert ff_inspect.read_usage(entry.path) | {"last_used": None} == {
        "starts": 2, "trace_loads": 1, "hits": 0, "misses": 0, "last_used": None}

    assert main(["cache", "list", "--dir", str(root)]) == 0
    listing = capsys.readouterr().out
    assert "starts   hits  misses" in listing
    row = next(line for line in listing.splitlines() if line.startswith(entry.key))
    assert row.split()[1:3] == ["0", "yes"] and row.split()[5:8] == ["2", "0", "0"]
    assert main(["cache", "info", entry.key, "--dir", str(root)]) == 0
    assert ("starts: 2 (1 loaded the saved trace); piece hits: 0, misses: 0"
            in capsys.readouterr().out)


def test_usage_adds_up_hits_and_misses_per_start(tmp_path: Path) -> None:
    cfg = ff.CompilationConfig(backend="inductor", cache_dir=str(tmp_path))
    for hits, misses in ((0, 3), (3, 0)):
        cache = ff_entry.CompileCache.open(cfg, model_key="usage")
        assert cache is not None
        cache.save_artifact(0, (1, 8), b"x")  # the entry exists once something is saved
        for _ in range(hits):
            cache.record_hit()
        for _ in range(misses):
            cache.record_miss()
        cache.record_start(trace_loaded=hits > 0)
    (entry,) = ff_inspect.list_entries(tmp_path)
    usage = entry.usage
    assert (usage["starts"], usage["trace_loads"], usage["hits"], usage["misses"]) == (2, 1, 3, 3)
    # an unreadable usage file reads as zeros, and the next start rewrites it
    (entry.path / "usage.json").write_text("{not json")
    assert ff_inspect.read_usage(entry.path)["starts"] == 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "gpt"], "argument --model: invalid choice: 'gpt'"),
    (["--layers", "0"], "--layers: must be at least 1, got 0"),
    (['{"use_cache": false}'], "use_cache is false, so there is no cache to fill"),
    (["[1, 2]"], "config: expected a JSON object, got list"),
    (["{nope"], "config: not valid JSON"),
])
def test_prewarm_refuses_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       argv: list[str], message: str) -> None:
    assert main(["cache", "prewarm", *argv, "--dir", str(tmp_path / "c")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
