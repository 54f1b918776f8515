"""bf16 GEMM throughput: epicute.gemm vs cuBLAS (torch.matmul) and quack, in TFLOPS.

Usage: python bench/gemm.py [--all | --shapes 4096x4096x4096,...] [--out PATH] [--quack-tuned]
Each shape: every contender's first call is checked against fp32 torch and not timed, then all
are timed over rotating input sets (cold L2) as the median of five interleaved rounds.
Writes bench/results/gemm.json (and $OUT/gemm.json when OUT is set). Exits 1 when epicute
failed or was wrong on any case, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from common import Row, finish_peer_run, start_peer_run, time_interleaved

Shape = tuple[int, int, int]
Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]  # (a, b, out): writes out

ALL_SHAPES: list[Shape] = [
    (8192, 8192, 8192),
    (4096, 4096, 4096),
    (16384, 4096, 4096),
    (4096, 14336, 4096),
    (8192, 4096, 14336),
    (2048, 8192, 8192),
    (1000, 14336, 4096),  # a ragged M at Llama-3-8B's up projection (issue 60)
] + [  # small M (decode-like batches) over the (N, K) of common layers
    (m, n, k) for m in (256, 512, 1024) for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192))
]
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gemm.json"
TOLERANCE = 1e-2
FALLBACK_L2_BYTES = 50 * 2**20  # H100 SXM


def parse_shapes(text: str) -> list[Shape]:
    shapes = []
    for item in text.split(","):
        m, n, k = (int(x) for x in item.strip().lower().split("x"))
        shapes.append((m, n, k))
    return shapes


def contenders(quack_tuned: bool) -> dict[str, Gemm]:
    """epicute first, then the peers in the order their columns appear."""
    import epicute  # imported late: it needs the CuTe DSL, which CPU-only machines may lack

    found: dict[str, Gemm] = {
        "epicute": lambda a, b, d: epicute.gemm(a, b, out=d),
        "cublas": lambda a, b, d: torch.matmul(a, b, out=d),
    }
    try:
        # quack takes A (M, K) and B (K, N) as given (row-major B is fine) and writes `out`.
        # tuned=False uses its SM90 default config; tuned=True autotunes ~44 configs per shape.
        from quack.gemm_interface import gemm as quack_gemm

        found["quack"] = lambda a, b, d: quack_gemm(a, b, out=d, tuned=quack_tuned)
    except Exception as exc:  # noqa: BLE001 - any import failure just drops the peer
        print(f"quack unavailable, not benchmarked: {type(exc).__name__}: {exc}")
    return found


def make_sets(m: int, n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Enough (a, b, d) sets that cycling through them touches over twice the L2 per round."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2 = getattr(props, "L2_cache_size", 0) or FALLBACK_L2_BYTES
    per_set = 2 * (m * k + k * n + m * n)
    count = max(2, math.ceil(2 * l2 / per_set))
    return [
        (
            torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
            torch.randn(k, n, device="cuda", dtype=torch.bfloat16),
            torch.empty(m, n, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(count)
    ]


def rotating(fn: Gemm, sets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Callable[[], object]:
    """`fn` over the input sets in turn, so successive timed calls start with cold L2."""
    cycle = itertools.cycle(sets)
    return lambda: fn(*next(cycle))


def rel_error(fn: Gemm, a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖, with out poisoned by NaN so unwritten elements count as wrong."""
    out = torch.full(ref.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    fn(a, b, out)
    torch.cuda.synchronize()
    return ((out.float() - ref).norm() / ref.norm()).item()


def run_case(shape: Shape, fns: dict[str, Gemm], seen_errors: set[str]) -> tuple[Row, bool]:
    """Check then time every contender on one shape; returns the row and whether epicute was OK."""
    m, n, k = shape
    sets = make_sets(m, n, k)
    a0, b0, _ = sets[0]
    ref = a0.float() @ b0.float()
    row: Row = {"case": f"bf16 {m}x{n}x{k}"}
    epicute_ok = True
    print(f"{row['case']}: {len(sets)} rotating input sets")
    checked = {}
    for name, fn in fns.items():  # untimed first calls (compiles), checked against the reference
        try:
            err = rel_error(fn, a0, b0, ref)
        except Exception as exc:  # noqa: BLE001 - a failing contender must not stop the others
            message = f"{name}: {type(exc).__name__}: {exc}"
            if message not in seen_errors:
                seen_errors.add(message)
                print(f"  {name:8s} FAILED, not recorded: {message}")
            else:
                print(f"  {name:8s} FAILED, not recorded (same error as above)")
            if name == "epicute":
                row["epicute"] = None
                epicute_ok = False
            continue
        flag = "" if err <= TOLERANCE else f"   <<<<<<<< WRONG: rel err > {TOLERANCE:g} >>>>>>>>"
        print(f"  {name:8s} rel err {err:.2e}{flag}")
        if name == "epicute" and not err <= TOLERANCE:  # `not <=` also catches NaN
            epicute_ok = False
        checked[name] = rotating(fn, sets)
    for name, ms in time_interleaved(checked).items():
        row[name] = round(2 * m * n * k / (ms * 1e-3) / 1e12, 1)
    return row, epicute_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--all", action="store_true", help="the standard shape set (default)")
    group.add_argument("--shapes", type=parse_shapes, help="comma-separated MxNxK list")
    parser.add_argument("--quack-tuned", action="store_true", help="let quack autotune (slow)")
    args = start_peer_run(parser, DEFAULT_OUT)
    if args is None:
        return 2
    fns = contenders(args.quack_tuned)
    rows: list[Row] = []
    all_ok = True
    seen_errors: set[str] = set()
    for shape in args.shapes or ALL_SHAPES:
        row, ok = run_case(shape, fns, seen_errors)
        rows.append(row)
        torch.cuda.empty_cache()  # the next shape's input sets may need the memory back
        all_ok = all_ok and ok

    return finish_peer_run(args.out, "gemm", rows, all_ok)


if __name__ == "__main__":
    sys.exit(main())
