"""A copy of a compiled model (copy.copy, copy.deepcopy, pickle, torch.save) is a new compiled
model of the module, or of a copy of it, with the same settings; nothing compiled is shared, so
each answers as eager on its own module and keeps its own stats."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.compilation import CompiledModel
from tests.helpers.silly import attention


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return attention(self.lin(x), x, x) * 2


def _config() -> ff.CompilationConfig:
    return ff.CompilationConfig(mode="piecewise", backend="eager", cudagraph_mode="none",
                                splitting_ops=["silly::attention"], use_cache=False)


def _through_torch_save(model: Any) -> Any:
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES: dict[str, Callable[[Any], Any]] = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "torch.save": _through_torch_save,
}


@pytest.mark.parametrize("how", list(COPIES))
def test_a_deep_copy_of_a_warm_model_is_compiled_anew_over_its_own_module(how: str) -> None:
    module = Net().eval()
    model = ff.compile(module, _config(), model_key="net", inference_mode=True)
    x = torch.randn(3, 4)
    for _ in range(3):
        model(x)
    twin = COPIES[how](model)
    assert type(twin) is CompiledModel and twin.module is not module
    assert (twin.config, twin.model_key, twin.inference_mode) == (model.config, "net", True)
    assert twin.stats.graphs_traced == 0  # nothing compiled came along
    with torch.no_grad():
        twin.module.lin.weight.mul_(3)  # the copy's weights only
        for n in (3, 5):
            y = torch.randn(n, 4)
            torch.testing.assert_close(twin(y), twin.module(y), rtol=0, atol=0)
            torch.testing.assert_close(model(y), module(y), rtol=0, atol=0)
    assert twin.stats.graphs_traced == 1
    assert not torch.equal(twin(x), model(x))


def test_a_shallow_copy_shares_the_module_but_no_compiled_state() -> None:
    module = Net()
    model = ff.compile(module, _config())
    x = torch.randn(3, 4)
    model(x)
    twin = copy.copy(model)
    assert twin.module is module and twin.stats is not model.stats
    torch.testing.assert_close(twin(x), module(x), rtol=0, atol=0)
    assert (twin.stats.graphs_traced, model.stats.graphs_traced) == (1, 1)


def test_hooks_and_the_train_flag_of_the_compiled_model_come_along() -> None:
    module = Net()
    model = ff.compile(module, _config())
    model.eval()
    model.register_forward_hook(lambda m, args, out: out + 1)
    twin = copy.deepcopy(model)
    x = torch.randn(3, 4)
    assert twin.training is False and twin.module.training is False
    torch.testing.assert_close(twin(x), twin.module(x) + 1, rtol=0, atol=0)
    twin.register_forward_hook(lambda m, args, out: out * 0)  # the copy's own hooks
    torch.testing.assert_close(model(x), module(x) + 1, rtol=0, atol=0)
