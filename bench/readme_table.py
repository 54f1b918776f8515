"""Render stored benchmark results (bench/results/*.json) as markdown tables.

Usage: python bench/readme_table.py [--results DIR] [--write README.md]
Without --write the tables go to stdout; with it they replace the text between
`<!-- bench:start -->` and `<!-- bench:end -->` in that file (left untouched if a marker is missing).
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
DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"
README_BENCHMARKS = (
    "gemm", "epilogue", "attention", "attention_bwd", "fp8", "fp8_swiglu", "grouped", "decode", "decode_gqa",
    "training", "runtime",
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


def render_all(results_dir: Path) -> str:
    results = [json.loads((results_dir / f"{name}.json").read_text())
               for name in README_BENCHMARKS if (results_dir / f"{name}.json").exists()]  # fmt: skip
    if not results:
        return f"_No benchmark results in {results_dir.name}/ yet._"
    parts = []
    for result in results:
        parts.append(render(result))
        if result.get("benchmark") == "gemm":
            parts.append(chart(result))
    return "\n\n".join(parts)


def replace_block(path: Path, body: str) -> bool:
    """Put `body` between the markers in `path`; False (file untouched) when a marker is missing."""
    text = path.read_text()
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        return False
    path.write_text(text[: start + len(START)] + "\n" + body + "\n" + text[end:])
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="directory of result JSON")
    parser.add_argument("--write", type=Path, metavar="FILE", help="update the marked block in FILE")
    args = parser.parse_args()

    body = render_all(args.results)
    if args.write is None:
        print(body)
        return 0
    if not replace_block(args.write, body):
        print(f"{args.write}: markers {START} / {END} not found; file left unchanged", file=sys.stderr)
        return 1
    print(f"updated {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
