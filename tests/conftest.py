"""Test-suite wiring: the ``cuda`` marker skips on machines without a GPU.

Nothing global is registered here beyond that; shared toy models and ops live in tests/helpers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


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
