"""Mutation testing of the differential matrix: how many real bugs, injected one at a time into
the library, does the fast slice find, and with how many seeds?

Each mutant is a small record: a file under src/freezeframe, a snippet of it that must occur
exactly once, and what replaces it. For each mutant the script copies src/ to a temporary
directory, applies the mutant there (never to the working tree), and runs the matrix's fast
slice against that copy: the named kill cases (tests/matrix/test_kills.py) first, then the
seeds, the floor test and the found bugs' regression cases (no shrinking; Inductor's cases left
out). A first run without any mutant (the baseline) finds the tests that fail on the library as
it is (open bugs): they kill no mutant. A mutant is *killed* when another test fails; the seeds
and named cases that failed are listed. A mutant whose snippet is not found any more (the code
moved on) is reported as such, to be re-pointed.

    python scripts/mutate.py                 # every mutant (long: one fast slice each)
    python scripts/mutate.py --list          # the mutants, in words
    python scripts/mutate.py --check         # does each still apply (and import)?
    python scripts/mutate.py plan_key_without_dtype copy_back_skipped   # some of them
    python scripts/mutate.py --seeds 8       # against the first 8 seeds only (quicker)
    python scripts/mutate.py --first         # stop each run at its first failure (quicker)
    python scripts/mutate.py --named-only    # the named kill cases only, all of them counted
    python scripts/mutate.py --assume-failing none m1 m2   # no baseline run: none fails

Run from the repository root with the project's interpreter. It prints one line per mutant as
it finishes and a summary table (markdown) at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import typing
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # under src/freezeframe
    original: str  # must occur exactly once in the file
    replacement: str
    what: str


MUTANTS: tuple[Mutant, ...] = (
    # -- the runner's planned steps (runtime/steps.py Stepper.run, runtime/plan.py) ------------
    Mutant("plan_skips_last_input_copy", "runtime/steps.py",
           "        static.stage_into(plan.staging, inputs)\n",
           "        if plan.kept and plan.context is None:\n"
           "            static.stage_into(dataclasses.replace(\n"
           "                plan.staging, targets=plan.staging.targets[:-1]), inputs[:-1])\n"
           "        else:\n"
           "            static.stage_into(plan.staging, inputs)\n",
           "a planned FULL step copies every input but its last into the static buffers"),
    Mutant("plan_skips_state_check", "runtime/steps.py",
           "                if check is not None:\n                    check()\n"
           "                out = work.replay.on_captured()",
           "                out = work.replay.on_captured()",
           "a planned FULL step skips the module-state check"),
    Mutant("plan_same_tensor_object", "runtime/steps.py",
           "            out = out.detach() if out.__class__ is torch.Tensor else "
           "map_tensors(out, alias)\n",
           "",
           "a planned FULL step hands out the same tensor object every step"),
    Mutant("plan_key_without_dtype", "runtime/plan.py",
           'input_key = operator.attrgetter("__class__", "shape", "dtype", "device")',
           'input_key = operator.attrgetter("__class__", "shape", "device")',
           "a plan's key leaves out the input's dtype (another dtype is cast silently)"),
    Mutant("plan_ignores_hooks", "runtime/steps.py",
           "        if plans and (not isinstance(model, torch.nn.Module) or "
           "may_skip_module_call(model)):\n",
           "        if plans:\n",
           "a planned step skips the compiled model's hooks registered after the plan"),
    Mutant("piecewise_plan_cut_reused", "runtime/steps.py",
           "        if out is plan.last_out:",
           "        if plan.last_out is not None:",
           "a planned PIECEWISE step reuses the last cut even for a new output tensor"),
    Mutant("plan_in_context_skips_check", "runtime/steps.py",
           "        with entered(ctx):\n            if check is not None:\n"
           "                check()\n",
           "        with entered(ctx):\n",
           "a planned PIECEWISE step (replays in context) skips the module-state check"),
    # -- the one skip-__call__ rule (compilation/module_call.py) ---------------------------------
    Mutant("skip_call_ignores_pre_hooks", "compilation/module_call.py",
           "    return bool(module._forward_hooks or module._forward_pre_hooks or "
           "module._backward_hooks\n",
           "    return bool(module._forward_hooks or module._backward_hooks\n",
           "the skip-__call__ rule ignores forward pre-hooks (a replay or a remembered call skips "
           "them)"),
    Mutant("skip_call_ignores_instance_forward", "compilation/module_call.py",
           "                or \"forward\" in module.__dict__\n",
           "",
           "the skip-__call__ rule ignores a forward set on the instance"),
    Mutant("input_dtype_unchecked", "runtime/inputs.py",
           "        if t.dtype != spec.dtype:\n",
           "        if False:\n",
           "a step's input of another dtype than its spec is not refused (it is cast)"),
    Mutant("copy_back_skipped", "runtime/buffers.py",
           '                    target.copy_(buf[:num_tokens if kind == "tokens" else '
           "(reqs or 0)])\n",
           "                    pass\n",
           "an input the model wrote is not written back into the caller's tensor"),
    # -- dispatch and padding (runtime/dispatcher.py, sizes.py) ----------------------------------
    Mutant("dispatch_memo_without_uniform", "runtime/dispatcher.py",
           "        memo_key = (num_tokens, type(num_tokens), uniform_decode, has_lora, "
           "num_active_loras,\n",
           "        memo_key = (num_tokens, type(num_tokens), has_lora, num_active_loras,\n",
           "the dispatcher's memo forgets uniform_decode (a decode step gets a mixed one's "
           "graph, or the reverse)"),
    Mutant("padding_table_shifted", "sizes.py",
           "    i = bisect.bisect_left(capture_sizes, num_tokens)\n",
           "    i = bisect.bisect_right(capture_sizes, num_tokens)\n",
           "the padding table maps each capture size to the next one (and the largest to 0)"),
    # -- the output cut (runtime/outputs.py) ------------------------------------------------------
    Mutant("cut_keeps_padding", "runtime/outputs.py",
           '        return t[:num_tokens] if t.shape[0] == padded_tokens else t.detach()\n',
           "        return t.detach()\n",
           "an output is not cut to the real rows"),
    Mutant("cut_rebuilds_lists", "runtime/outputs.py",
           "        return rebuild(parts)\n",
           "        return list(parts) if isinstance(out, tuple) else rebuild(parts)\n",
           "a tuple or namedtuple output comes back as a list"),
    Mutant("dataclass_output_uncut", "runtime/outputs.py",
           "        node = _node(out)\n        if node is None:\n            if kinds != \"none\" "
           "and _holds_tensor(out):\n",
           "        node = None if hasattr(out, '__dataclass_fields__') else _node(out)\n"
           "        if node is None:\n            if kinds != \"none\" and _holds_tensor(out) "
           "and not hasattr(out, '__dataclass_fields__'):\n",
           "a dataclass output is not cut to the real rows (returned with its padding rows)"),
    # -- replay (graphs/replay.py, graphs/wrapper.py) ---------------------------------------------
    Mutant("replay_no_copy_back", "graphs/replay.py",
           "            if written and now.untyped_storage().data_ptr() not in output:\n",
           "            if False:\n",
           "a replay does not copy back into a new input tensor the graph wrote"),
    Mutant("replay_no_copy_in", "graphs/replay.py",
           "        _write(then, now)\n        shared.copies.n += 1\n",
           "        shared.copies.n += 1\n",
           "a replay given a new tensor reads the captured buffer's old data"),
    Mutant("replay_of_another_owner", "graphs/wrapper.py",
           "        if owner is ANY_OWNER:\n            return next(",
           "        if True:\n            return next(",
           "a runner replays a graph another runner (or a low-level call) captured"),
    Mutant("graphs_kept_after_weights_replaced", "compilation/graph_steps.py",
           "    for wrapper in holding:\n        wrapper.clear()\n",
           "    for wrapper in holding:\n        pass\n",
           "graphs that read a replaced weight's old memory are kept"),
    # -- the module-state check and routing (compilation/) ----------------------------------------
    Mutant("whole_way_ignores_hooks", "runtime/steps.py",
           "                 and slices is None and not self._options.dp_sync and not "
           "self.model_hooked())\n",
           "                 and slices is None and not self._options.dp_sync)\n",
           "a runner step of a hooked model is planned (its replay skips the hooks)"),
    Mutant("float_arguments_equal", "compilation/values.py",
           "            return (type(value), repr(value))  # np.float64 is a float too\n",
           "            return (type(value), repr(value))  # np.float64 is a float too\n"
           "        if isinstance(value, float):\n            return (float, 1.0)\n",
           "every Python float argument counts as the same value (a trace of another one is "
           "reused)"),
    Mutant("replaced_weights_unseen", "compilation/module_state.py",
           "                if slots.get(name) is not value\n",
           "                if False\n",
           "a parameter replaced after a capture is not seen as moved (graphs read the old one)"),
    Mutant("state_check_skipped_on_memo", "compilation/model.py",
           "        self._check()\n        last = self._last",
           "        last = self._last",
           "a call of a remembered shape skips the module-state check"),
    Mutant("hooks_change_unseen", "compilation/module_state.py",
           "        if now.hooks != self.hooks:\n",
           "        if False:\n",
           "a forward hook added to a submodule after the trace is not a difference"),
    Mutant("class_attr_unseen", "compilation/outside_reads.py",
           "            if now != then:\n                return (f\"the class attribute",
           "            if False:\n                return (f\"the class attribute",
           "a class attribute forward reads, changed after the trace, is not a difference"),
    # -- values from outside the module (compilation/outside_reads.py) ----------------------------
    Mutant("outside_value_unchecked", "compilation/outside_reads.py",
           "        for j, read in enumerate(self.globals):\n            expr = ",
           "        for j, read in enumerate(()):\n            expr = ",
           "the every-call check skips the globals forward reads (a changed one is not seen)"),
    Mutant("global_change_unseen", "compilation/outside_reads.py",
           "            if now != read.then:\n",
           "            if False:\n",
           "a global forward reads, changed, is no difference for the full check"),
    Mutant("global_compared_by_identity", "compilation/outside_reads.py",
           "        return token(value, _tensor_token)\n",
           "        return (\"object\", id(value))\n",
           "a global forward reads is compared by identity only (an equal new value is refused)"),
    Mutant("training_unseen", "compilation/module_state.py",
           "        if now.training != self.training:\n",
           "        if False:\n",
           "a submodule's train/eval flag changed after the trace is not a difference"),
    Mutant("memo_route_unchecked", "compilation/model.py",
           "        if (last is not None and not kwargs and len(args) == last.count and "
           "last.check(*args)\n",
           "        if (last is not None and not kwargs and len(args) == last.count\n",
           "a call goes where the last remembered one went without its tensor check"),
    Mutant("refuses_after_a_change", "compilation/model.py",
           "            if why is None:\n                moved = state.moved_tensors()\n",
           "            if why is None and False:\n                moved = state.moved_tensors()\n",
           "any change the cheap check sees (a weight replaced, an equal attribute) is refused"),
    Mutant("refuses_every_later_call", "compilation/model.py",
           "        last = self._last  # the last remembered call served: is this one alike?\n",
           "        raise CompileError(f\"{self.model_key}: the module changed after its first "
           "call was traced: model had 0 forward hook(s) at the trace and has 1 now\")\n",
           "every call after the first is refused, with a hook refusal's words"),
    Mutant("autograd_capture_allowed", "compilation/graph_steps.py",
           "    if any(map(_requires_grad, params)):\n",
           "    if False:\n",
           "a graph step under autograd with parameters that need grad is replayed (no grad)"),
)


def apply(root: Path, mutant: Mutant) -> None:
    path = root / "freezeframe" / mutant.file
    text = path.read_text()
    count = text.count(mutant.original)
    if count != 1:
        raise LookupError(f"{mutant.file}: the snippet occurs {count} times (re-point it)")
    path.write_text(text.replace(mutant.original, mutant.replacement))


def snapshot(into: Path) -> Path:
    """The library and the tests as they are now, copied (a run takes hours: edits made to the
    working tree meanwhile do not reach the mutants still to run)."""
    for part in ("src", "tests"):
        shutil.copytree(REPO / part, into / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", into / "pyproject.toml")
    return into


# What the fast slice runs per mutant: its seeds, the floor test, and the named cases (the found
# bugs' regression cases and the cases named after the mutants they kill), Inductor's left out.
SELECTION = ("test_seed or compares_most_calls or test_regression or test_named_kill",
             "not inductor")
BASELINE = Mutant("(none: the library as it is)", "__init__.py", "", "", "the baseline")


def run(mutant: Mutant, seeds: int, python: str, base: Path,
        baseline: frozenset[str] = frozenset(), first: bool = False,
        named_only: bool = False) -> dict[str, object]:
    """One mutant against the selection; killed when a test fails that passes without it
    (``baseline``: the tests that fail on the library as it is, left out). ``first``: stop at
    the first failure (the named cases run first)."""
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(base / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
        if mutant is not BASELINE:
            try:
                apply(src, mutant)
            except LookupError as exc:
                return {"name": mutant.name, "status": "not applied", "why": str(exc)}
        env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{base}", FF_MATRIX="fast",
                   FF_MATRIX_SHRINK="0", FF_MATRIX_SEEDS=str(seeds))
        where = subprocess.run([python, "-c", "import freezeframe; print(freezeframe.__file__)"],
                               env=env, capture_output=True, text=True, cwd=base)
        if not where.stdout.startswith(str(src)):
            raise RuntimeError(f"the mutant's copy is not the one imported: {where.stdout!r}"
                               f"{where.stderr[-500:]}")
        junit = Path(tmp) / "junit.xml"
        began = time.monotonic()
        stop = ["-x", *(f"--deselect={_node_id(name)}" for name in sorted(baseline))] \
            if first else []
        subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                        "no:logging", "tests/matrix/test_kills.py", "tests/matrix", "-k",
                        "test_named_kill" if named_only else SELECTION[0], "-m", SELECTION[1],
                        f"--junitxml={junit}", *stop],
                       env=env, cwd=base, capture_output=True, text=True, timeout=3600)
        failed = [name for name in _failed(junit) if name not in baseline]
    seeds_failed = sorted(int(m.group(1)) for name in failed
                          if (m := re.search(r"seed(\d+)\]", name)))
    named = sorted(m.group(1) for name in failed
                   if (m := re.search(r"(?:test_regression|test_named_kill)(?:\[|_)(\w+)", name)))
    floor = any("compares_most_calls" in name for name in failed)
    return {"name": mutant.name, "status": "killed" if failed else "survived",
            "seeds": seeds_failed, "named": named, "floor": floor, "failed": failed,
            "seconds": round(time.monotonic() - began)}


def check(mutant: Mutant, python: str) -> str:
    """Whether the mutant applies and the mutated library still imports."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(REPO / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
        try:
            apply(src, mutant)
        except LookupError as exc:
            return f"not applied: {exc}"
        module = "freezeframe." + mutant.file.removesuffix(".py").replace("/", ".")
        proc = subprocess.run([python, "-c", f"import {module}"], capture_output=True,
                              text=True, env=dict(os.environ, PYTHONPATH=str(src)))
        return "applies" if proc.returncode == 0 else f"does not import: {proc.stderr[-300:]}"


def _failed(junit: Path) -> list[str]:
    """The failed tests of a junit report, as ``tests.matrix.test_x::test_y[param]``."""
    if not junit.exists():
        return ["(pytest wrote no report: it failed to start)"]
    tree = ET.parse(junit)
    return [f"{case.get('classname', '')}::{case.get('name', '')}"
            for case in tree.iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None]


def _node_id(name: str) -> str:
    """``tests.matrix.test_x::test_y[p]`` as pytest's node id (for --deselect)."""
    module, _, test = name.partition("::")
    return f"{module.replace('.', '/')}.py::{test}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--seeds", type=int, default=88, help="fast-slice seeds (default 88)")
    parser.add_argument("--first", action="store_true",
                        help="stop each mutant's run at its first failure (quicker; the cases "
                             "that fail are then not all counted)")
    parser.add_argument("--named-only", action="store_true",
                        help="run only the named kill cases (tests/matrix/test_kills.py), every "
                             "one, to count how many kill each mutant")
    parser.add_argument("--assume-failing", action="append", default=None, metavar="TEST",
                        help="a test taken as failing without a mutant, as the baseline run "
                             "prints it (repeatable; skips the baseline run; 'none': none)")
    parser.add_argument("--check", action="store_true",
                        help="only apply each mutant to a copy and import it (re-pointing)")
    args = parser.parse_args()
    by_name = {m.name: m for m in MUTANTS}
    chosen = [by_name[n] for n in args.names] if args.names else list(MUTANTS)
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:38} {m.file:30} {m.what}")
        return
    if args.check:
        for m in chosen:
            print(f"{m.name}: {check(m, sys.executable)}", flush=True)
        return
    results = []
    base = snapshot(Path(tempfile.mkdtemp(prefix="mutate-base-")))
    # the tests that fail without any mutant (open bugs) kill no mutant
    if args.assume_failing is not None:
        baseline = frozenset(args.assume_failing) - {"none"}
        print(f"baseline (assumed): {sorted(baseline)}", flush=True)
    else:
        first = run(BASELINE, args.seeds, sys.executable, base, named_only=args.named_only)
        baseline = frozenset(typing.cast("list[str]", first["failed"]))
        print(f"baseline: {len(baseline)} test(s) fail without a mutant {sorted(baseline)} "
              f"({first['seconds']} s)", flush=True)
    for mutant in chosen:
        result = run(mutant, args.seeds, sys.executable, base, baseline, args.first,
                     args.named_only)
        results.append(result)
        print(f"{mutant.name}: {result['status']}"
              + (f", {len(result['seeds'])} seed(s) {result['seeds']}"  # type: ignore[arg-type]
                 f", named {result['named']}"
                 f"{', the floor' if result['floor'] else ''} ({result['seconds']} s)"
                 if result["status"] != "not applied" else f" ({result['why']})"),
              flush=True)
    applied = [r for r in results if r["status"] != "not applied"]
    killed = [r for r in applied if r["status"] == "killed"]
    print(f"\n{len(killed)} of {len(applied)} mutants killed"
          f" ({100 * len(killed) / max(1, len(applied)):.0f}%)\n")
    shutil.rmtree(base, ignore_errors=True)
    print("| mutant | what | result | seeds that failed | named cases that failed |\n"
          "|---|---|---|---|---|")
    by_name = {m.name: m for m in MUTANTS}
    for r in results:
        seeds = r.get("seeds", [])
        shown = (f"{len(seeds)}: {seeds}" if seeds else "-")  # type: ignore[arg-type]
        if r.get("floor"):
            shown += " + the floor test"
        named = ", ".join(r.get("named", [])) or "-"  # type: ignore[arg-type]
        print(f"| {r['name']} | {by_name[str(r['name'])].what} | {r['status']} | {shown} "
              f"| {named} |")


if __name__ == "__main__":
    main()
