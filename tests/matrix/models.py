"""The matrix's model zoo: the toy models of tests/helpers plus small models for what the toys
lack (Optional and keyword arguments, dict and tuple outputs, buffers written in forward,
batch-size and train/eval branches, two splitting ops, none, attributes forward reads, the
default dtype). Each comes with a :class:`ModelSpec` saying how to build it, how to make its
inputs for ``n`` tokens, which splitting ops it calls, and whether a ``GraphRunner`` (which pads
every step) may serve it (its rows must be independent, see README "The runner's contract").

The reference Llama and the Hugging Face models are served through their own drivers (see
harness.py); their specs only name them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from freezeframe.runtime import InputSpec, Tokens
from tests.helpers import global_flags
from tests.helpers.silly import attention
from tests.helpers.toy_models import (
    AttnSandwich,
    AttnWithRMSNorm,
    KeepsLast,
    LlamaConfig,
    OuterWithTwoInner,
    SillyModel,
    ToyLlama,
)

H = 8  # the hidden size of every float-input model here
SILLY = "silly::attention"
MIX = "ffmatrix::mix"


def _register_mix() -> None:
    """``ffmatrix::mix``: a row-wise functional splitting op (a second op beside the silly one)."""
    from torch._library import custom_ops

    if MIX in custom_ops.OPDEFS:  # imported twice under two module names
        return

    @torch.library.custom_op(MIX, mutates_args=())
    def mix(x: torch.Tensor) -> torch.Tensor:
        return x.flip(-1) * 0.5 + x.sum(-1, keepdim=True)

    @mix.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        # y_i = x_{n-1-i} / 2 + sum_j x_j
        return grad.flip(-1) * 0.5 + grad.sum(-1, keepdim=True)

    mix.register_autograd(backward)


_register_mix()


def _mix(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.ffmatrix.mix(x)  # type: ignore[no-any-return]


# -- the models the toys lack ----------------------------------------------------------------
class OptionalKwargs(nn.Module):
    """An Optional tensor argument and a keyword-only float, split at the mix op."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(H, H)
        self.lin2 = nn.Linear(H, H)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None, *,
                scale: float = 1.0) -> torch.Tensor:
        h = _mix(self.lin1(x))
        if bias is not None:
            h = h + bias
        return self.lin2(torch.tanh(h)) * scale


class DictOut(nn.Module):
    """Two splitting ops (silly attention and mix), a dict of two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.head = nn.Linear(H, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.lin(x)
        h = attention(h, h, h)
        h = _mix(torch.relu(h))
        return {"hidden": h, "logits": self.head(h)}


class TupleOut(nn.Module):
    """Two tensor inputs, a tuple of two outputs, one mix op."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(H, H)
        self.b = nn.Linear(H, H, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = _mix(self.a(x) + self.b(y))
        return h, torch.sigmoid(h) * y


class BufferWrite(nn.Module):
    """Adds each call's column sums into a buffer and reads it back: not row-independent."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.register_buffer("total", torch.zeros(H))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = attention(self.lin(x), x, x)
        self.total.add_(h.sum(0))
        self.calls.add_(1)
        return h + self.total * 0.01


class Branches(nn.Module):
    """A branch on the batch size and one on ``self.training``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _mix(self.lin(x))
        if x.shape[0] > 3:
            h = h * 3
        if self.training:
            h = h + 1
        return h


class MixesRows(nn.Module):
    """Reshapes and reductions over the batch dim around the splitting op (not row-independent):
    what Inductor writes size-specific code for."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.a = nn.Linear(H, H)
        self.b = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        h = self.a(self.norm(x)).view(n, 2, H // 2).transpose(0, 1).contiguous()
        h = h.softmax(dim=1).transpose(0, 1).reshape(n, H)  # softmax over the batch
        h = attention(h, h, h)
        return x + self.b(h) + x.mean(dim=0, keepdim=True) + h.cumsum(0)


class NoSplit(nn.Module):
    """A plain MLP: no splitting op at all."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(H, 2 * H)
        self.down = nn.Linear(2 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class ReadsAttrs(nn.Module):
    """Reads an instance attribute (``scale``) and a class attribute (``OFFSET``)."""

    OFFSET = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = attention(self.lin(x), x, x)
        return h * self.scale + self.OFFSET


class MakesOnes(nn.Module):
    """Makes a tensor of the default dtype in forward; writes into its input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _mix(self.lin(x)) + torch.ones(x.shape[0], 1)
        x.mul_(2)
        return y


class ResetsLibraryFlags(nn.Module):
    """Calls a library function that sets constants on its module-level object every call, as
    transformers' output capturing does: the side effect a saved trace repeats by itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return global_flags.reset_flags(attention(self.lin(x), x, x))


class Small(nn.Module):
    """The module the after-case health check compiles."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + 1


# -- specs -----------------------------------------------------------------------------------
Inputs = Callable[[int, torch.Generator, torch.dtype, bool], dict[str, Any]]


def _x(n: int, gen: torch.Generator, dtype: torch.dtype, _opt: bool) -> dict[str, Any]:
    return {"x": torch.randn(n, H, generator=gen).to(dtype)}


def _x_bias(n: int, gen: torch.Generator, dtype: torch.dtype, opt: bool) -> dict[str, Any]:
    out = _x(n, gen, dtype, opt)
    out["bias"] = torch.randn(n, H, generator=gen).to(dtype) if opt else None
    return out


def _x_y(n: int, gen: torch.Generator, dtype: torch.dtype, _opt: bool) -> dict[str, Any]:
    return {"x": torch.randn(n, H, generator=gen).to(dtype),
            "y": torch.randn(n, H, generator=gen).to(dtype)}


def _ids(n: int, gen: torch.Generator, _dtype: torch.dtype, _opt: bool) -> dict[str, Any]:
    return {"input_ids": torch.randint(0, 32, (n,), generator=gen),
            "positions": torch.randint(0, 16, (n,), generator=gen)}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]
    inputs: Inputs | None  # None: served through its own driver (llama, hf_*)
    splitting_ops: tuple[str, ...] = ()
    row_independent: bool = True  # a runner may pad it
    runner_inputs: Callable[[], dict[str, InputSpec]] | None = None
    kwargs: tuple[tuple[str, Any], ...] = ()  # plain keyword arguments a call may pass
    float_inputs: bool = True  # a dtype move needs inputs of the new dtype
    # every op has an autograd formula (silly::attention has none: gradients through it are
    # undefined, so no gradient is compared)
    autograd: bool = False
    note: str = ""

    @property
    def served(self) -> bool:
        return self.inputs is None


def _x_spec() -> dict[str, InputSpec]:
    return {"x": Tokens(H)}


def _toy_llama() -> nn.Module:
    return ToyLlama(LlamaConfig(hidden_size=16, mlp_size=32, vocab_size=32, num_layers=2))


SPECS: dict[str, ModelSpec] = {spec.name: spec for spec in [
    ModelSpec("silly", SillyModel, _x, (SILLY,), runner_inputs=_x_spec,
              note="tests/helpers SillyModel: no parameters, two attentions"),
    ModelSpec("sandwich", AttnSandwich, _x, (SILLY,), runner_inputs=_x_spec),
    ModelSpec("rmsnorm", lambda: AttnWithRMSNorm(H, 2 * H), _x, (SILLY,),
              runner_inputs=_x_spec),
    ModelSpec("outer", OuterWithTwoInner, _x, (SILLY,), runner_inputs=_x_spec,
              note="three attentions over two submodules"),
    ModelSpec("toy_llama", _toy_llama, _ids, (SILLY,),
              runner_inputs=lambda: {"input_ids": Tokens(dtype=torch.long),
                                     "positions": Tokens(dtype=torch.long)},
              float_inputs=False, note="tests/helpers ToyLlama (Optional residual inside)"),
    ModelSpec("keeps_last", KeepsLast, _x, (SILLY,), runner_inputs=_x_spec,
              note="stores its output on self.last"),
    ModelSpec("optional_kwargs", OptionalKwargs, _x_bias, (MIX,), runner_inputs=_x_spec,
              autograd=True, kwargs=(("scale", 1.0), ("scale", 0.5))),
    ModelSpec("dict_out", DictOut, _x, (SILLY, MIX), runner_inputs=_x_spec),
    ModelSpec("tuple_out", TupleOut, _x_y, (MIX,), autograd=True,
              runner_inputs=lambda: {"x": Tokens(H), "y": Tokens(H)}),
    ModelSpec("buffer_write", BufferWrite, _x, (SILLY,), row_independent=False),
    ModelSpec("branches", Branches, _x, (MIX,), row_independent=False, autograd=True),
    ModelSpec("mixes_rows", MixesRows, _x, (SILLY,), row_independent=False,
              note="softmax, mean and cumsum over the batch"),
    ModelSpec("no_split", NoSplit, _x, (), runner_inputs=_x_spec, autograd=True),
    ModelSpec("library_flags", ResetsLibraryFlags, _x, (SILLY,), runner_inputs=_x_spec,
              note="a library function sets constants on its module object (saved and "
                   "repeated by a warm start)"),
    ModelSpec("reads_attrs", ReadsAttrs, _x, (SILLY,), runner_inputs=_x_spec),
    ModelSpec("makes_ones", MakesOnes, _x, (MIX,), runner_inputs=_x_spec, autograd=True,
              note="torch.ones of the default dtype; writes into its input"),
    ModelSpec("llama", lambda: None, None, ("freezeframe::attention",),  # type: ignore[arg-type]
              note="freezeframe.models.build_llama('tiny'), served by ServingDriver"),
    *(ModelSpec(f"hf_{family}", lambda: None, None,  # type: ignore[arg-type]
                ("freezeframe_hf::attention",), note=f"transformers {family}, ff.hf.compile")
      for family in ("llama", "qwen2", "gpt2")),
]}

FAST_MODELS = [name for name, spec in SPECS.items() if not name.startswith("hf_")]
ALL_MODELS = list(SPECS)


def build(spec: ModelSpec, seed: int) -> nn.Module:
    """A fresh instance of the spec's model, its weights drawn from ``seed``, of a class made
    for this case (a subclass named after the seed), so a class attribute a case changes stays
    with the case."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        module = spec.build()
    base = type(module)
    if spec.name == "reads_attrs":
        module.__class__ = type(f"{base.__name__}_s{seed}", (base,),
                                {"__module__": base.__module__, "OFFSET": base.OFFSET})
    return module.eval()


def hf_model(family: str, seed: int) -> nn.Module:
    """A tiny random transformers causal LM (nothing is downloaded)."""
    import transformers

    special = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if family == "llama":
            cfg: Any = transformers.LlamaConfig(
                vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                **special)
            return transformers.LlamaForCausalLM(cfg).eval()
        if family == "qwen2":
            cfg = transformers.Qwen2Config(
                vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                **special)
            return transformers.Qwen2ForCausalLM(cfg).eval()
        cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                      n_positions=64, **special)
        return transformers.GPT2LMHeadModel(cfg).eval()
