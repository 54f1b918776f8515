"""Decode-shaped GEMMs (serving: M = batch x new tokens): epicute.gemm vs cuBLAS (torch.matmul), in GB/s.

Usage: python bench/decode.py [--shapes 1x14336x4096,...] [--out PATH]
bf16 activations x (M, K) and a row-major (N, K) weight used as ``w.t()``, bf16 D, as
``../shared/bench/PEERS.md`` calls cuBLAS. GB/s counts the bytes a GEMM must move once: weight,
activations and output. Each contender's first call is checked against a float32 reference (D
NaN-poisoned where it takes ``out``) and not timed; then all are timed as ``triton.testing.do_bench``
times them (L2 flushed before each call, calls back to back; :func:`epicute.benchmark.time_flushed`),
medians of interleaved rounds. epicute plans these itself (``explain`` shows split-K where the
output tiles are too few for the SMs). Writes bench/results/decode.json (and $OUT/decode.json when
OUT is set).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from common import Row, check_contenders, finish_peer_run, time_interleaved
from gemm import parse_shapes

ALL_SHAPES = [(m, n, k) for n, k in ((14336, 4096), (4096, 14336), (8192, 8192)) for m in (1, 16, 64, 128)]
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "decode.json"
TOLERANCE = 1e-2


def run_case(shape) -> tuple[Row, bool]:
    import epicute  # imported late: it needs the CuTe DSL
    from epicute.benchmark import time_flushed

    m, n, k = shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ w.float().t()
    plan = epicute.explain(x, w.t(), file=None)
    row: Row = {"case": f"{m}x{n}x{k}"}
    print(row["case"], f"(split_k {plan.config.split_k}, tile 128x{plan.config.tile_n})")

    def poisoned():
        return epicute.gemm(x, w.t(), out=torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16))

    calls = {
        "epicute": (poisoned, lambda: epicute.gemm(x, w.t())),
        "cublas": (lambda: torch.matmul(x, w.t()), lambda: torch.matmul(x, w.t())),
    }
    timed, ok = check_contenders(calls, lambda d: ((d.float() - ref).norm() / ref.norm()).item(), TOLERANCE)
    moved = 2 * (m * k + n * k + m * n)
    for name, ms in time_interleaved(timed, timer=time_flushed).items():
        row[name] = round(moved / (ms * 1e-3) / 1e9, 1)
    return row, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, help="comma-separated MxNxK list (default: the issue's set)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result JSON path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    torch.manual_seed(0)
    rows, all_ok = [], True
    for shape in args.shapes or ALL_SHAPES:
        row, ok = run_case(shape)
        rows.append(row)
        all_ok = all_ok and ok
    return finish_peer_run(args.out, "decode", rows, all_ok, unit="GB/s")


if __name__ == "__main__":
    sys.exit(main())
