"""The ``rig`` fixture: every scenario runs once per graph backend present.

``emulated`` runs everywhere; ``cuda`` is marked ``cuda`` (skipped without a GPU). On CUDA each
test runs on a side stream under ``no_grad``, as a model runner does: warm-up, capture and
replay on the same non-default stream (capturing on the legacy default stream is not allowed,
and lazily made per-stream state such as cuBLAS workspaces then exists before capture).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from freezeframe.config import CompilationConfig
from tests.helpers.configs import silly_config


@dataclasses.dataclass(frozen=True)
class Rig:
    """One graph backend and the device its tensors live on."""

    backend: str
    device: str

    def config(self, cudagraph_mode: str = "piecewise", **changes: Any) -> CompilationConfig:
        return silly_config(self.backend, cudagraph_mode, **changes)

    def host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t``, taken after the work that produced it finished. A replayed
        output is overwritten by the next replay (on CUDA by the next replay of *any* graph of
        the model, which shares its pool), so tests compare copies."""
        if t.is_cuda:
            torch.cuda.current_stream().synchronize()
        return t.detach().to("cpu", copy=True)

    def zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, device=self.device)

    def randn(self, *shape: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(self.device)


@pytest.fixture(params=["emulated", pytest.param("cuda", marks=pytest.mark.cuda)])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    if request.param == "emulated":
        yield Rig("emulated", "cpu")
        return
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        yield Rig("cuda", "cuda")
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


@pytest.fixture
def clean(rig: Rig) -> dict[str, Any]:
    """tests.helpers.faults.CLEAN with grad mode as the rig set it: the ``cuda`` rig runs every
    test under ``no_grad``; on ``emulated`` grad is on, as CLEAN says."""
    from tests.helpers.faults import CLEAN

    return dict(CLEAN, grad=torch.is_grad_enabled())


@pytest.fixture
def faults_disarmed() -> Iterator[None]:
    """No fault of tests.helpers.faults armed before or after the test, none recorded as
    fired (the fault files use it for every test)."""
    from tests.helpers.faults import FAULTS

    FAULTS.armed = None
    FAULTS.fired.clear()
    yield
    FAULTS.armed = None

