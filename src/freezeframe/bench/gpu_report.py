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

from freezeframe.bench.gpu_steps import STEPS, CheckRun, StepResult

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
        "budget_s": run.budget_s or None, "total_s": round(run.elapsed(), 1),
        "passed": not failed,
        "complete": len(results) == len(STEPS),
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
    if not gpu:
        lines += [f"{NO_GPU_FIGURE}: this machine has no CUDA device "
                  "(torch.cuda.is_available() is False). The CUDA tests, the capture report and "
                  "the micro-batch trace were skipped; the bench ran the CPU preset, where "
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
    lines += [f"Result: {verdict}. Mode: {'--quick' if run.opts.quick else 'full'}; total "
              f"{run.elapsed():.0f} s" + (f" (budget {run.budget_s:.0f} s)" if run.budget_s
                                          else "") + ". Produced by `scripts/gpu_check`; the "
              "raw data is in `gpu_check.json`.", "",
              "| step | status | time | what was checked |", "|---|---|---|---|"]
    for r in results:
        text = r.summary if r.status == "passed" else (
            r.reason + (f" ({r.summary})" if r.summary else ""))
        lines.append(f"| {r.name} | {r.status} | {r.seconds:.1f} s | "
                     f"{text.replace('|', '/')} |")
    return lines


def _sections(run: CheckRun, results: Sequence[StepResult]) -> list[str]:
    """A section per step reached (the environment first), each followed by its files."""
    by_name = {r.name: r for r in results}
    lines = ["", *_environment_section(run.env_info)]
    if results[0].files:
        lines += ["", f"Files: {', '.join(f'`{f}`' for f in results[0].files)}"]
    for name, section in (("tests", _tests_section), ("bench", _bench_section),
                          ("capture", _capture_section), ("ubatch", _ubatch_section),
                          ("cache", _cache_section)):
        found = by_name.get(name)
        if found is None:  # not reached yet (the report is written after every step)
            continue
        r = found
        if r.status != "skipped" and r.details:
            lines += ["", *section(r)]
        if r.files:
            lines += ["", f"Files: {', '.join(f'`{f}`' for f in r.files)}"]
    return lines


def _environment_section(info: Mapping[str, Any]) -> list[str]:
    if not info:
        return ["## Environment", "", "The environment probe did not report (see above)."]
    pk = info.get("packages", {})
    rows = [("Python", info.get("python")), ("platform", info.get("platform")),
            ("freezeframe", f"{info.get('freezeframe')} ({info.get('freezeframe_path')})"),
            ("torch", f"{pk.get('torch')} (CUDA build: {info.get('torch_cuda_build')})"),
            *[(n, pk.get(n) or "not installed") for n in ("triton", "pytest", "hypothesis",
                                                             "tqdm", "matplotlib")]]
    return ["## Environment", "", "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]]


def _tests_section(r: StepResult) -> list[str]:
    out = ["## Tests", "", "| tier | command | status | pytest summary |", "|---|---|---|---|"]
    for tier in ("cuda", "kernels", "emulated"):
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
    if "table" in r.details:
        out += ["```text", r.details["table"], "```"]
    return out


def _capture_section(r: StepResult) -> list[str]:
    d = r.details
    if "graphs" not in d:
        return []
    out = ["## Capture report", "",
           f"{d['preset']} preset, {d['compiler']} compiler, {d['cudagraph_mode']}, capture "
           f"sizes {d['capture_sizes']}. Total: {len(d['graphs'])} graphs in "
           f"{d['capture_s']:.2f} s, {_mib(d['capture_memory_bytes'])} MiB (growth of the graph "
           "pool's segments, from the caching allocator; the allocator's reserved memory grew "
           f"{_mib(d['reserved_growth_bytes'])} MiB). " + _prediction_line(d), "",
           "| mode | tokens | requests | uniform | capture ms | memory MiB | predicted MiB |",
           "|---|---|---|---|---|---|---|"]
    out += [f"| {g['mode']} | {g['num_tokens']} | {g['num_reqs'] or ''} | {g['uniform']} | "
            f"{g['seconds'] * 1e3:.1f} | {_mib(g['memory_bytes'])} | "
            + ("measured (probe)" if g.get("probe") else
               _mib(g["predicted_bytes"]) if g.get("predicted_bytes") is not None else "")
            + " |" for g in d["graphs"]]
    out += ["", "| replay check | graph steps | relative error vs uncompiled | repeatable |",
            "|---|---|---|---|"]
    out += [f"| {c['step']} | {c['graph_replays']}/2 | {c['relative_error']:.3g} | "
            f"{c['replay_repeatable']} |" for c in d["replay_checks"]]
    return out


def _prediction_line(d: Mapping[str, Any]) -> str:
    predicted = d.get("predicted_memory_bytes")
    if predicted is None:
        return "No prediction was made before the capture."
    error = d.get("prediction_error")
    return (f"Predicted before the rest was captured, from the probes captured first: "
            f"{_mib(predicted)} MiB" + (f" ({error:+.1%} against the measurement)."
                                        if error is not None else "."))


def _cache_section(r: StepResult) -> list[str]:
    d = r.details
    if "starts" not in d:
        return []
    out = ["## Compile cache: cold vs warm start", "",
           f"{d['preset']} preset on {d['device']}, Inductor; each start a fresh process.", "",
           "| start | first call s | process s | counters |", "|---|---|---|---|"]
    keys = ("inductor_compiles", "cache_hits", "cache_misses", "artifacts_loaded")
    for name, s in d["starts"].items():
        counters = " ".join(f"{k}={s['stats'].get(k, 0)}" for k in keys)
        out.append(f"| {name} | {s['first_call_s']:.2f} | {s['process_s']:.2f} | {counters} |")
    out += ["", f"Warm/cold first call {d['warm_cold_first_call']:.1%}; process time minus "
            f"the uncompiled baseline's {d['warm_cold_startup']:.1%}; outputs identical: "
            f"{d['outputs_identical']}."]
    return out


def _ubatch_section(r: StepResult) -> list[str]:
    d = r.details
    if "timeline_ms" not in d:
        return []
    out = ["## Micro-batch overlap", "",
           f"Toy model ({d['tokens']} tokens, hidden {d['hidden']}, fp16 matmuls; a spin "
           f"kernel of about {d['comm_ms_target']:.3f} ms stands in for an all-to-all) split "
           f"into {d['micro_batches']} micro-batches by `MicroBatchWrapper`: step "
           f"{d['split_step_ms']:.3f} ms vs {d['unsplit_step_ms']:.3f} ms unsplit (median). "
           f"Chrome trace: `{d['trace']}` (open in chrome://tracing or ui.perfetto.dev).", "",
           "| phase | start ms | end ms |", "|---|---|---|"]
    out += [f"| {k} | {a:.3f} | {b:.3f} |" for k, (a, b) in d["timeline_ms"].items()]
    out += ["", *[f"- {k}: {'overlaps' if v else 'NO overlap'}" for k, v in
                  d["overlaps"].items()],
            f"- kernels per stream in the trace: {d['trace_overlap']['kernels_per_stream']}, "
            f"overlapping pairs: {d['trace_overlap']['overlapping_pairs']}"]
    return out
