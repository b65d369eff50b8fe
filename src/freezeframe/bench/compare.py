"""The bench's figures set side by side, each from rows measured in the same run.

* On every decode row of every mode, ``vs_best_peer``: its ms over the fastest peer's ms at the
  same context and batch size (peers: eager, torch.compile, reduce-overhead; below 1 is faster
  than every peer that ran that row).
* ``comparisons`` in the result: PIECEWISE over FULL (``piecewise`` over
  ``full_and_piecewise``, whose decode replays FULL graphs) per batch size; each mode's decode
  at its longest context over its shortest; freezeframe's FULL over reduce-overhead; the
  breakable mode against the traced one (startup and decode); ``ff.hf`` against HF's
  ``generate`` (tokens per second) and the prompt-lookup speed-ups.

A figure whose rows are missing (a mode not run, skipped or stopped) is left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["PEERS", "add_comparisons", "decode_rows"]

PEERS = ("eager", "compile", "reduce-overhead")
FULL_MODE = "full_and_piecewise"  # its uniform decode replays FULL graphs


def decode_rows(result: Mapping[str, Any], entry: Mapping[str, Any]
                ) -> dict[tuple[int, int], dict[str, Any]]:
    """Every decode row of a mode's entry, by (context, batch size)."""
    context, sizes = result["context"], result["batch_sizes"]
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for bs, row in entry.get("decode", {}).items():
        rows[(context, int(bs))] = row
    for ctx, row in entry.get("decode_by_context", {}).items():
        rows[(int(ctx), sizes[0])] = row
    for ctx, by_bs in entry.get("decode_grid", {}).items():
        for bs, row in by_bs.items():
            rows[(int(ctx), int(bs))] = row
    return rows


def add_comparisons(result: dict[str, Any]) -> None:
    """``vs_best_peer`` on every decode row and ``result["comparisons"]`` (module docstring)."""
    modes: dict[str, Any] = result["modes"]
    rows = {mode: decode_rows(result, e) for mode, e in modes.items() if "decode" in e}
    best: dict[tuple[int, int], float] = {}
    for peer in PEERS:
        for key, row in rows.get(peer, {}).items():
            best[key] = min(best.get(key, row["median_ms"]), row["median_ms"])
    for by_key in rows.values():
        for key, row in by_key.items():
            if key in best:
                row["vs_best_peer"] = row["median_ms"] / best[key]
    context = result["context"]
    comp: dict[str, Any] = {}

    def per_batch(a: str, b: str) -> dict[str, float]:
        out = {}
        for (ctx, bs), row in sorted(rows.get(a, {}).items()):
            other = rows.get(b, {}).get((ctx, bs))
            if other is not None and ctx == context:
                out[str(bs)] = row["median_ms"] / other["median_ms"]
        return out

    comp["piecewise_over_full"] = per_batch("piecewise", FULL_MODE)
    comp["full_over_reduce_overhead"] = per_batch(FULL_MODE, "reduce-overhead")
    comp["context_ratio"] = _context_ratios(result, rows)
    comp["breakable_vs_traced"] = _breakable(modes, per_batch("breakable", "piecewise"))
    comp.update(_hf(modes))
    result["comparisons"] = {k: v for k, v in comp.items() if v}


def _context_ratios(result: Mapping[str, Any],
                    rows: Mapping[str, Mapping[tuple[int, int], Any]]) -> dict[str, Any]:
    """Per mode and batch size: decode at the longest context over the shortest."""
    contexts = result["contexts"]
    if len(contexts) < 2:
        return {}
    lo, hi = contexts[0], contexts[-1]
    out: dict[str, Any] = {"contexts": [lo, hi]}
    for mode, by_key in rows.items():
        ratios = {str(bs): by_key[(hi, bs)]["median_ms"] / by_key[(lo, bs)]["median_ms"]
                  for (ctx, bs) in sorted(by_key) if ctx == lo and (hi, bs) in by_key}
        if ratios:
            out[mode] = ratios
    return out if len(out) > 1 else {}


def _breakable(modes: Mapping[str, Any], decode_ratio: dict[str, float]) -> dict[str, Any]:
    broken, traced = modes.get("breakable", {}), modes.get("piecewise", {})
    if "startup_s" not in broken or "startup_s" not in traced:
        return {}
    return {"startup_s": {"breakable": broken["startup_s"], "traced": traced["startup_s"]},
            "capture_s": {"breakable": broken.get("capture_s"),
                          "traced": traced.get("capture_s")},
            "decode_breakable_over_traced": decode_ratio}


def _hf(modes: Mapping[str, Any]) -> dict[str, Any]:
    """ff.hf's tokens per second over the best HF mode's, per batch size; the prompt-lookup
    speed-ups."""
    out: dict[str, Any] = {}
    ours = modes.get("ff-hf", {}).get("generate", {})
    ratios = {}
    for bs, row in ours.items():
        peers = [modes.get(m, {}).get("generate", {}).get(bs, {}).get("tokens_per_s")
                 for m in ("hf-eager", "hf-compile")]
        found = [p for p in peers if p]
        if found:
            ratios[bs] = row["tokens_per_s"] / max(found)
    if ratios:
        out["ff_hf_over_best_hf_tokens_per_s"] = ratios
    lookup = modes.get("ff-hf-lookup", {})
    speedups = {name: lookup[name].get("speedup", lookup[name].get("unsupported"))
                for name in ("ff-hf", "hf-eager") if isinstance(lookup.get(name), dict)}
    if speedups:
        out["prompt_lookup_speedup"] = speedups
    return out
