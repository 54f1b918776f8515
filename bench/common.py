"""Shared benchmark utilities: CUDA-event timing, version capture, result JSON and tables.

torch is imported inside the functions that need it, so `readme_table.py` (which only
formats stored results) runs on machines without torch or a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def time_cuda(fn: Callable[[], object], *, warmup: int = 10, iters: int = 50) -> float:
    """Median CUDA-event milliseconds of ``fn()``: :func:`epicute.benchmark.time_cuda`, imported
    here on first use so that formatting stored results needs no torch."""
    from epicute.benchmark import time_cuda as timed

    return timed(fn, warmup=warmup, iters=iters)


def time_interleaved(fns: dict[str, Callable[[], object]], **timing) -> dict[str, float]:
    """Median CUDA-event milliseconds per contender over interleaved rounds:
    :func:`epicute.benchmark.time_interleaved`, imported on first use like :func:`time_cuda`."""
    from epicute.benchmark import time_interleaved as timed

    return timed(fns, **timing)


# Distribution names whose versions are recorded when installed; epicute and the DSL always appear.
_OPTIONAL_DISTS = ("quack-kernels", "flash-attn-4", "liger-kernel", "torchao")


def host_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median host milliseconds of ``fn()`` (what it costs to queue its work), the GPU idle before each call."""
    import statistics
    import time

    import torch

    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def check_contenders(
    runs: dict[str, tuple[Callable[[], object], Callable[[], object]]],
    error: Callable[[object], float],
    tolerance: float,
) -> tuple[dict[str, Callable[[], object]], bool]:
    """Check each contender once before timing it: ``runs`` maps a name to (its checked call, its timed call).
    The checked call runs (untimed) and ``error(result)`` is printed; a contender that fails is left out (a
    failing peer must not stop the others). Returns the timed calls of those that ran, and whether epicute
    ran within ``tolerance``."""
    import torch

    ok, timed = True, {}
    for name, (checked, timed_call) in runs.items():
        try:
            result = checked()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported, and the run goes on
            print(f"  {name:16s} FAILED, not recorded: {type(exc).__name__}: {exc}")
            ok = ok and name != "epicute"
            continue
        err = error(result)
        flag = "" if err <= tolerance else f"   <<<<<<<< WRONG: rel err > {tolerance:g} >>>>>>>>"
        print(f"  {name:16s} rel err {err:.2e}{flag}")
        ok = ok and (name != "epicute" or err <= tolerance)
        timed[name] = timed_call
    return timed, ok


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str]:
    """Versions of epicute, the CuTe DSL, torch and whichever benchmark peers are installed."""
    import torch

    try:
        import epicute

        epicute_version = str(getattr(epicute, "__version__", "unknown"))
    except ImportError:
        epicute_version = "unknown"
    found = {
        "epicute": epicute_version,
        "nvidia-cutlass-dsl": _dist_version("nvidia-cutlass-dsl") or "unknown",
        "torch": torch.__version__,
    }
    for name in _OPTIONAL_DISTS:
        version = _dist_version(name)
        if version is not None:
            found[name] = version
    return found


def announced(label: str, fn: Callable[[], object], then: Callable[[], object] | None = None) -> Callable[[], object]:
    """``fn`` printing how long it took (a compiling first call, untimed), then calling ``then`` (more to print)."""
    import time

    import torch

    def run():
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        print(f"  {label:16s} first call (compiles, untimed): {time.perf_counter() - start:.1f} s")
        if then is not None:
            then()
        return result

    return run


def measure_rates(row: Row, runs: dict, error: Callable[[object], float], tolerance: float, per_step: int, *,
                  rounds: int = 3, digits: int = 1) -> bool:  # fmt: skip
    """Check each contender (:func:`check_contenders`), time those that ran in ``rounds`` interleaved rounds with L2
    flushed (``time_flushed``, medians), and put each one's rate, ``per_step`` items per step in thousands a second,
    into ``row``; prints the milliseconds per step. Returns whether epicute ran within ``tolerance``."""
    from epicute.benchmark import time_flushed

    timed, ok = check_contenders(runs, error, tolerance)
    times = time_interleaved(timed, timer=time_flushed, rounds=rounds)
    for label, ms in times.items():
        row[label] = round(per_step / (ms * 1e-3) / 1e3, digits)
    print("  ms per step: " + ", ".join(f"{label} {ms:.3f}" for label, ms in times.items()))
    return ok


def peers(rows: Sequence[Row]) -> list[str]:
    """Peer keys (every key but `case` and `epicute`) in order of first appearance."""
    names: list[str] = []
    for row in rows:
        for key in row:
            if key not in ("case", "epicute") and key not in names:
                names.append(key)
    return names


def peer_groups(rows: Sequence[Row]) -> list[list[Row]]:
    """``rows`` cut into runs that share a baseline (their first peer), one table each: an fp8 run's
    tensorwise, rowwise and blockwise rows are compared with the cuBLAS call of their own recipe.
    A row without peers stays in the run it is in."""
    groups: list[list[Row]] = []
    baseline: str | None = None
    for row in rows:
        first = next(iter(peers([row])), None)
        if not groups or (first is not None and baseline is not None and first != baseline):
            groups.append([])
            baseline = None
        groups[-1].append(row)
        baseline = baseline or first
    return groups


def ratio(row: Row, peer: str) -> float | None:
    """epicute / peer for one row, or None when either figure is missing."""
    ours, theirs = row.get("epicute"), row.get(peer)
    if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)) and theirs > 0:
        return ours / theirs
    return None


def peer_names(names: Sequence[str]) -> list[str]:
    """The contenders among ``names`` that are peers: epicute's own reference figures (``epicute_*``) are not."""
    return [n for n in names if not n.startswith("epicute")]


def best_ratio(row: Row, names: Sequence[str]) -> float | None:
    """epicute / the fastest peer among ``names`` for one (higher-is-better) row, or None when a figure
    is missing; epicute's own reference figures (``epicute_*``, e.g. the plain GEMM) are not peers."""
    figures = [row.get(n) for n in peer_names(names)]
    figures = [f for f in figures if isinstance(f, (int, float)) and f > 0]
    ours = row.get("epicute")
    if not figures or not isinstance(ours, (int, float)):
        return None
    return ours / max(figures)


def geomean(values: Sequence[float]) -> float | None:
    """Geometric mean of positive values, or None when there are none."""
    positive = [v for v in values if v > 0]
    if not positive:
        return None
    return math.exp(sum(math.log(v) for v in positive) / len(positive))


def write_result(
    path: str | Path,
    benchmark: str,
    command: str,
    unit: str,
    higher_is_better: bool,
    rows: Sequence[Row],
) -> Path:
    """Write one benchmark run as JSON (schema shared by every bench script) and return its path.

    On the device, a copy also goes to ``$OUT`` (the folder whose files come back)."""
    import torch

    result = {
        "benchmark": benchmark,
        "device": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "versions": versions(),
        "command": command,
        "unit": unit,
        "higher_is_better": higher_is_better,
        "rows": list(rows),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    if os.environ.get("OUT"):
        copy = Path(os.environ["OUT"]) / path.name
        if copy.resolve() != path.resolve():
            shutil.copy(path, copy)
    return path


def _fmt(value: object) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) else "-"


def print_table(rows: Sequence[Row], unit: str) -> None:
    """Print rows as fixed-width tables (one per :func:`peer_groups` run) with an epicute/<first peer>
    ratio column, with several peers an epicute/best-peer column too, and their geomeans."""
    for group in peer_groups(rows):
        _print_group(group, unit)


def _print_group(rows: Sequence[Row], unit: str) -> None:
    names = peers(rows)
    first = names[0] if names else None
    vs_best = len(peer_names(names)) > 1
    header = ["case", f"epicute ({unit})", *names]
    if first is not None:
        header.append(f"epicute/{first}")
    if vs_best:
        header.append("epicute/best")
    table = []
    ratios: list[float] = []
    best_ratios: list[float] = []
    for row in rows:
        line = [str(row.get("case", "")), _fmt(row.get("epicute")), *(_fmt(row.get(n)) for n in names)]
        for wanted, r, kept in (
            (first is not None, ratio(row, first), ratios),
            (vs_best, best_ratio(row, names), best_ratios),
        ):
            if wanted:
                line.append(f"{r:.3f}" if r is not None else "-")
                if r is not None:
                    kept.append(r)
        table.append(line)
    widths = [max(len(cells[i]) for cells in [header, *table]) for i in range(len(header))]
    for cells in [header, *table]:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))))
    for wanted, label, kept in ((first is not None, first, ratios), (vs_best, "best", best_ratios)):
        if wanted:
            g = geomean(kept)
            print(f"geomean epicute/{label}: {g:.3f}" if g is not None else f"geomean epicute/{label}: -")


def start_peer_run(parser: argparse.ArgumentParser, default_out: Path) -> argparse.Namespace | None:
    """The start of a run against peers: ``--out`` added to ``parser``, the arguments parsed and torch's
    generator seeded; None (after saying why) without a CUDA device, where ``main`` returns 2."""
    import torch

    parser.add_argument("--out", type=Path, default=default_out, help="result JSON path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return None
    torch.manual_seed(0)
    return args


def finish_peer_run(out: str | Path, benchmark: str, rows: Sequence[Row], all_ok: bool, unit: str = "TFLOPS") -> int:
    """The end of a run against peers (higher is better, in ``unit``): write the result (its command is this
    process's argv), print the table, and the exit status (1 when epicute failed or was wrong anywhere)."""
    command = shlex.join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    print(f"wrote {write_result(out, benchmark, command, unit, True, rows)}")
    print_table(rows, unit)
    if not all_ok:
        print("epicute FAILED or was WRONG on at least one case (see above)")
    return 0 if all_ok else 1
