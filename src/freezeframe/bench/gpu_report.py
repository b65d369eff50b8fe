"""The report of a ``scripts/gpu_check`` run: ``gpu_check.json`` (every step's result) and a
``README.md`` with a table per step, both rewritten after every step so that a run cut short
keeps what it finished. Only the standard library is imported here.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

from freezeframe.bench.gpu_run import CheckRun, StepResult
from freezeframe.bench.gpu_steps import STEPS

__all__ = ["NO_GPU_FIGURE", "write_report"]

NO_GPU_FIGURE = "**No GPU figure was produced**"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def write_report(run: CheckRun, results: Sequence[StepResult]) -> None:
    """``gpu_check.json`` and ``README.md`` in the out dir."""
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    gpu: dict[str, Any] = run.env_info.get("gpu") or {}
    failed = [r.name for r in results if r.status == "failed"]
    doc = {
        "date": date, "cuda": run.cuda, "gpu": gpu or None, "quick": run.opts.quick,
        "dry_run": run.dry, "budget_s": run.budget_s or None,
        "total_s": round(run.elapsed(), 1), "passed": not failed,
        "complete": len(results) == len(STEPS),
        "left_out_of_raw": run.env_info.get("left_out_of_raw", []),
        "steps": [dataclasses.asdict(r) for r in results],
    }
    (run.out / "gpu_check.json").write_text(json.dumps(doc, indent=2, default=str))
    lines = [*_headline(run, results, date, failed), *_sections(run, results)]
    (run.out / "README.md").write_text("\n".join(lines) + "\n")


def _headline(run: CheckRun, results: Sequence[StepResult], date: str,
              failed: Sequence[str]) -> list[str]:
    """The README's title, the machine, the verdict and the table of steps."""
    gpu: dict[str, Any] = run.env_info.get("gpu") or {}
    title = gpu["name"] if gpu else "CPU only"
    lines = [f"# freezeframe GPU check: {title}, {date[:10]}", ""]
    if run.dry:
        lines += [f"{NO_GPU_FIGURE}: a dry run (`--dry-run`) rehearses the GPU run on the "
                  "CPU: every step at the tiniest shapes on the emulated graph backend, the "
                  "test tiers' commands written but not run. It checks the steps, the files and "
                  "the plan, not a GPU.", ""]
    elif not gpu:
        lines += [f"{NO_GPU_FIGURE}: this machine has no CUDA device "
                  "(torch.cuda.is_available() is False). The CUDA tests, the micro-batch probe "
                  "and the warm start were skipped; the bench ran the CPU preset, where "
                  "freezeframe's graph modes use the emulated backend. Nothing here measures a "
                  "GPU.", ""]
    else:
        lines += [f"GPU: {gpu['name']}, {gpu['memory_bytes'] / 2**30:.1f} GiB, compute "
                  f"capability {gpu['capability']}, driver {gpu['driver']}, CUDA "
                  f"{run.env_info.get('torch_cuda_build')}.", ""]
    verdict = f"**FAILED**: {', '.join(failed)}" if failed else "all checks passed"
    if len(results) < len(STEPS):
        verdict = (f"in progress, {len(results)} of {len(STEPS)} steps reached; so far: "
                   + verdict)
    mode = "--dry-run" if run.dry else "--quick" if run.opts.quick else "full"
    lines += [f"Result: {verdict}. Mode: {mode}; total {run.elapsed():.0f} s"
              + (f" (budget {run.budget_s:.0f} s)" if run.budget_s else "")
              + ". Produced by `scripts/gpu_check`; the figures are in `gpu_check.json` and "
              "`bench.json`, every log in `raw.tar.gz`.", "",
              "| step | status | time | deadline | what was checked |", "|---|---|---|---|---|"]
    for r in results:
        text = r.summary if r.status == "passed" else (
            r.reason + (f" ({r.summary})" if r.summary else ""))
        deadline = f"{r.deadline_s:.0f} s" if r.deadline_s else ""
        lines.append(f"| {r.name} | {r.status} | {r.seconds:.1f} s | {deadline} | "
                     f"{text.replace('|', '/')} |")
    return lines


def _sections(run: CheckRun, results: Sequence[StepResult]) -> list[str]:
    """A section per step reached (the environment first), each followed by its files (in
    ``raw.tar.gz``, under ``raw/``)."""
    by_name = {r.name: r for r in results}
    lines = ["", *_environment_section(run.env_info)]
    for name, section in (("environment", None), ("kernels", _tests_section),
                          ("splitkv", _splitkv_section), ("bench", _bench_section),
                          ("tests", _tests_section), ("ubatch", _ubatch_section),
                          ("cache", _cache_section)):
        r = by_name.get(name)
        if r is None:  # not reached yet (the report is written after every step)
            continue
        if section is not None and r.status != "skipped" and r.details:
            lines += ["", *section(r)]
        if r.files:
            lines += ["", f"Files (in `raw.tar.gz`): {', '.join(f'`{f}`' for f in r.files)}"]
    return lines


def _environment_section(info: Mapping[str, Any]) -> list[str]:
    if not info:
        return ["## Environment", "", "The environment probe did not report (see above)."]
    pk = info.get("packages", {})
    rows = [("Python", info.get("python")), ("platform", info.get("platform")),
            ("freezeframe", f"{info.get('freezeframe')} ({info.get('freezeframe_path')})"),
            ("torch", f"{pk.get('torch')} (CUDA build: {info.get('torch_cuda_build')})"),
            *[(n, pk.get(n) or "not installed") for n in (
                "triton", "transformers", "pytest", "xdist", "hypothesis", "tqdm",
                "matplotlib")]]
    return ["## Environment", "", "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]]


def _tests_section(r: StepResult) -> list[str]:
    out = [f"## Tests: {r.name}", "", "| tier | command | status | pytest summary |",
           "|---|---|---|---|"]
    for tier in ("kernels", "cuda", "emulated"):
        info = r.details.get(tier)
        if info is None:
            continue
        if info.get("status") == "skipped":
            out.append(f"| {tier} | | skipped | {info['reason']} |")
        else:
            out.append(f"| {tier} | `{info['command']}` | {info['status']} | {info['summary']} |")
    return out


def _bench_section(r: StepResult) -> list[str]:
    out = ["## Bench", "", f"`{r.details.get('command', '')}`", ""]
    if r.details.get("planned_steps"):
        out += ["Timed steps run from the runner's plan, per mode: " + ", ".join(
            f"{m} {v}" for m, v in r.details["planned_steps"].items()) + ".", ""]
    if "table" in r.details:
        out += ["```text", r.details["table"], "```"]
    return out


def _splitkv_section(r: StepResult) -> list[str]:
    """The probe's rows side by side: per batch size and context, split-KV off and on, their
    ratio and what ``"auto"`` chose; then per batch size the longest context over the
    shortest, off, on and auto."""
    d = r.details
    rows = {(x["batch"], x["context"], x["split_kv"]): x for x in d.get("rows", [])}
    if not rows:
        return []
    shape, auto = d["shape"], d.get("auto_splits", {})
    out = ["## Split-KV: the attention op alone", "",
           f"{shape['preset']} preset's decode attention, {shape['layers']} layers' calls per "
           f"step ({shape['heads']} query heads, {shape['kv_heads']} KV heads, head dim "
           f"{shape['head_dim']}, blocks of {shape['block_size']}, a table of "
           f"{shape['max_blocks']} blocks, {shape['dtype']}) on {d['device']}: {d['timing']}; "
           f"{d['steps']} timed after {d['warmup']}. ms per step; every row's output within "
           f"{d['tolerance']} of a float32 reference (relative L2) unless a problem says so.",
           "", "| batch | context | off ms | on ms | on splits | off/on | auto splits |",
           "|---|---|---|---|---|---|---|"]

    def auto_of(bs: int) -> str:
        n = auto.get(str(bs))
        on = next((x["splits"] for (b, _, m), x in rows.items() if b == bs and m == "on"), None)
        return "" if n is None else f"{n} (= {'off' if n == 1 else 'on' if n == on else '?'})"

    for bs in d["batch_sizes"]:
        for context in d["contexts"]:
            off, on = rows.get((bs, context, "off")), rows.get((bs, context, "on"))
            cells = [f"{off['ms']:.4f}" if off else "", f"{on['ms']:.4f}" if on else "",
                     str(on["splits"]) if on else "",
                     f"{off['ms'] / on['ms']:.2f}" if off and on else ""]
            out.append(f"| {bs} | {context} | {' | '.join(cells)} | {auto_of(bs)} |")
    short, long = min(d["contexts"]), max(d["contexts"])
    out += ["", f"| batch | off {long}/{short} | on {long}/{short} | auto {long}/{short} |",
            "|---|---|---|---|"]
    for bs in d["batch_sizes"]:
        cells = []
        for mode in ("off", "on", "auto"):
            if mode == "auto":
                mode = "off" if auto.get(str(bs)) == 1 else "on"
            a, b = rows.get((bs, long, mode)), rows.get((bs, short, mode))
            cells.append(f"{a['ms'] / b['ms']:.2f}" if a and b else "")
        out.append(f"| {bs} | {' | '.join(cells)} |")
    return out


def _ubatch_section(r: StepResult) -> list[str]:
    d = r.details
    if "split_step_ms" not in d:
        return []
    timeline = d.get("timeline", {})
    overlaps = timeline.get("comm_overlaps", [])
    out = ["## Micro-batch overlap, captured", "",
           f"Toy model ({d['tokens']} tokens, hidden {d['hidden']}) split into "
           f"{d['micro_batches']} micro-batches by `MicroBatchWrapper` and captured whole as one "
           f"FULL graph in {d['capture_s']:.3f} s; the replay differs from the unsplit model by "
           f"{d['max_rel_diff_vs_unsplit']:.2g} of its largest output. Replay "
           f"{d['split_step_ms']:.3f} ms, unsplit {d.get('unsplit_step_ms', float('nan')):.3f} "
           f"ms, eager threaded split {d.get('eager_split_step_ms', float('nan')):.3f} ms "
           "(medians).", "",
           f"Spin kernels (the simulated communication) overlapping a compute kernel in the "
           f"profiled replays: {sum(overlaps)} of {len(overlaps)} ({overlaps}); overlapping "
           f"kernel pairs on different streams: "
           f"{d.get('trace_overlap', {}).get('overlapping_pairs')}. Chrome trace: "
           f"`{d.get('trace')}` (open in ui.perfetto.dev).", "",
           "| start ms | end ms | kernel |", "|---|---|---|"]
    out += [f"| {a:.4f} | {b:.4f} | {name} |" for a, b, name in timeline.get("kernels", [])[:40]]
    return out


def _cache_section(r: StepResult) -> list[str]:
    d = r.details
    if "first_call_s" not in d:
        return []
    ratio = d.get("warm_cold_first_call")
    out = ["## Compile cache: a warm start", "",
           f"{d['preset']} preset on {d['device']}: the bench's first graph mode started again "
           "in a fresh process from freezeframe's cache, Inductor's own cache empty.", "",
           "| stage | seconds |", "|---|---|"]
    out += [f"| {k} | {v:.2f} |" for k, v in d.get("stages", {}).items()]
    out += ["", f"First call {d['first_call_s']:.2f} s"
            + (f", the bench's cold one {d['cold_first_call_s']:.2f} s: warm/cold {ratio:.1%}"
               if ratio is not None else "") + f". Counters: {d.get('stats')}."]
    return out
