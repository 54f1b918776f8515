"""Fused epilogue throughput: the two epilogues of the speed-of-light targets, bf16 inputs.

- ``ffn``: D = gelu(alpha * (A @ B) + bias) + residual, bf16 out;
- ``rowcol_fp8``: D = fp8e4m3(acc * scale_m[m] * scale_n[n]) (``epicute.epilogues.row_col_quant``).

Contenders, same inputs, same run: epicute with the epilogue fused, torch eager
(cuBLAS matmul then elementwise kernels), epicute's own plain GEMM (the floor a
free epilogue would reach; the target is fused time <= 1.03x of it at the large
shapes, <= 1.10x at M <= 1024) and, for ``ffn``, quack's fused bias + residual
(quack has no gelu in ``gemm_add``, so it does less work; its default
config, ``tuned=False``, as in bench/gemm.py). Effective
TFLOPS = 2MNK / time, timed over rotating input sets (cold L2) like bench/gemm.py,
as the median of five rounds that interleave the contenders.
Writes bench/results/epilogue.json (and $OUT/epilogue.json).

Usage: python bench/epilogue.py [--shapes MxNxK,...] [--epilogues ffn,rowcol_fp8]
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from common import Row, print_table, time_interleaved, write_result
from gemm import make_sets, parse_shapes, rotating

SHAPES = [(8192, 8192, 8192), (4096, 14336, 4096), (1024, 14336, 4096), (512, 4096, 4096)]
ALPHA = 0.5
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "epilogue.json"
TOLERANCE = 1e-2


def ffn_case(epicute, m: int, n: int):
    """(operands, reference(acc32, ops), contenders(a, b, d, ops)) of gelu(alpha*acc + bias) + residual."""

    @epicute.epilogue
    def ffn_out(acc, bias, residual, alpha):
        return epicute.ops.gelu(alpha * acc + bias) + residual

    ops = {"bias": torch.randn(n, device="cuda", dtype=torch.bfloat16),
           "residual": torch.randn(m, n, device="cuda", dtype=torch.bfloat16)}  # fmt: skip

    def reference(acc, ops):
        return F.gelu(ALPHA * acc + ops["bias"].float()) + ops["residual"].float()

    fns = {
        "epicute": lambda a, b, d, ops: epicute.gemm(a, b, epilogue=ffn_out, out=d, bias=epicute.RowVector(ops["bias"]),
                                                     residual=ops["residual"], alpha=ALPHA),
        "torch_eager": lambda a, b, d, ops: torch.add(F.gelu(ALPHA * (a @ b) + ops["bias"]), ops["residual"], out=d),
    }  # fmt: skip
    try:
        from quack.gemm_interface import gemm_add

        fns["quack"] = lambda a, b, d, ops: gemm_add(
            a, b, ops["residual"], out=d, bias=ops["bias"], alpha=ALPHA, tuned=False
        )
    except Exception as exc:  # noqa: BLE001 - a missing peer is reported, not fatal
        print(f"quack unavailable: {type(exc).__name__}: {exc}")
    return ops, reference, fns, torch.bfloat16


def rowcol_fp8_case(epicute, m: int, n: int):
    """The same triple for fp8(acc * scale_m * scale_n), saturating at ±448."""
    ops = {"scale_m": torch.rand(m, device="cuda") * 20 + 1.0, "scale_n": torch.rand(n, device="cuda") + 0.5}

    def reference(acc, ops):
        return (acc * ops["scale_m"][:, None] * ops["scale_n"][None, :]).clamp(-FP8_MAX, FP8_MAX)

    def eager(a, b, d, ops):
        scaled = (a @ b).float() * ops["scale_m"][:, None] * ops["scale_n"][None, :]
        return d.copy_(scaled.clamp_(-FP8_MAX, FP8_MAX))

    fns = {
        "epicute": lambda a, b, d, ops: epicute.gemm(a, b, epilogue=epicute.epilogues.row_col_quant, out=d, **ops),
        "torch_eager": eager,
    }
    return ops, reference, fns, FP8


CASES = {"ffn": ffn_case, "rowcol_fp8": rowcol_fp8_case}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES)
    parser.add_argument("--epilogues", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    import epicute

    rows: list[Row] = []
    all_ok = True
    for m, n, k in args.shapes:
        sets = make_sets(m, n, k)
        plain = rotating(lambda a, b, d: epicute.gemm(a, b, out=d), sets)
        plain()  # compiles outside any timing
        for case in args.epilogues.split(","):
            ops, reference, fns, d_dtype = CASES[case](epicute, m, n)
            outs = [torch.empty(m, n, device="cuda", dtype=d_dtype) for _ in sets]
            pairs = [(a, b, d) for (a, b, _), d in zip(sets, outs)]
            a0, b0, _ = sets[0]
            # The same math in fp32, rounded once to D's dtype as the kernel rounds.
            ref = reference(a0.float() @ b0.float(), ops).to(d_dtype).float()
            row: Row = {"case": f"{case} {m}x{n}x{k}"}
            timed = {}
            for name, fn in fns.items():  # untimed first calls (compiles), checked against the reference
                try:
                    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float32).to(d_dtype)
                    fn(a0, b0, out, ops)
                    torch.cuda.synchronize()
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    note = " (no gelu: does less work)" if name == "quack" else ""
                    print(f"  {row['case']} {name:12s} rel err {err:.2e}{note}")
                    if name == "epicute" and not err <= TOLERANCE:
                        all_ok = False
                        raise AssertionError(f"rel err {err:.2e} > {TOLERANCE}")
                    timed[name] = rotating(lambda a, b, d, fn=fn, ops=ops: fn(a, b, d, ops), pairs)
                except Exception as exc:  # noqa: BLE001 - one failing contender must not stop the rest
                    print(f"  {row['case']} {name:12s} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
                    row[name] = None
            # The plain GEMM in the same rounds, so the fused/plain ratio compares like with like.
            timed["epicute_plain"] = plain
            for name, ms in time_interleaved(timed).items():
                row[name] = round(2 * m * n * k / ms / 1e9, 1)
            if row.get("epicute"):
                print(f"  {row['case']}: fused time {row['epicute_plain'] / row['epicute']:.3f}x of the plain GEMM")
            rows.append(row)
        torch.cuda.empty_cache()
    print_table(rows, "TFLOPS")
    command = shlex.join(["python", "bench/epilogue.py", *sys.argv[1:]])
    write_result(args.out, "epilogue", command, "TFLOPS", True, rows)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
