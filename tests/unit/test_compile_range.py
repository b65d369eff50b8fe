"""``current_compile_range()``: the range of the piece being compiled, ``None`` otherwise.

The Inductor path (a custom pass reading it per range and size) is in
tests/integration/test_inductor_passes.py; here, the context variable's rules."""

from __future__ import annotations

import contextvars
import threading

import pytest
import torch

import freezeframe as ff
from freezeframe.compilation import compilers, current_compile_range
from freezeframe.models.example import MIX_OP, ExampleMLP
from freezeframe.sizes import Range


def test_public_name_is_the_compilers_function() -> None:
    assert current_compile_range is compilers.current_compile_range
    assert current_compile_range() is None


def test_set_inside_a_compile_and_reset_after_it_also_on_error() -> None:
    with compilers._compiling(Range(1, 8)):
        assert current_compile_range() == Range(1, 8)
        with compilers._compiling(Range(4, 4)):
            assert current_compile_range() == Range(4, 4)
        assert current_compile_range() == Range(1, 8)
    assert current_compile_range() is None
    with pytest.raises(RuntimeError, match="compile failed"), \
            compilers._compiling(Range(9, 64)):
        raise RuntimeError("compile failed")
    assert current_compile_range() is None


def test_another_thread_does_not_see_this_threads_range() -> None:
    seen: list[Range | None] = []
    with compilers._compiling(Range(1, 8)):
        thread = threading.Thread(target=lambda: seen.append(current_compile_range()))
        thread.start()
        thread.join()
        copied = contextvars.copy_context().run(current_compile_range)
    assert seen == [None]
    assert copied == Range(1, 8)


def test_none_after_a_whole_compile() -> None:
    module = ExampleMLP(hidden_size=8).eval()
    model = ff.compile(module, ff.CompilationConfig(backend="eager", splitting_ops=[MIX_OP],
                                                    compile_ranges_endpoints=[4],
                                                    use_cache=False))
    x = torch.randn(3, 8)
    assert torch.equal(model(x), module(x))
    assert current_compile_range() is None
