"""What the matrix's seed tests share within one pytest session: each fast-tier seed's case and
outcome, which the refusal floor (test_matrix.py) reads instead of running the seeds again."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def matrix_outcomes() -> dict[int, Any]:
    """seed -> (case, outcome) of the seeds this session ran (tier fast)."""
    return {}
