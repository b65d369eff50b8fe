"""What the runner scenario files share: the silly model's runner config over sizes [1, 2, 4, 8]
with 12 tokens at most, a runner around it, and comparing host copies."""

from __future__ import annotations

from typing import Any

import torch

import freezeframe as ff
from freezeframe import CompilationConfig
from freezeframe.runtime import GraphRunner, Tokens
from tests.helpers.toy_models import SillyModel
from tests.scenarios.conftest import Rig

SIZES = [1, 2, 4, 8]
MAX_TOKENS = 12


def config(rig: Rig, graph_mode: str, **kw: Any) -> CompilationConfig:
    fields: dict[str, Any] = dict(cudagraph_capture_sizes=SIZES, max_num_tokens=MAX_TOKENS,
                                  max_num_seqs=8)
    fields.update(kw)
    return rig.config(graph_mode, **fields)


def same(rig: Rig, a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` of host copies (a replayed output is overwritten by the next replay)."""
    return torch.equal(rig.host(a), rig.host(b))


def silly_runner(rig: Rig, mode: str, **kw: Any) -> tuple[Any, GraphRunner]:
    """SillyModel compiled with :func:`config` behind an uncaptured runner (one token input of
    width 3)."""
    cfg = config(rig, mode, **kw)
    model = ff.compile(SillyModel().to(rig.device), cfg)
    return model, GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                              progress=False)
