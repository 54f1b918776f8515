"""Fused epilogue throughput: D = gelu(alpha * (A @ B) + bias) + residual, bf16.

Contenders, same inputs, same run: epicute with the epilogue fused, torch eager
(cuBLAS matmul then elementwise kernels), epicute's own plain GEMM (the floor a
free epilogue would reach) and quack (its fused bias + residual; quack has no
gelu in `gemm_add`, so it does less work: noted in the output). Effective
TFLOPS = 2MNK / time. Writes bench/results/epilogue.json (and $OUT/epilogue.json).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from common import Row, print_table, time_cuda, write_result

SHAPES = [(8192, 8192, 8192), (4096, 14336, 4096)]
ALPHA = 0.5
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "epilogue.json"


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    import epicute

    @epicute.epilogue
    def ffn_out(acc, bias, residual, alpha):
        return {"D": epicute.ops.gelu(alpha * acc + bias) + residual}

    contenders = {
        "epicute": lambda a, b, bias, r: epicute.gemm(a, b, epilogue=ffn_out, bias=epicute.RowVector(bias), residual=r, alpha=ALPHA),
        "torch_eager": lambda a, b, bias, r: F.gelu(ALPHA * (a @ b) + bias) + r,
        "epicute_plain": lambda a, b, bias, r: epicute.gemm(a, b),
    }
    try:
        from quack.gemm_interface import gemm_add

        contenders["quack"] = lambda a, b, bias, r: gemm_add(a, b, r, bias=bias, alpha=ALPHA)
    except Exception as exc:  # noqa: BLE001 - a missing peer is reported, not fatal
        print(f"quack unavailable: {type(exc).__name__}: {exc}")

    rows: list[Row] = []
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k**0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        ref = F.gelu(ALPHA * (a.float() @ b.float()) + bias.float()) + r.float()
        row: Row = {"case": f"bf16 {m}x{n}x{k} gelu(alpha*acc+bias)+residual"}
        for name, fn in contenders.items():
            try:
                out = fn(a, b, bias, r)
                torch.cuda.synchronize()
                if name != "epicute_plain":
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    print(f"  {name:14s} rel err {err:.2e}" + (" (no gelu: does less work)" if name == "quack" else ""))
                ms = time_cuda(lambda fn=fn: fn(a, b, bias, r))
                row[name] = round(2 * m * n * k / ms / 1e9, 1)
            except Exception as exc:  # noqa: BLE001 - one failing peer must not stop the rest
                print(f"  {name:14s} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
                row[name] = None
        rows.append(row)
    print_table(rows, "TFLOPS")
    command = "python " + " ".join(["bench/epilogue.py", *sys.argv[1:]])
    write_result(DEFAULT_OUT, "epilogue", command, "TFLOPS", True, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
