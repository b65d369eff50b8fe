"""The bench's plain-text report: one row per mode (decode per batch size, the floor share and
the ratio to the best peer, decode per context, mixed, prefill, startup, host time, planned
steps, launches, the check against eager), then the decode grid, the comparisons, the Hugging
Face rows, the capture of the default ladder and the profiler table of one FULL decode replay.
A cell a mode did not time is ``-``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["format_table"]


def _ms(row: Mapping[str, Any] | None, key: str = "median_ms", scale: float = 1.0,
        fmt: str = "{:.3f}") -> str:
    if not row or row.get(key) is None:
        return "-"
    return fmt.format(row[key] * scale)


def _main_rows(result: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    sizes, contexts = result["batch_sizes"], result["contexts"]
    b0 = 1 if 1 in sizes else sizes[0]
    head = ["mode", *[f"decode bs{b} ms" for b in sizes], f"floor% bs{b0}", f"vs peer bs{b0}",
            *[f"ctx{c} ms" for c in contexts],
            *([f"ctx{contexts[-1]}/{contexts[0]}"] if len(contexts) > 1 else []),
            f"mixed bs{sizes[-1]} ms", "prefill ms", "startup s", f"host ms bs{b0}", "planned",
            "launches", "vs eager"]
    rows = [head]
    for mode, e in result["modes"].items():
        if "decode" not in e:
            if "generate" in e or "ff-hf" in e:
                continue  # the Hugging Face rows have their own table
            why = e.get("skipped") or e.get("error") or e.get("unsupported") or "not timed"
            rows.append([mode, f"{'skipped' if 'skipped' in e else 'error'}: {why}"])
            continue
        d, ctx = e["decode"], e.get("decode_by_context", {})
        first = d.get(str(b0))
        lo, hi = ctx.get(str(contexts[0])), ctx.get(str(contexts[-1]))
        ratio = f"{hi['median_ms'] / lo['median_ms']:.2f}x" if lo and hi else "-"
        planned = "-" if e.get("planned_steps") is None else \
            f"{e['planned_steps']}/{e['timed_steps']}"
        rows.append([mode, *[_ms(d.get(str(b))) for b in sizes],
                     _ms(first, "floor_share", 100, "{:.1f}"),
                     _ms(first, "vs_best_peer", 1, "{:.2f}x"),
                     *[_ms(ctx.get(str(c))) for c in contexts],
                     *([ratio] if len(contexts) > 1 else []),
                     _ms(e.get("mixed", {}).get(str(sizes[-1]))),
                     _ms(e, "prefill_ms"), _ms(e, "startup_s", fmt="{:.2f}"),
                     _ms(first, "host_ms"), planned, str(e.get("full_decode_launches", "-")),
                     _match_cell(e)])
    return head, rows


def _aligned(head: list[str], rows: list[list[str]]) -> list[str]:
    width = [max(len(r[i]) for r in rows if len(r) == len(head)) for i in range(len(head))]
    lines = []
    for r in rows:
        if len(r) != len(head):
            lines.append(f"{r[0]:<{width[0]}}  {r[1]}")
        else:
            lines.append("  ".join(c.rjust(w) if i else c.ljust(w)
                                   for i, (c, w) in enumerate(zip(r, width, strict=True))))
    return lines


def _grid(result: Mapping[str, Any]) -> list[str]:
    lines = []
    for mode, e in result["modes"].items():
        grid = e.get("decode_grid")
        if not grid:
            continue
        sizes = sorted({int(b) for by_bs in grid.values() for b in by_bs})
        head = [f"{mode}: ctx", *[f"bs{b} ms (floor%, vs peer)" for b in sizes]]
        rows = [head] + [[ctx, *[
            "-" if str(b) not in by_bs else
            f"{by_bs[str(b)]['median_ms']:.3f} ({100 * by_bs[str(b)]['floor_share']:.0f}%, "
            + (f"{by_bs[str(b)]['vs_best_peer']:.2f}x)" if "vs_best_peer" in by_bs[str(b)]
               else "-)") for b in sizes]] for ctx, by_bs in grid.items()]
        lines += _aligned(head, rows)
    return ["decode at every context and batch size:", *lines] if lines else []


def _comparisons(result: Mapping[str, Any]) -> list[str]:
    comp = result.get("comparisons") or {}

    def fmt(v: Any) -> str:
        if isinstance(v, dict):
            return ", ".join(f"{k}: {fmt(x)}" for k, x in v.items())
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    return [f"compare {name}: {fmt(value)}" for name, value in comp.items()]


def _hf_rows(result: Mapping[str, Any]) -> list[str]:
    modes = {m: e for m, e in result["modes"].items() if "generate" in e or m.startswith(
        ("hf-", "ff-hf"))}
    if not modes:
        return []
    sizes = sorted({int(b) for e in modes.values() for b in e.get("generate", {})})
    head = ["HF generate", *[f"bs{b} tok/s" for b in sizes],
            *[f"bs{b} = hf-eager" for b in sizes], "setup s"]
    rows = [head]
    for mode, e in modes.items():
        if "generate" not in e:
            why = (e.get("skipped") or e.get("error") or e.get("unsupported")
                   or "; ".join(f"{k}: " + (f"speed-up {v['speedup']:.2f}x, tokens equal "
                                            f"{v['equal_to_plain_greedy']}" if "speedup" in v
                                            else f"unsupported ({v.get('unsupported')})")
                                for k, v in e.items() if isinstance(v, dict) and
                                ("speedup" in v or "unsupported" in v)) or "not timed")
            rows.append([mode, f"prompt lookup: {why}" if mode == "ff-hf-lookup" else why])
            continue
        g = e["generate"]
        rows.append([mode, *[_ms(g.get(str(b)), "tokens_per_s", fmt="{:.1f}") for b in sizes],
                     *[_ms(g.get(str(b)), "equal_to_hf_eager", 100, "{:.0f}%") for b in sizes],
                     _ms(e, "setup_s", fmt="{:.1f}")])
    return _aligned(head, rows)


def _capture_and_profile(result: Mapping[str, Any]) -> list[str]:
    lines = []
    for mode, e in result["modes"].items():
        capture = e.get("capture")
        if capture:
            lines.append(f"{mode} capture: {capture['summary']}")
            if capture.get("refit_summary"):
                lines.append(f"{mode} refit: {capture['refit_summary']}")
        profile = e.get("full_decode_profile")
        if profile:
            lines.append(f"{mode}, one FULL decode replay (batch size {profile['batch_size']}, "
                         f"context {profile['context']}):")
            lines += [f"  {line}" for line in profile["table"]]
    return lines


def format_table(result: dict[str, Any]) -> str:
    """The report (see the module docstring)."""
    head, rows = _main_rows(result)
    tp = result.get("tensor_parallel", 1)
    where = f"{tp} tensor-parallel ranks of {result['device']}" if tp > 1 else result["device"]
    info = (f"{result['preset']} preset on {where} ({result['dtype']}, torch "
            f"{result['torch']}, compiler {result['compiler']}, attention "
            f"{result['attention_kernel']}), context {result['context']}, max_model_len "
            f"{result['max_model_len']}, bandwidth "
            f"{result['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s")
    sizes = result["batch_sizes"]
    kv = [f"ctx{c}: torch {b['torch'] / 2**20:.3g} MiB, triton {b['triton'] / 2**20:.3g} MiB"
          for c, b in result["kv_bytes_per_decode_token"].items()]
    legend = [f"ctxN ms: decode at context N, batch size {sizes[0]}; vs peer: over the fastest "
              "of eager, compile and reduce-overhead at that step; host ms: the call alone "
              "(without waiting for the device); planned: timed steps run from the runner's "
              "plan; launches: one FULL decode replay (recorded ops when emulated, profiled "
              "device activities on CUDA)"]
    if kv:
        legend.append("KV bytes one decode token reads (all layers): " + "; ".join(kv))
    errors = [f"note: {m} stopped with {e['error']}" for m, e in result["modes"].items()
              if "error" in e and "decode" in e]
    errors += [f"note: {m}: Inductor ran {e['cudagraph_skips']} graph(s) without CUDA graphs "
               "(its log says why): those rows are not reduce-overhead's graphs"
               for m, e in result["modes"].items() if e.get("cudagraph_skips")]
    return "\n".join([info, *_aligned(head, rows), *legend, *_grid(result),
                      *_comparisons(result), *_hf_rows(result), *_capture_and_profile(result),
                      *errors, *[f"note: {n}" for n in result["notes"]]])


def _match_cell(entry: Mapping[str, Any]) -> str:
    if "matches_eager" not in entry:
        return "-"
    verdict = "ok" if entry["matches_eager"] else "DIFFERS"
    return f"{verdict} {entry['max_rel_diff_vs_eager']:.0e}"
