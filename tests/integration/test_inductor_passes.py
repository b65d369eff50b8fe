"""Every compile range and size compiles under its own settings and passes (issue: a custom
pass given through ``inductor_compile_config`` ran for the first range only, and later ranges
reused code Inductor's FX-graph cache held for another range)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import fx, nn

import freezeframe as ff
from freezeframe.compilation.compilers import (
    CUSTOM_PASS_SETTINGS,
    InductorCompiler,
    config_passes,
    current_compile_range,
    pass_identity,
    pass_sources,
)
from freezeframe.sizes import Range
from freezeframe.stats import Stats


def _fn_from(source: str) -> object:
    scope: dict[str, object] = {}
    exec(compile(source, "<typed at a prompt>", "exec"), scope)
    return scope["my_pass"]


def test_a_pass_without_uuid_is_identified_by_its_code_not_its_name() -> None:
    one = _fn_from("def my_pass(graph):\n    return None\n")
    same = _fn_from("def my_pass(graph):\n    return None\n")
    edited = _fn_from("def my_pass(graph):\n    graph.lint()\n")
    assert pass_identity(one) == pass_identity(same)
    assert pass_identity(one) != pass_identity(edited)  # same module and name, other body
    assert "my_pass#" in pass_identity(one)


def test_a_closure_value_is_part_of_the_identity() -> None:
    def make(k: int) -> object:
        def my_pass(graph: fx.Graph) -> None:
            if k > 1:
                graph.lint()
        return my_pass

    assert pass_identity(make(1)) == pass_identity(make(1))
    assert pass_identity(make(1)) != pass_identity(make(2))


def test_a_custom_graph_pass_keeps_its_uuid() -> None:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Versioned(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            return None

        def uuid(self) -> object:
            return "versioned-v3"

    assert pass_identity(Versioned()) == "'versioned-v3'"


@pytest.mark.parametrize("setting", CUSTOM_PASS_SETTINGS)
def test_custom_pass_settings_are_wrapped_per_range(setting: str) -> None:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Fixed(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            return None

        def uuid(self) -> object:
            return "fixed"

    user = Fixed()
    compiler = InductorCompiler(Stats(), {setting: user, "max_autotune": False})
    small, large = compiler._patches(Range(1, 8)), compiler._patches(Range(9, 64))
    assert small["max_autotune"] is False and large["max_autotune"] is False
    assert small[setting] is not user and large[setting] is not user
    assert small[setting].uuid() != large[setting].uuid()  # the FX-graph cache tells them apart
    assert small[setting].uuid() == compiler._patches(Range(1, 8))[setting].uuid()


def test_the_cache_key_covers_passes_given_through_inductor_compile_config() -> None:
    first = _fn_from("def my_pass(graph):\n    return None\n")
    edited = _fn_from("def my_pass(graph):\n    graph.lint()\n")

    def factors(pass_fn: object) -> object:
        cfg = ff.CompilationConfig(backend="inductor",
                                   inductor_compile_config={"post_grad_custom_post_pass": pass_fn})
        return pass_sources(config_passes(cfg))

    assert factors(first) == {
        "inductor_compile_config.post_grad_custom_post_pass": [None, pass_identity(first)]}
    assert factors(first) != factors(edited)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.a(x)) * 2


@pytest.mark.inductor
def test_a_config_pass_runs_for_every_range_and_size(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    # Inductor's own FX-graph cache on, in a fresh directory: the case where a fixed uuid let
    # the second range load the first range's code without running the pass.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    seen: list[Range | None] = []

    class Recorder(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            seen.append(current_compile_range())

        def uuid(self) -> object:
            return "recorder-v1"

    torch.manual_seed(0)
    eager = Mlp()
    cfg = ff.CompilationConfig(mode="piecewise", backend="inductor", use_cache=False,
                               cudagraph_mode="none", max_num_tokens=64,
                               compile_ranges_endpoints=[8], compile_sizes=[4],
                               inductor_compile_config={"post_grad_custom_post_pass": Recorder()})
    model = ff.compile(eager, cfg)
    for n in (6, 4, 12):  # range [1, 8], size 4, range [9, 64]
        x = torch.randn(n, 8)
        torch.testing.assert_close(model(x), eager(x))
    assert sorted(seen, key=lambda r: (r.start, r.end)) == [  # type: ignore[union-attr]
        Range(1, 8), Range(4, 4), Range(9, 64)]
