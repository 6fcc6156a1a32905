"""The serving benchmark's table: its rows, the ratios, and how a failed peer or a phase is
recorded."""

from __future__ import annotations

import re

from servebench.common import cpu_ticks, loadavg, progress


# -- the table --------------------------------------------------------------------------------

# (key, label, unit, better): better is "higher" or "lower"; a ratio is always caldrix / peer.
ROWS = [
    ("single_tok_s", "single stream tok/s (median run)", "tok/s", "higher"),
    ("single_best_tok_s", "single stream tok/s (best run)", "tok/s", "higher"),
    ("single_mb1_tok_s", "single stream tok/s (median), caldrix --max-batch 1", "tok/s", "higher"),
    ("single_spec_tok_s", "single stream tok/s (median), caldrix --max-batch 1 --speculate ngram", "tok/s", "higher"),
    ("single_ttft_ms", "single stream TTFT", "ms", "lower"),
    ("single_itl_p50_ms", "single stream ITL p50", "ms", "lower"),
    ("single_itl_p99_ms", "single stream ITL p99", "ms", "lower"),
    ("conc8_tok_s", "8 streams aggregate tok/s", "tok/s", "higher"),
    ("conc8_ttft_p50_ms", "8 streams TTFT p50", "ms", "lower"),
    ("conc8_ttft_p99_ms", "8 streams TTFT p99", "ms", "lower"),
    ("conc8_itl_p50_ms", "8 streams ITL p50", "ms", "lower"),
    ("conc8_itl_p99_ms", "8 streams ITL p99", "ms", "lower"),
    ("ttft512_ms", "512-token prompt TTFT", "ms", "lower"),
    ("mix_itl_p50_ms", "mixed: running streams ITL p50", "ms", "lower"),
    ("mix_itl_p99_ms", "mixed: running streams ITL p99", "ms", "lower"),
    ("mix_itl_ratio", "mixed: ITL p99/p50", "x", "lower"),
    ("mix_itl_max_ms", "mixed: ITL max", "ms", "lower"),
    ("mix_long_ttft_ms", "mixed: 512-token prompt TTFT", "ms", "lower"),
]
TRACE_ROWS = [("tok_s", "tok/s", "tok/s", "higher"), ("ttft_p50_ms", "TTFT p50", "ms", "lower"),
              ("ttft_p99_ms", "TTFT p99", "ms", "lower"), ("e2e_p50_ms", "e2e p50", "ms", "lower"),
              ("e2e_p99_ms", "e2e p99", "ms", "lower")]
PEAK_ROW = ("peak_rss_mb", "peak RSS (VmHWM)", "MiB", "lower")
PEERS = [("caldrix", "caldrix"), ("llama", "llama.cpp"), ("hf", "transformers")]


def all_rows(traces: list[Path]) -> list[tuple[str, str, str, str]]:
    rows = list(ROWS)
    for p in traces:
        rows += [(f"trace_{p.stem}_{k}", f"trace {p.stem}: {label}", unit, better) for k, label, unit, better in TRACE_ROWS]
    return rows + [PEAK_ROW]


def fmt(v, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "x":
        return f"{v:.2f}"
    if unit == "ms":
        return f"{v:.1f}" if v < 100 else f"{v:.0f}"
    return f"{v:.1f}"


def row_label(label: str, unit: str) -> str:
    return label if re.search(rf"(^|\s){re.escape(unit)}(\s|$)", label) else f"{label} ({unit})"


def table(results: dict, na: dict, traces: list[Path]) -> str:
    rows = all_rows(traces)
    w0 = max(len(row_label(label, unit)) for _, label, unit, _ in rows) + 2
    head = f"{'':{w0}}" + "".join(f"{name:>14}" for _, name in PEERS) + f"{'cx/llama':>10}{'cx/tf':>8}  better"
    lines = [head, "-" * len(head)]
    for key, label, unit, better in rows:
        vals = [results.get(p, {}).get(key) for p, _ in PEERS]
        cells = []
        for (p, _), v in zip(PEERS, vals):
            cells.append(f"{'n/a' if p in na else fmt(v, unit):>14}")
        c = vals[0]
        ratios = []
        for v in vals[1:]:
            ratios.append("-" if (c is None or v in (None, 0)) else f"{c / v:.2f}")
        if not any(v is not None for v in vals):
            continue
        lines.append(f"{row_label(label, unit):{w0}}" + "".join(cells) + f"{ratios[0]:>10}{ratios[1]:>8}  {better}")
    for p, name in PEERS:
        if p in na:
            lines.append(f"n/a {name}: {na[p]}")
    return "\n".join(lines)


def failed(peer: str, exc: BaseException, results: dict, na: dict, notes: list[str]) -> None:
    """A peer that fails is a column of n/a (or, after some workloads, a note), not a crash."""
    while getattr(exc, "exceptions", None):  # an exception group: trio wraps a nursery's errors
        exc = exc.exceptions[0]
    why = f"{type(exc).__name__}: {exc}"[:400]
    progress(f"{dict(PEERS)[peer]} failed: {why}")
    if results.get(peer, {}).get("single_tok_s") is None:
        na[peer] = why
    else:
        notes.append(f"{dict(PEERS)[peer]} stopped part-way, later rows missing: {why}")


def phase(meta: dict, name: str | None) -> None:
    """Close the phase running (its CPU steal %), open `name` (its load average at the start)."""
    prev, ticks = meta.pop("_phase", None), cpu_ticks()
    if prev and len(prev[1]) > 7 and len(ticks) > 7:
        total = sum(ticks[:8]) - sum(prev[1][:8])
        meta["steal_pct"][prev[0]] = round(100.0 * (ticks[7] - prev[1][7]) / total, 1) if total > 0 else None
    if name is not None:
        meta["loadavg"][name] = loadavg()
        meta["_phase"] = (name, ticks)


