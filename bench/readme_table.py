"""Render stored benchmark results (bench/results/*.json) as markdown tables.

Usage: python bench/readme_table.py [--results DIR] [--write docs/performance.md --write README.md]
Without --write the tables go to stdout. With it, each FILE's marked blocks are replaced: the full tables
between `<!-- bench:start -->` and `<!-- bench:end -->` (docs/performance.md), the headline table, one
row per comparison, between `<!-- bench-headline:start -->` and `<!-- bench-headline:end -->` (README.md).
A file with neither pair of markers is left untouched (exit status 1).
Only the benchmarks against peers are rendered (README_BENCHMARKS), each followed, for
the GEMM, by a text bar chart of epicute vs its peers across shapes (the repository
keeps no images); the planner's evidence (configs*.json) stays in its JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from common import best_ratio, geomean, peer_groups, peer_names, peers, ratio

START, END = "<!-- bench:start -->", "<!-- bench:end -->"
HEADLINE_START, HEADLINE_END = "<!-- bench-headline:start -->", "<!-- bench-headline:end -->"
DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"
README_BENCHMARKS = (
    "gemm", "gemm_m1000", "gemm_wide224", "gemm_vit", "gemm_mid_m", "epilogue", "epilogue_wide224", "attention",
    "attention_fp8", "attention_bwd", "attention_bwd_short", "fp8", "fp8_swiglu", "grouped", "grouped_wgrad_half",
    "decode", "decode_gqa", "decode_fp8", "quantize", "quantize_pairs", "training", "training_dense", "training_fp8",
    "training_moe_fp8", "models", "models_moe", "models_qwen3_moe", "models_fp8", "models_moe_fp8", "models_decode",
    "compile", "compile_max_autotune", "compile_max_autotune_llama", "compile_max_autotune_vit_prefill",
    "compile_time", "compile_host", "compile_llama_host", "compile_llama_prefill_host", "compile_mixtral_train_host",
    "compile_time_host", "compile_time_llama_host", "compile_time_llama_prefill_host",
    "compile_time_mixtral_train_host", "compile_vit_block_train_replay", "compile_gpt2_mlp_train_replay",
    "compile_llama_prefill_replay", "compile_llama_train_replay", "compile_time_vit_block_train_replay",
    "compile_time_gpt2_mlp_train_replay", "compile_time_llama_prefill_replay", "compile_time_llama_train_replay",
    "tp", "runtime",
)  # fmt: skip
CHART_WIDTH = 40


def _cell(value: object) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) else "–"


def render(result: dict[str, Any]) -> str:
    """One result file as a heading, a provenance line and a table per :func:`peer_groups` run, with
    an epicute/<first peer> column, and for higher-is-better results with several peers an
    epicute/best-peer column."""
    unit = result.get("unit", "")
    higher = result.get("higher_is_better", True)
    versions = ", ".join(f"{k} {v}" for k, v in result.get("versions", {}).items())
    head = [
        f"### {result.get('benchmark', '?')} ({unit}, {'higher' if higher else 'lower'} is better)",
        "",
        f"{result.get('device', '?')}, {result.get('date', '?')}: `{result.get('command', '?')}`"
        + (f" ({versions})" if versions else ""),
    ]
    tables = [_table(group, higher) for group in peer_groups(result.get("rows", []))]
    return "\n\n".join(["\n".join(head), *tables])


def _table(rows: list[dict[str, Any]], higher: bool) -> str:
    names = peers(rows)
    first = names[0] if names else None
    vs_best = higher and len(peer_names(names)) > 1
    columns = ([(f"epicute/{first}", lambda row: ratio(row, first))] if first else []) + (
        [("epicute/best", lambda row: best_ratio(row, names))] if vs_best else []
    )
    header = ["case", "epicute", *names] + [label for label, _ in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    kept: list[list[float]] = [[] for _ in columns]
    for row in rows:
        cells = [str(row.get("case", "")), _cell(row.get("epicute")), *(_cell(row.get(n)) for n in names)]
        for (_, of), values in zip(columns, kept):
            r = of(row)
            cells.append(f"{r:.2f}×" if r is not None else "–")
            if r is not None:
                values.append(r)
        lines.append("| " + " | ".join(cells) + " |")
    if columns:
        means = [geomean(values) for values in kept]
        cells = ["geomean", *[""] * (len(header) - 1 - len(columns)), *(f"{g:.2f}×" if g else "–" for g in means)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(result: dict[str, Any]) -> str:
    """Horizontal text bars, one per contender per case, scaled to the largest figure."""
    rows = result.get("rows", [])
    names = ["epicute", *peers(rows)]
    top = max((r[n] for r in rows for n in names if isinstance(r.get(n), (int, float))), default=0)
    if not top:
        return ""
    width = max(len(n) for n in names)
    lines = ["```"]
    for row in rows:
        lines.append(str(row.get("case", "")))
        for name in names:
            value = row.get(name)
            if isinstance(value, (int, float)):
                lines.append(f"  {name:<{width}} {'█' * round(CHART_WIDTH * value / top):<{CHART_WIDTH}} {value:.0f}")
    lines.append("```")
    return "\n".join(lines)


def load_results(results_dir: Path) -> list[dict[str, Any]]:
    """The stored results of README_BENCHMARKS, in that order (missing ones left out)."""
    return [json.loads((results_dir / f"{name}.json").read_text())
            for name in README_BENCHMARKS if (results_dir / f"{name}.json").exists()]  # fmt: skip


def _short_gpu(device: str) -> str:
    return device.removeprefix("NVIDIA ").split(" ")[0] if device else "?"


def headline(results: list[dict[str, Any]]) -> str:
    """One row per :func:`peer_groups` run that has a peer: epicute over its first peer (geomean and range over
    the run's cases) and, for higher-is-better runs with several peers, over the best peer per case."""
    lines = ["| benchmark | cases | vs | epicute/peer: geomean (range) | epicute/best peer | GPU |",
             "|---|---:|---|---:|---:|---|"]  # fmt: skip
    for result in results:
        higher = result.get("higher_is_better", True)
        for group in peer_groups(result.get("rows", [])):
            names = peers(group)
            baselines = peer_names(names)
            if not baselines:
                continue  # epicute against its own variants only (e.g. the cost of a fused quantization)
            first = baselines[0]
            ratios = [r for r in (ratio(row, first) for row in group) if r is not None]
            if not ratios:
                continue
            best = [r for r in (best_ratio(row, names) for row in group) if r is not None]
            vs_best = f"{geomean(best):.2f}×" if higher and len(baselines) > 1 and best else "–"
            cases = [str(row.get("case", "")).split(":")[0] for row in group if ratio(row, first) is not None]
            what = f"{len(cases)} cases" if len(cases) > 2 else ", ".join(cases)
            vs = first if higher else f"{first} (time: lower is better)"
            spread = f"{min(ratios):.2f}–{max(ratios):.2f}×" if len(ratios) > 1 else "one case"
            lines.append(f"| {result.get('benchmark', '?')} | {what} | {vs} | {geomean(ratios):.2f}× ({spread}) | "
                         f"{vs_best} | {_short_gpu(result.get('device', ''))} |")  # fmt: skip
    return "\n".join(lines)


def render_all(results_dir: Path) -> str:
    results = load_results(results_dir)
    if not results:
        return f"_No benchmark results in {results_dir.name}/ yet._"
    parts = []
    for result in results:
        parts.append(render(result))
        if result.get("benchmark") == "gemm":
            parts.append(chart(result))
    return "\n\n".join(parts)


def replace_block(path: Path, body: str, start_marker: str = START, end_marker: str = END) -> bool:
    """Put `body` between the markers in `path`; False (file untouched) when a marker is missing."""
    text = path.read_text()
    start, end = text.find(start_marker), text.find(end_marker)
    if start < 0 or end < start:
        return False
    path.write_text(text[: start + len(start_marker)] + "\n" + body + "\n" + text[end:])
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="directory of result JSON")
    parser.add_argument("--write", type=Path, metavar="FILE", action="append",
                        help="update the marked blocks in FILE (repeatable)")  # fmt: skip
    args = parser.parse_args()

    if not args.write:
        print(render_all(args.results))
        return 0
    blocks = ((START, END, render_all(args.results)),
              (HEADLINE_START, HEADLINE_END, headline(load_results(args.results))))  # fmt: skip
    status = 0
    for path in args.write:
        updated = [start for start, end, body in blocks if replace_block(path, body, start, end)]
        if updated:
            print(f"updated {path} ({', '.join(updated)})")
        else:
            print(f"{path}: neither {START} / {END} nor {HEADLINE_START} / {HEADLINE_END} found; file left unchanged",
                  file=sys.stderr)  # fmt: skip
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
