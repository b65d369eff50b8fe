"""The checks one compilation-config field's value goes through before anything is resolved.

Types (:func:`as_tuple`, :func:`positive_int`); vLLM's own syntaxes, which freezeframe accepts
as written (``custom_ops``, ``pass_config``, op names in ``splitting_ops``); and the keys a vLLM
compilation-config JSON may use (:func:`normalise_keys`: vLLM's aliases of our field names, and
the vLLM fields freezeframe knows but does not support). Each check raises a
:class:`~freezeframe.errors.ConfigError` that names the field, the value and the fix;
:class:`~freezeframe.config.CompilationConfig` calls them, in ``__post_init__`` and when it
reads a mapping.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from freezeframe.errors import ConfigError

__all__ = [
    "KEY_ALIASES",
    "VLLM_UNSUPPORTED",
    "as_tuple",
    "check_custom_ops",
    "check_pass_config",
    "normalise_keys",
    "normalise_op_name",
    "positive_int",
]

# Accepted spellings from vLLM configs that map onto our field names.
KEY_ALIASES = {"level": "mode", "max_num_batched_tokens": "max_num_tokens"}

# vLLM compilation-config fields freezeframe does not implement; named in the error so a user
# pasting a vLLM JSON learns the field is known but unsupported rather than misspelt.
VLLM_UNSUPPORTED = frozenset({
    "debug_dump_path", "use_inductor", "use_cudagraph", "full_cuda_graph",
    "compile_cache_save_format", "use_inductor_graph_partition",
    "dynamic_shapes_config", "compile_mm_encoder", "cudagraph_mm_encoder", "local_cache_dir",
    "fast_moe_cold_start", "max_capture_size", "compile_ranges_split_points",
})


def as_tuple(value: Any, field: str) -> tuple[Any, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ConfigError(f"{field}: expected a list, got {value!r}")
    return tuple(value)


def positive_int(value: Any, field: str, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{field}: expected an int, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else ">= 1"
        raise ConfigError(f"{field}: must be {bound}, got {value}")
    return value


def check_custom_ops(value: Any) -> tuple[str, ...]:
    """vLLM's ``custom_ops`` syntax: ``"all"`` or ``"none"`` (at most one of them), ``"+op"`` to
    enable and ``"-op"`` to disable one op, never both for the same op."""
    entries = as_tuple(value, "custom_ops")
    enabled: set[str] = set()
    disabled: set[str] = set()
    for entry in entries:
        if not isinstance(entry, str):
            raise ConfigError(f"custom_ops: entry {entry!r} is not a string; write 'all', "
                              "'none', '+op_name' or '-op_name'")
        if entry in ("all", "none"):
            continue
        sign, name = entry[:1], entry[1:]
        if sign not in ("+", "-") or not name:
            raise ConfigError(f"custom_ops: invalid entry {entry!r}; write 'all', 'none', "
                              f"'+{entry.lstrip('+-') or 'op_name'}' (enable) or "
                              f"'-{entry.lstrip('+-') or 'op_name'}' (disable)")
        (enabled if sign == "+" else disabled).add(name)
    if sum(e in ("all", "none") for e in entries) > 1:
        raise ConfigError(f"custom_ops: {list(entries)} names 'all'/'none' more than once; "
                          "keep one of them")
    both = sorted(enabled & disabled)
    if both:
        raise ConfigError(f"custom_ops: {both} both enabled ('+') and disabled ('-'); keep one")
    return tuple(entries)


def check_pass_config(value: Any) -> dict[str, Any]:
    """vLLM's ``pass_config``: switches for vLLM's own fusion passes. freezeframe has none of
    them, so a switch that is off (false or null) is accepted and anything else is refused,
    naming the key."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"pass_config: expected a mapping of vLLM pass options, got {value!r}")
    for key, option in value.items():
        if not isinstance(key, str):
            raise ConfigError(f"pass_config: key {key!r} is not a string")
        if option is not None and option is not False:
            fix = (f"Remove pass_config.{key} or set it to false" if isinstance(option, bool)
                   else f"Remove pass_config.{key}")
            raise ConfigError(
                f"not supported: pass_config.{key}={json.dumps(option, default=repr)}; "
                "freezeframe runs none of vLLM's compilation passes (fusions of vLLM's own "
                "quantisation, norm and collective ops, no-op elimination, sequence "
                "parallelism), so it accepts a pass_config only with every option off and "
                f"does not check the names (a misspelt key is reported the same way). {fix}; "
                "to run a pass of your own on every piece, give it in inductor_passes")
    return dict(value)


def normalise_op_name(op: Any) -> str:
    """``"ns::op"`` / ``"ns::op.overload"`` as given; torch's printed form ``"ns.op"`` /
    ``"ns.op.overload"`` (what older vLLM configs use) is rewritten to the ``::`` form."""
    if isinstance(op, str):
        op = op.strip()
        if "::" in op:
            ns, _, rest = op.partition("::")
            if ns and rest and "::" not in rest:
                return op
        elif op.count(".") in (1, 2) and all(op.split(".")):
            ns, _, rest = op.partition(".")
            return f"{ns}::{rest}"
    raise ConfigError(
        f"splitting_ops: {op!r} is not an op name; write 'namespace::op' (all overloads) or "
        "'namespace::op.overload' (one overload), e.g. 'silly::attention'")


# torch's functional collectives: each returns before its data is there; wait_tensor waits
_FUNCTIONAL = "_c10d_functional::"
_WAIT = _FUNCTIONAL + "wait_tensor"


def check_collective_splits(ops: Sequence[str]) -> None:
    """A functional collective (``_c10d_functional::all_reduce``, ...) as a splitting op runs
    eagerly and returns a tensor whose data arrives later, at its ``wait_tensor``. If the wait
    stays inside the next captured piece, the replay copies that tensor into the piece's
    static input before anything waits for it: the piece reads a half-reduced buffer (found on
    two gloo ranks: logits off by 12). So the wait must be a splitting op too."""
    collectives = [op for op in ops if op.startswith(_FUNCTIONAL) and op != _WAIT
                   and not op.startswith(_WAIT + ".")]
    if collectives and not any(op == _WAIT or op.startswith(_WAIT + ".") for op in ops):
        raise ConfigError(
            f"splitting_ops: {collectives[0]!r} is an asynchronous collective whose result is "
            f"only complete after its {_WAIT!r}; splitting at the collective alone would let "
            f"the next captured piece read the result before the wait (a wrong answer). Add "
            f"{_WAIT!r} to splitting_ops (the collective and its wait then both run eagerly "
            "between the pieces), or remove the collective (it is then captured inside the "
            "graphs, waits included)")


def normalise_keys(data: Mapping[str, Any], valid: Collection[str]) -> dict[str, Any]:
    """Map aliases onto field names; reject unknown keys, listing the ``valid`` ones."""
    fields = set(valid)
    kwargs: dict[str, Any] = {}
    unknown = []
    for key, value in data.items():
        name = KEY_ALIASES.get(key, key)
        if name not in fields:
            unknown.append(key)
            continue
        if name in kwargs:
            raise ConfigError(f"{key}: given twice (once under its alias); keep one")
        kwargs[name] = value
    if unknown:
        known_vllm = sorted(k for k in unknown if k in VLLM_UNSUPPORTED)
        note = (f" ({known_vllm} are vLLM fields freezeframe does not support; remove them)"
                if known_vllm else "")
        raise ConfigError(
            f"unknown compilation-config field(s) {sorted(map(str, unknown))}{note}; valid "
            f"fields are {sorted(fields)} (aliases: {sorted(KEY_ALIASES)})")
    return kwargs
