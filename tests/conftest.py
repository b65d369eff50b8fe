"""Test-suite wiring: the ``cuda`` marker skips on machines without a GPU.

Nothing global is registered here beyond that and, without CUDA, ``TRITON_INTERPRET=1``;
shared toy models and ops live in tests/helpers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
import torch

# Triton runs CPU tensors only in its interpreter, which is chosen when triton is first imported
# (torch._dynamo imports it): on a machine without CUDA, turn it on before any test module loads,
# so the Triton attention kernel's tests run (freezeframe/models/paged_attention_triton.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items or _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in cuda_items:
        item.add_marker(skip)


@pytest.fixture
def ff_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """``caplog`` recording every freezeframe log record (DEBUG and up), emptied first."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="freezeframe"):
        yield caplog


@pytest.fixture(autouse=True)
def _compile_cache_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never read or write the user's on-disk compile cache, and a trace saved by one
    test is never loaded by another: the cache is off unless a test turns it on (the cache
    tests delete this variable and give a tmp_path cache_dir)."""
    monkeypatch.setenv("FREEZEFRAME_DISABLE_CACHE", "1")
