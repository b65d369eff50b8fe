"""The refusals the matrix accepts: each one docs/guarantees.md states, with what in the case
must have caused it.

A call may end in a ``FreezeframeError`` instead of an answer only where the guarantees say
that change is refused. Every refusal a case meets is matched against :data:`ACCEPTED`: the
error's type and message must fit an entry, and one of the entry's causes must have happened
in the case before that call (a change kind the case applied, or a feature of the call itself,
see :func:`call_causes`). Any other refusal fails the case (kind "refusal"): a library that
refuses what it promised to answer is as wrong for a user as a wrong answer, and a refusal
nothing caused hides everything after it.

Some refusals the guarantees state are wrong for a user: they are accepted here, marked
``wrong_for_user``, and each has a named strict-xfail case in test_matrix.py (``OPEN``) that
expects the answer instead; the lead drops the entry when the library fix is merged and that
case flips (``test_every_wrong_refusal_has_its_open_case`` ties the two).
"""

from __future__ import annotations

import dataclasses
import re

from freezeframe.errors import (
    CaptureError,
    CompileError,
    ConfigError,
    FreezeframeError,
    InputMismatchError,
)

GUARANTEES = "docs/guarantees.md"
TABLE = f"{GUARANTEES}, 'A call that differs from the traced one'"


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A refusal the guarantees promise (``doc`` cites where)."""

    name: str
    error: type[FreezeframeError] | tuple[type[FreezeframeError], ...]
    message: str  # a regular expression the error's message must match (re.search)
    causes: frozenset[str]  # change kinds or call features; one must have happened
    doc: str
    # a refusal the guarantees state but a user should not get: the OPEN case that expects
    # the answer instead (test_matrix.py)
    wrong_for_user: str = ""

    def fits(self, error: BaseException, causes: set[str]) -> bool:
        return isinstance(error, self.error) and bool(self.causes & causes) \
            and re.search(self.message, str(error), re.S) is not None


_HOOKS = frozenset({"hook_model_fwd", "hook_model_pre", "hook_root_fwd", "hook_sub_fwd"})

ACCEPTED: tuple[Refusal, ...] = (
    Refusal("hook added or removed", CompileError, r"hook", _HOOKS,
            f"{TABLE}, row 'the module itself: ... a hook added or removed'"),
    Refusal("train/eval", CompileError, r"\.training was", frozenset({"train"}),
            f"{TABLE}, row 'the module itself: model.train() / eval()'"),
    Refusal("autocast", CompileError, r"autocast", frozenset({"autocast_on"}),
            f"{TABLE}, row 'autocast ... or the default dtype unlike the first call's'"),
    Refusal("default dtype", CompileError, r"default dtype", frozenset({"default_dtype64"}),
            f"{TABLE}, row 'autocast ... or the default dtype unlike the first call's'"),
    Refusal("attribute forward reads, set", CompileError,
            r"model\.scale (was set|was 2\.0)", frozenset({"instance_attr"}),
            f"{TABLE}, row 'the module itself: ... an attribute set (model.scale = 5.0 ...)'"),
    Refusal("class attribute forward reads", CompileError, r"class attribute",
            frozenset({"class_attr"}),
            f"{TABLE}, row 'the module itself: ... each class attribute forward reads'"),
    Refusal("parameter or buffer of another kind", CompileError,
            r"(is None now|was None at the trace|registered|deleted|torch\.float64 tensor|"
            r"buffer)", frozenset({"bias_none", "register_buffer", "to_float64"}),
            f"{TABLE}, row 'a parameter or buffer set to None ..., one registered or deleted "
            "after the trace, or one of another dtype, shape or device'"),
    Refusal("submodule replaced", CompileError, r"(submodule|child|replaced)",
            frozenset({"swap_submodule"}),
            f"{TABLE}, row 'the module itself: ... a submodule replaced'"),
    Refusal("graph capture under autograd", CaptureError, r"while autograd is recording",
            frozenset({"grad_call"}),
            f"{GUARANTEES}, 'Modes and switches': inference_mode=False ... a capture that "
            "would record autograd history is refused with one CaptureError"),
    Refusal("forward sets an attribute while a graph is captured", CaptureError,
            r"forward sets self\.\w+ \(or deletes it\) while the \w+ graph",
            frozenset({"forward_sets_attr"}),
            f"{TABLE}, row 'modes none and stock_torch_compile with graphs: forward sets an "
            "attribute of any module ... while a FULL or PIECEWISE graph is captured'"),
    Refusal("forward changes its own Python state", CompileError,
            r"forward changes the module's own Python state", frozenset({"forward_writes_state"}),
            f"{TABLE}, row 'forward changes its own attributes (self.calls += 1)'"),
    Refusal("an input of another dtype", InputMismatchError, r"dtype", frozenset({"cast"}),
            f"{TABLE}, row 'a tensor's dtype, device or rank ...' (and docs/runner.md: each "
            "input is checked against its spec)"),
    Refusal("micro-batching a runner with a Requests input", ConfigError,
            r"micro_batching=True with the Requests input", frozenset({"micro_batch_requests"}),
            f"{GUARANTEES}, 'Micro-batching': a runner with a Requests input and "
            "micro_batching=True is refused (ConfigError naming the input)"),
    Refusal("too many traces", CompileError, r"traces", frozenset({"many_structures"}),
            f"{TABLE}, row 'None where a tensor was ...': at most 8 traces per model, then "
            "ff.CompileError"),
    # The refusals the library fixes of issue 42 may choose (their OPEN cases, with the kind
    # switched off in cases.PENDING_KINDS until then); each fix writes its row into the
    # guarantees ("docs/guarantees.md must then say what is checked")
    Refusal("a module-level global forward reads, changed", CompileError, r"global",
            frozenset({"module_global"}),
            f"{TABLE}: the row issue 42 item 2 adds (a global forward reads, checked per call)"),
    Refusal("a plain tensor attribute replaced after a capture", (CompileError, CaptureError),
            r"\bgain\b", frozenset({"tensor_attr_replaced"}),
            f"{TABLE}: the row issue 42 item 1 changes ('a tensor attribute only has to stay a "
            "tensor')"),
    Refusal("a Python scalar that changes, on breakable graphs", (CompileError, CaptureError),
            r"argument '?(t|steps)'?", frozenset({"scalar_breakable"}),
            f"{GUARANTEES} and docs/breakable.md: the row issue 42 item 3 adds"),
)


def accepted(error: BaseException, causes: set[str], wrong_ok: bool = True
             ) -> Refusal | None:
    """The entry of :data:`ACCEPTED` that accepts ``error`` given what happened, or None.
    ``wrong_ok=False``: not the ones wrong for a user (their OPEN cases expect an answer)."""
    for entry in ACCEPTED:
        if entry.fits(error, causes) and (wrong_ok or not entry.wrong_for_user):
            return entry
    return None
