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

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from freezeframe.runtime import InputSpec, Requests, Static, Tokens
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


class InjectedFault(RuntimeError):
    """What ``ffmatrix::mix`` raises once when its fault switch is armed (a fault between
    calls: the matrix's ``fault`` change)."""


class FaultSwitch:
    """Armed, the next real call of ``ffmatrix::mix`` raises :class:`InjectedFault` (once)."""

    def __init__(self) -> None:
        self.armed = False
        self.fired = 0

    def check(self) -> None:
        if self.armed:
            self.armed = False
            self.fired += 1
            raise InjectedFault("a fault injected into ffmatrix::mix")


def _register_mix() -> FaultSwitch:
    """``ffmatrix::mix``: a row-wise functional splitting op (a second op beside the silly one),
    with a fault switch (shared by every import of this file)."""
    from torch._library import custom_ops

    if MIX in custom_ops.OPDEFS:  # imported twice under two module names
        return custom_ops.OPDEFS[MIX]._init_fn.fault  # type: ignore[attr-defined, no-any-return]

    switch = FaultSwitch()

    @torch.library.custom_op(MIX, mutates_args=())
    def mix(x: torch.Tensor) -> torch.Tensor:
        switch.check()
        return x.flip(-1) * 0.5 + x.sum(-1, keepdim=True)

    mix._init_fn.fault = switch  # type: ignore[attr-defined]

    @mix.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        # y_i = x_{n-1-i} / 2 + sum_j x_j
        return grad.flip(-1) * 0.5 + grad.sum(-1, keepdim=True)

    mix.register_autograd(backward)
    return switch


FAULT = _register_mix()


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


# a module-level value ReadsGlobal's forward reads (the change "module_global" sets it; the
# harness puts it back after each case)
BASE_GAIN = 1.5
GAIN = BASE_GAIN


class ReadsGlobal(nn.Module):
    """Reads a module-level global (``GAIN``): a value from outside the module."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return attention(self.lin(x), x, x) * GAIN


class Timestep(nn.Module):
    """A Python float and a Python int argument (a diffusion timestep, a step count)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x: torch.Tensor, t: float, steps: int = 1) -> torch.Tensor:
        h = self.lin(x) * t
        for _ in range(steps):
            h = _mix(torch.tanh(h))
        return h + t


class TensorAttr(nn.Module):
    """A plain tensor attribute (neither parameter nor buffer) forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.gain = torch.linspace(0.5, 2.0, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return attention(self.lin(x), x, x) * self.gain


@dataclasses.dataclass
class HiddenAndLogits:
    """A plain dataclass output (not a ModelOutput)."""

    hidden: torch.Tensor
    logits: torch.Tensor


HiddenAndLogitsTuple = collections.namedtuple("HiddenAndLogitsTuple", ["hidden", "logits"])


class ContainerOut(nn.Module):
    """Returns its two outputs in a container: a plain @dataclass, a namedtuple or a nested
    dict / tuple / list."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(H, H)
        self.head = nn.Linear(H, 2)

    def forward(self, x: torch.Tensor) -> Any:
        h = _mix(torch.relu(self.lin(x)))
        logits = self.head(h)
        if self.kind == "dataclass":
            return HiddenAndLogits(h, logits)
        if self.kind == "namedtuple":
            return HiddenAndLogitsTuple(h, logits)
        return {"pair": (h, [logits, h * 2]), "logits": logits}


class WritesPyState(nn.Module):
    """Forward writes non-tensor module state a user can read: a dict item (the last batch's
    row count) and a list item."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.seen: dict[str, int] = {"rows": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen["rows"] = x.shape[0]
        return attention(self.lin(x), x, x)


class PerRequest(nn.Module):
    """Tokens, Requests and Static inputs outside the Llama: each token adds its request's row
    of ``req_bias`` (``req_idx`` says which), times a static ``gain``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x: torch.Tensor, req_idx: torch.Tensor, req_bias: torch.Tensor,
                gain: torch.Tensor) -> torch.Tensor:
        return _mix(self.lin(x) + req_bias[req_idx] * gain)


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
@dataclasses.dataclass(frozen=True)
class Draw:
    """What a call drew for its inputs besides the row count: the Optional argument given,
    which Python scalar values, how many requests (0: one per token)."""

    opt: bool = False
    scalar: int = 0
    reqs: int = 0


Inputs = Callable[[int, torch.Generator, torch.dtype, Draw], dict[str, Any]]


def _x(n: int, gen: torch.Generator, dtype: torch.dtype, _draw: Draw) -> dict[str, Any]:
    return {"x": torch.randn(n, H, generator=gen).to(dtype)}


def _x_bias(n: int, gen: torch.Generator, dtype: torch.dtype, draw: Draw) -> dict[str, Any]:
    out = _x(n, gen, dtype, draw)
    out["bias"] = torch.randn(n, H, generator=gen).to(dtype) if draw.opt else None
    return out


def _x_y(n: int, gen: torch.Generator, dtype: torch.dtype, _draw: Draw) -> dict[str, Any]:
    return {"x": torch.randn(n, H, generator=gen).to(dtype),
            "y": torch.randn(n, H, generator=gen).to(dtype)}


def _ids(n: int, gen: torch.Generator, dtype: torch.dtype, _draw: Draw) -> dict[str, Any]:
    index = dtype if not dtype.is_floating_point else torch.long
    return {"input_ids": torch.randint(0, 32, (n,), generator=gen).to(index),
            "positions": torch.randint(0, 16, (n,), generator=gen).to(index)}


# the (t, steps) pairs a Timestep call passes (few: each pair is a trace of its own)
TIMESTEPS = ((0.5, 1), (1.0, 1), (2.0, 2), (0.25, 1))


def _x_t(n: int, gen: torch.Generator, dtype: torch.dtype, draw: Draw) -> dict[str, Any]:
    t, steps = TIMESTEPS[draw.scalar % len(TIMESTEPS)]
    return {**_x(n, gen, dtype, draw), "t": t, "steps": steps}


def _per_request(n: int, gen: torch.Generator, dtype: torch.dtype,
                 draw: Draw) -> dict[str, Any]:
    reqs = min(draw.reqs, n) if draw.reqs else n
    if reqs == n:
        idx = torch.arange(n)
    else:  # every request has a token, in order (the layout a scheduler makes)
        idx = torch.cat([torch.arange(reqs), torch.randint(0, reqs, (n - reqs,),
                                                           generator=gen)]).sort().values
    return {"x": torch.randn(n, H, generator=gen).to(dtype), "req_idx": idx,
            "req_bias": torch.randn(reqs, H, generator=gen).to(dtype),
            "gain": torch.randn(H, generator=gen).to(dtype)}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]
    inputs: Inputs | None  # None: served through its own driver (llama, hf_*)
    splitting_ops: tuple[str, ...] = ()
    row_independent: bool = True  # a runner may pad it
    # the runner's inputs for the input dtype given (None: no runner serves it)
    runner_inputs: Callable[[torch.dtype], dict[str, InputSpec]] | None = None
    kwargs: tuple[tuple[str, Any], ...] = ()  # plain keyword arguments a call may pass
    float_inputs: bool = True  # a dtype move needs inputs of the new dtype
    # every op has an autograd formula (silly::attention has none: gradients through it are
    # undefined, so no gradient is compared)
    autograd: bool = False
    context: bool = True  # the low-level context path may call it (it pads every input)
    scalars: bool = False  # its calls pass Python scalars (Draw.scalar picks them)
    requests: bool = False  # it has a Requests input (Draw.reqs rows)
    dynamic_dims: dict[str, int] | None = None  # ff.compile's dynamic_arg_dims (None: default)
    note: str = ""

    @property
    def served(self) -> bool:
        return self.inputs is None


def _x_spec(dtype: torch.dtype) -> dict[str, InputSpec]:
    return {"x": Tokens(H, dtype=dtype)}


def _ids_spec(dtype: torch.dtype) -> dict[str, InputSpec]:
    index = dtype if not dtype.is_floating_point else torch.long
    return {"input_ids": Tokens(dtype=index), "positions": Tokens(dtype=index)}


def _per_request_spec(dtype: torch.dtype) -> dict[str, InputSpec]:
    return {"x": Tokens(H, dtype=dtype), "req_idx": Tokens(dtype=torch.long),
            "req_bias": Requests(H, dtype=dtype), "gain": Static(H, dtype=dtype)}


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
    ModelSpec("toy_llama", _toy_llama, _ids, (SILLY,), runner_inputs=_ids_spec,
              float_inputs=False, note="tests/helpers ToyLlama (Optional residual inside)"),
    ModelSpec("keeps_last", KeepsLast, _x, (SILLY,), runner_inputs=_x_spec,
              note="stores its output on self.last"),
    ModelSpec("optional_kwargs", OptionalKwargs, _x_bias, (MIX,), runner_inputs=_x_spec,
              autograd=True, kwargs=(("scale", 1.0), ("scale", 0.5))),
    ModelSpec("dict_out", DictOut, _x, (SILLY, MIX), runner_inputs=_x_spec),
    ModelSpec("tuple_out", TupleOut, _x_y, (MIX,), autograd=True,
              runner_inputs=lambda dtype: {"x": Tokens(H, dtype=dtype),
                                           "y": Tokens(H, dtype=dtype)}),
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
    ModelSpec("reads_global", ReadsGlobal, _x, (SILLY,), runner_inputs=_x_spec,
              note="reads a module-level global (GAIN)"),
    ModelSpec("timestep", Timestep, _x_t, (MIX,), scalars=True, autograd=True,
              note="a Python float and int argument (t, steps)"),
    ModelSpec("tensor_attr", TensorAttr, _x, (SILLY,), runner_inputs=_x_spec,
              note="a plain tensor attribute (self.gain) forward reads"),
    *(ModelSpec(f"{kind}_out", functools.partial(ContainerOut, kind), _x, (MIX,),
                runner_inputs=_x_spec, note=f"returns a {kind} of tensors")
      for kind in ("dataclass", "namedtuple", "nested")),
    ModelSpec("py_state", WritesPyState, _x, (SILLY,), row_independent=False,
              note="writes a dict item (the batch's row count) in forward"),
    ModelSpec("per_request", PerRequest, _per_request, (MIX,), context=False, requests=True,
              runner_inputs=_per_request_spec,
              dynamic_dims={"x": 0, "req_idx": 0, "req_bias": 0},
              note="Tokens, Requests and Static inputs (a per-request bias, a static gain)"),
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
