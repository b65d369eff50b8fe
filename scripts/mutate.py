"""Mutation testing of the differential matrix: how many real bugs, injected one at a time into
the library, does the fast slice find, and with how many seeds?

Each mutant is a small record: a file under src/freezeframe, a snippet of it that must occur
exactly once, and what replaces it. For each mutant the script copies src/ to a temporary
directory, applies the mutant there (never to the working tree), and runs the matrix's fast
slice (its seeds and its floor test, no shrinking) against that copy. A mutant is *killed*
when a test fails; the seeds that failed are counted. A mutant whose snippet is not found any
more (the code moved on) is reported as such, to be re-pointed.

    python scripts/mutate.py                 # every mutant (long: one fast slice each)
    python scripts/mutate.py --list          # the mutants, in words
    python scripts/mutate.py plan_key_without_dtype copy_back_skipped   # some of them
    python scripts/mutate.py --seeds 30      # against the first 30 seeds only (quicker)

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
    # -- the runner's planned steps (runtime/plan.py, runtime/buffers.py) -----------------------
    Mutant("plan_skips_last_input_copy", "runtime/plan.py",
           "        self._static.stage_into(plan.staging, args)\n",
           "        self._static.stage_into(dataclasses.replace(\n"
           "            plan.staging, targets=plan.staging.targets[:-1]), args[:-1])\n",
           "a planned step copies every input but its last into the static buffers"),
    Mutant("plan_skips_state_check", "compilation/graph_steps.py",
           "    def checked() -> Any:\n        check()\n        return on_captured()\n",
           "    def checked() -> Any:\n        return on_captured()\n",
           "a planned FULL step skips the module-state check"),
    Mutant("plan_same_tensor_object", "runtime/plan.py",
           "        return out.detach() if out.__class__ is torch.Tensor else "
           "map_tensors(out, alias)\n",
           "        return out\n",
           "a planned FULL step hands out the same tensor object every step"),
    Mutant("plan_key_without_dtype", "runtime/plan.py",
           '_input_key = operator.attrgetter("__class__", "shape", "dtype", "device")',
           '_input_key = operator.attrgetter("__class__", "shape", "device")',
           "a plan's key leaves out the input's dtype (another dtype is cast silently)"),
    Mutant("plan_ignores_hooks", "runtime/plan.py",
           "        if not self.plans or self.model_hooked():\n",
           "        if not self.plans:\n",
           "a planned step skips the compiled model's hooks registered after the plan"),
    Mutant("piecewise_plan_cut_reused", "runtime/plan.py",
           "        if out is plan.last_out:",
           "        if plan.last_out is not None:",
           "a planned PIECEWISE step reuses the last cut even for a new output tensor"),
    # -- inputs, staging, copy-back ------------------------------------------------------------
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
           "        for n in range(prev + 1, size + 1):\n",
           "        for n in range(prev, size):\n",
           "the padding table maps each capture size to the next one (and the largest to 0)"),
    # -- the output cut (runtime/outputs.py) ------------------------------------------------------
    Mutant("cut_keeps_padding", "runtime/outputs.py",
           '        return t[:num_tokens] if t.shape[0] == padded_tokens else t.detach()\n',
           "        return t.detach()\n",
           "an output is not cut to the real rows"),
    Mutant("cut_rebuilds_lists", "runtime/outputs.py",
           '            return type(out)(parts) if not hasattr(out, "_fields") else '
           "type(out)(*parts)\n",
           "            return list(parts)\n",
           "a tuple or namedtuple output comes back as a list"),
    # -- replay (graphs/replay.py, graphs/wrapper.py) ---------------------------------------------
    Mutant("replay_no_copy_back", "graphs/replay.py",
           "                if now.untyped_storage().data_ptr() not in self._output_memory:\n"
           "                    now.copy_(then)\n",
           "                pass\n",
           "a replay does not copy back into a new input tensor the graph wrote"),
    Mutant("replay_no_copy_in", "graphs/replay.py",
           "        then.copy_(now)\n        shared.copies.n += 1\n",
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
    Mutant("whole_way_ignores_hooks", "runtime/plan.py",
           "        hooked = self.model_hooked()  # its hooks run in __call__: no direct replay "
           "then\n",
           "        hooked = False\n",
           "a runner step of a hooked model replays its FULL graph directly (no hooks run)"),
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
           "            return super().__call__(*args, **kwargs)\n        state = self._state\n"
           "        if state is not None and (self._check_state_every_call or "
           "state.changed_cheaply()):\n",
           "            return super().__call__(*args, **kwargs)\n        state = self._state\n"
           "        if False:\n",
           "a call routed by the exact-key memo skips the module-state check"),
    Mutant("hooks_change_unseen", "compilation/module_state.py",
           "        if now.hooks != self.hooks:\n",
           "        if False:\n",
           "a forward hook added to a submodule after the trace is not a difference"),
    Mutant("class_attr_unseen", "compilation/module_state.py",
           "            if now != then:\n                return (f\"the class attribute",
           "            if False:\n                return (f\"the class attribute",
           "a class attribute forward reads, changed after the trace, is not a difference"),
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
           "        why = state.difference()\n        if why is None:\n",
           "        why = state.difference()\n        if why is None and False:\n",
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


def run(mutant: Mutant, seeds: int, python: str, base: Path) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(base / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
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
        subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                        "no:logging", "tests/matrix", "-k",
                        "test_seed or compares_most_calls", f"--junitxml={junit}"],
                       env=env, cwd=base, capture_output=True, text=True, timeout=3600)
        failed = _failed(junit)
    seeds_failed = sorted(int(m.group(1)) for name in failed
                          if (m := re.search(r"seed(\d+)\]", name)))
    floor = any("compares_most_calls" in name for name in failed)
    return {"name": mutant.name, "status": "killed" if failed else "survived",
            "seeds": seeds_failed, "floor": floor, "seconds": round(time.monotonic() - began)}


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
    if not junit.exists():
        return ["(pytest wrote no report: it failed to start)"]
    tree = ET.parse(junit)
    return [case.get("name", "") for case in tree.iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--seeds", type=int, default=88, help="fast-slice seeds (default 88)")
    parser.add_argument("--check", action="store_true",
                        help="only apply each mutant to a copy and import it (re-pointing)")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
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
    for mutant in chosen:
        result = run(mutant, args.seeds, sys.executable, base)
        results.append(result)
        print(f"{mutant.name}: {result['status']}"
              + (f", {len(result['seeds'])} seed(s) {result['seeds']}"  # type: ignore[arg-type]
                 f"{', the floor' if result['floor'] else ''} ({result['seconds']} s)"
                 if result["status"] != "not applied" else f" ({result['why']})"),
              flush=True)
    applied = [r for r in results if r["status"] != "not applied"]
    killed = [r for r in applied if r["status"] == "killed"]
    print(f"\n{len(killed)} of {len(applied)} mutants killed"
          f" ({100 * len(killed) / max(1, len(applied)):.0f}%)\n")
    shutil.rmtree(base, ignore_errors=True)
    print("| mutant | what | result | seeds that failed |\n|---|---|---|---|")
    by_name = {m.name: m for m in MUTANTS}
    for r in results:
        seeds = r.get("seeds", [])
        shown = (f"{len(seeds)}: {seeds}" if seeds else "-")  # type: ignore[arg-type]
        if r.get("floor"):
            shown += " + the floor test"
        print(f"| {r['name']} | {by_name[str(r['name'])].what} | {r['status']} | {shown} |")


if __name__ == "__main__":
    main()
