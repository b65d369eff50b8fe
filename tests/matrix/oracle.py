"""What the matrix compares, and how: answers of any container torch knows (dicts, tuples,
lists, namedtuples, dataclasses), tensors bit for bit or to a tolerance, the module's
parameters, buffers, tensor attributes and the Python state its forward writes, and the
process-wide settings a call must leave as it found them.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn

from freezeframe.context import get_forward_context


class Failure(AssertionError):
    """What the oracle found; ``kind`` groups failures for shrinking ("wrong answer", "raw
    exception", "state", "identity", "leak", "health", "refusal")."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(f"{kind}: {text}")
        self.kind = kind


@dataclasses.dataclass
class CallRecord:
    """What one compared (or refused) call did, for the shares the matrix reports and holds a
    floor on (tests/matrix/shares.py): the way it went, whether a graph was due and replayed,
    whether a runner step ran from its plan, and the refusal if it was refused."""

    via: str  # plain | context | runner | microbatch | second_runner | serve | hf
    graph: bool = False  # a graph mode was asked for (context) or dispatched (runner)
    replayed: bool = False  # the compiled model counted a graph replay
    planned: bool = False  # a runner step that ran from its plan (not the whole way)
    refused: str = ""  # "ErrorType: message" of a refusal
    wrong_for_user: str = ""  # the accepted refusal is one a user should not get (its case)
    accepted_as: str = ""  # the name of the refusals.ACCEPTED entry that accepted it


@dataclasses.dataclass
class Outcome:
    calls: int = 0
    refused: int = 0
    refusals: list[str] = dataclasses.field(default_factory=list)
    stats: dict[str, int] = dataclasses.field(default_factory=dict)
    records: list[CallRecord] = dataclasses.field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Outcome:
        records = [CallRecord(**r) for r in data.pop("records", [])]
        return cls(**data, records=records)


# -- answers ----------------------------------------------------------------------------------
def _is_dataclass(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def children(value: Any) -> list[tuple[str, Any]] | None:
    """The items of a container (with where each sits), or None for a leaf."""
    if isinstance(value, dict):
        return [(f"[{k!r}]", v) for k, v in value.items()]
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return [(f".{k}", getattr(value, k)) for k in value._fields]
    if isinstance(value, (tuple, list)):
        return [(f"[{i}]", v) for i, v in enumerate(value)]
    if _is_dataclass(value):
        return [(f".{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    return None


def rebuild(value: Any, items: list[Any]) -> Any:
    """A container like ``value`` holding ``items`` instead of its own."""
    if isinstance(value, dict):
        return dict(zip(value, items, strict=True))
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*items)
    if isinstance(value, (tuple, list)):
        return type(value)(items)
    names = [f.name for f in dataclasses.fields(value)]
    return type(value)(**dict(zip(names, items, strict=True)))


def leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    items = children(value)
    return [t for _, v in items for t in leaves(v)] if items is not None else []


def clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    items = children(value)
    return rebuild(value, [clone(v) for _, v in items]) if items is not None else value


def compare(got: Any, want: Any, tol: tuple[float, float] | None, what: str) -> None:
    """Same structure (container types included), dtypes and shapes; equal values (``tol``
    None: bit for bit)."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise Failure("wrong answer", f"{what}: a {type(got).__name__}, eager a tensor")
        if got.dtype != want.dtype or got.shape != want.shape:
            raise Failure("wrong answer", f"{what}: {got.dtype} {tuple(got.shape)}, eager "
                                          f"{want.dtype} {tuple(want.shape)}")
        rtol, atol = tol if tol is not None else (0.0, 0.0)
        try:
            torch.testing.assert_close(got.detach(), want.detach(), rtol=rtol, atol=atol,
                                       equal_nan=True, check_device=False)
        except AssertionError as exc:
            raise Failure("wrong answer", f"{what} differs from eager's: {exc}") from None
        return
    wanted = children(want)
    if wanted is not None:
        got_items = children(got)
        if type(got) is not type(want) or got_items is None or \
                [k for k, _ in got_items] != [k for k, _ in wanted]:
            raise Failure("wrong answer", f"{what}: {_shape_of(got)}, eager {_shape_of(want)}")
        for (key, g), (_, w) in zip(got_items, wanted, strict=True):
            compare(g, w, tol, f"{what}{key}")
        return
    if got != want and not (_nan(got) and _nan(want)):
        raise Failure("wrong answer", f"{what}: {got!r}, eager {want!r}")


def _nan(value: Any) -> bool:
    return isinstance(value, float) and value != value


def _shape_of(value: Any) -> str:
    items = children(value)
    if items is None:
        return type(value).__name__
    return f"{type(value).__name__} of {[k for k, _ in items]}"


# -- the module's state -------------------------------------------------------------------------
def state_of(module: nn.Module, attrs: bool) -> dict[str, Any]:
    """Parameters, buffers and (``attrs``) tensor attributes, by name."""
    out: dict[str, Any] = {f"param {k}": v for k, v in module.named_parameters()}
    out.update({f"buffer {k}": v for k, v in module.named_buffers()})
    if attrs:
        for prefix, sub in module.named_modules():
            for key, value in vars(sub).items():
                if isinstance(value, torch.Tensor):
                    out[f"attribute {prefix + '.' if prefix else ''}{key}"] = value
    return out


def python_state_of(module: nn.Module) -> dict[str, Any]:
    """Every submodule's plain Python attributes (not tensors, submodules or nn.Module's own
    ``_`` bookkeeping), copied: what forward may write that a user reads (``self.seen``)."""
    out: dict[str, Any] = {}
    for prefix, sub in module.named_modules():
        for key, value in vars(sub).items():
            if key.startswith("_") or isinstance(value, (torch.Tensor, nn.Module)):
                continue
            try:
                out[f"{prefix + '.' if prefix else ''}{key}"] = copy.deepcopy(value)
            except Exception:  # (an object that cannot be copied is compared by identity)
                out[f"{prefix + '.' if prefix else ''}{key}"] = value
    return out


def compare_state(ours: dict[str, Any], eager: dict[str, Any], tol: tuple[float, float] | None,
                  real: int | None) -> None:
    """The module's tensors after a call against eager's; ``real``: a runner step's real
    rows, whose forward saw the padded batch: a tensor attribute with more rows than eager's
    ``real`` is compared on its real rows (what the step's answer is cut to)."""
    if set(ours) != set(eager):
        raise Failure("state", f"module state names {sorted(set(ours) ^ set(eager))} "
                               f"differ from eager's after the call")
    for key in eager:
        got, want = ours[key], eager[key]
        if real is not None and key.startswith("attribute ") and got.dim() and want.dim() \
                and got.shape[0] > real == want.shape[0]:
            got = got[:real]
        compare(got, want, tol, f"{key} after the call")


def compare_python_state(ours: dict[str, Any], eager: dict[str, Any]) -> None:
    if list(ours) != list(eager):
        raise Failure("state", f"the module's Python attributes {list(ours)} differ from "
                               f"eager's {list(eager)} after the call")
    for key, want in eager.items():
        compare(ours[key], want, None, f"attribute {key} after the call")


def global_state() -> tuple[Any, ...]:
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.get_default_dtype(), torch.is_autocast_enabled("cpu"),
            get_forward_context() is None)
