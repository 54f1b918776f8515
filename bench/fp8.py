"""fp8 GEMM throughput: epicute.gemm with fp8 inputs vs cuBLAS (torch._scaled_mm), in TFLOPS.

Usage: python bench/fp8.py [--shapes 8192x8192x8192,...] [--out PATH]
Recipes (``case`` names them): tensorwise (fp32 scalar tensors on the GPU) and rowwise (A per row,
B per column), e4m3 inputs, bf16 output, A row-major (M, K) and B as ``w.t()`` of a row-major
(N, K) weight, as ``../shared/bench/PEERS.md`` calls ``torch._scaled_mm``. Each recipe's row holds
epicute and the cuBLAS call of that recipe, with its default (fp32 promotion of the fp8 partial
sums) and with ``use_fast_accum=True`` (no promotion, as epicute); blockwise rows hold cuBLAS alone (epicute applies
tensorwise and rowwise scales; blockwise is not built). Every contender's first call is checked
against a float32 reference of the dequantized math and not timed; then all are timed over
rotating input sets (cold L2) as medians of interleaved rounds. Writes bench/results/fp8.json
(and $OUT/fp8.json when OUT is set).
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

import torch
from common import Row, print_table, time_interleaved, write_result
from gemm import FALLBACK_L2_BYTES, parse_shapes, rotating

ALL_SHAPES = [
    (8192, 8192, 8192), (4096, 14336, 4096), (2048, 7168, 7168), (4096, 4096, 4096), (128, 7168, 2048),
    (1024, 4096, 14336), (16384, 4096, 4096),
]  # fmt: skip
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "fp8.json"
TOLERANCE = 2e-2
E4M3 = torch.float8_e4m3fn


def make_sets(m: int, n: int, k: int, recipe: str) -> list[tuple]:
    """(a, b, a_scale, b_scale, d) sets, enough that cycling through them touches over twice the L2."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2 = getattr(props, "L2_cache_size", 0) or FALLBACK_L2_BYTES
    count = max(2, math.ceil(2 * l2 / (m * k + k * n + 2 * m * n)))
    sets = []
    for _ in range(count):
        a = (torch.randn(m, k, device="cuda") * 0.5).to(E4M3)
        b = (torch.randn(n, k, device="cuda") * 0.5).to(E4M3).t()
        if recipe == "tensorwise":
            sa, sb = torch.rand((), device="cuda") + 0.5, torch.rand((), device="cuda") + 0.5
        elif recipe == "rowwise":
            sa, sb = torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
        else:  # blockwise, as torch._scaled_mm takes it (PEERS.md)
            sa = torch.rand(-(-k // 128), m, device="cuda").t()
            sb = torch.rand(-(-n // 128), -(-k // 128), device="cuda").t()
        sets.append((a, b, sa, sb, torch.empty(m, n, device="cuda", dtype=torch.bfloat16)))
    return sets


def contenders(recipe: str) -> dict:
    """epicute, then cuBLAS as PEERS.md calls it (``use_fast_accum=False``: its fp8 partial sums are
    promoted to fp32 along K) and with fast accumulation (``use_fast_accum=True``: the WGMMA's own
    accumulator throughout, as epicute's tensorwise and rowwise kernels do)."""
    import epicute  # imported late: it needs the CuTe DSL

    def cublas(fast: bool):
        def run(a, b, sa, sb, d):
            return d.copy_(torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                            use_fast_accum=fast))  # fmt: skip

        return run

    found = {f"cublas_{recipe}": cublas(False)}
    if recipe != "blockwise":
        found = {"epicute": lambda a, b, sa, sb, d: epicute.gemm(a, b, a_scale=sa, b_scale=sb, out=d), **found,
                 f"cublas_{recipe}_fast": cublas(True)}  # fmt: skip
    return found


def reference(a, b, sa, sb, recipe: str) -> torch.Tensor:
    if recipe == "blockwise":
        a_deq = a.float() * sa.repeat_interleave(128, dim=1)[:, : a.shape[1]]
        b_deq = b.float() * sb.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)[: b.shape[0], : b.shape[1]]
        return a_deq @ b_deq
    return (a.float() @ b.float()) * sa * sb


def run_case(shape, recipe: str) -> tuple[Row, bool]:
    m, n, k = shape
    sets = make_sets(m, n, k, recipe)
    a, b, sa, sb, _ = sets[0]
    ref = reference(a, b, sa, sb, recipe)
    row: Row = {"case": f"{recipe} e4m3 {m}x{n}x{k}"}
    ok, timed = True, {}
    print(f"{row['case']}: {len(sets)} rotating input sets")
    for name, fn in contenders(recipe).items():
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        try:
            fn(a, b, sa, sb, out)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a failing contender must not stop the others
            print(f"  {name:18s} FAILED, not recorded: {type(exc).__name__}: {exc}")
            ok = ok and name != "epicute"
            continue
        err = ((out.float() - ref).norm() / ref.norm()).item()
        flag = "" if err <= TOLERANCE else f"   <<<<<<<< WRONG: rel err > {TOLERANCE:g} >>>>>>>>"
        print(f"  {name:18s} rel err {err:.2e}{flag}")
        ok = ok and (name != "epicute" or err <= TOLERANCE)
        timed[name] = rotating(fn, sets)
    for name, ms in time_interleaved(timed).items():
        row[name] = round(2 * m * n * k / (ms * 1e-3) / 1e12, 1)
    return row, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, help="comma-separated MxNxK list (default: the issue's set)")
    parser.add_argument("--recipes", default="tensorwise,rowwise,blockwise")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result JSON path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    torch.manual_seed(0)
    rows, all_ok = [], True
    for recipe in args.recipes.split(","):
        for shape in args.shapes or ALL_SHAPES:
            row, ok = run_case(shape, recipe)
            rows.append(row)
            all_ok = all_ok and ok
            torch.cuda.empty_cache()
    command = shlex.join(["python", "bench/fp8.py", *sys.argv[1:]])
    print(f"wrote {write_result(args.out, 'fp8', command, 'TFLOPS', True, rows)}")
    print_table(rows, "TFLOPS")
    if not all_ok:
        print("epicute FAILED or was WRONG on at least one case (see above)")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
