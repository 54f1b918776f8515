"""bf16 attention forward throughput: epicute.attention vs cuDNN SDPA, flash SDPA and flash-attn-4 (cute), TFLOPS.

Usage: python bench/attention.py [--quick] [--out PATH]
Cases keep batch * heads = 64 (the flash-attn convention), causal and not; each figure
is the median of 5 rounds that interleave the contenders (20 timed calls each). FLOPs are
4 * b * h * sq * sk * d, halved for causal (as flash-attn reports). Writes
bench/results/attention.json (and $OUT/attention.json when OUT is set). Exits 1 when
epicute was wrong on any case, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from common import Row, print_table, time_interleaved, write_result

#: (head_dim, seqlen, batch, heads)
CASES = [
    (128, 8192, 4, 16), (128, 2048, 4, 16), (128, 16384, 4, 16),
    (64, 4096, 8, 8), (64, 8192, 4, 16),
    (256, 8192, 2, 32), (256, 2048, 2, 32),
]  # fmt: skip
QUICK = [(128, 8192, 4, 16), (64, 4096, 8, 8), (256, 8192, 2, 32)]
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "attention.json"
TOLERANCE = 1e-2

Attn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def contenders() -> dict[str, Attn]:
    """epicute first, then the peers in column order; q/k/v are (batch, seqlen, heads, dim)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import epicute

    def sdpa_with(backend):
        def run(q, k, v, causal):
            with sdpa_kernel(backend):
                # SDPA wants (batch, heads, seqlen, dim): transposed views, no copies.
                return sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)

        return run

    found: dict[str, Attn] = {
        "epicute": lambda q, k, v, causal: epicute.attention(q, k, v, causal=causal),
        "cudnn": sdpa_with(SDPBackend.CUDNN_ATTENTION),
        "sdpa_flash": sdpa_with(SDPBackend.FLASH_ATTENTION),
    }
    try:
        from flash_attn.cute import flash_attn_func

        def fa_cute(q, k, v, causal):
            out = flash_attn_func(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out

        found["fa_cute"] = fa_cute
    except Exception as exc:  # noqa: BLE001 - any import failure just drops the peer
        print(f"flash_attn.cute unavailable, not benchmarked: {type(exc).__name__}: {exc}")
    return found


def bench_case(d: int, s: int, b: int, h: int, causal: bool, fns: dict[str, Attn]) -> tuple[Row, bool]:
    """One row of TFLOPS, and whether epicute ran and agreed with the first peer."""
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * b * h * s * s * d // (2 if causal else 1)
    row: Row = {"case": f"d{d} b{b} h{h} s{s}" + (" causal" if causal else "")}
    outputs = {}
    for name, fn in fns.items():  # first calls (compiles, plans) are not timed
        try:
            outputs[name] = fn(q, k, v, causal)
        except Exception as exc:  # noqa: BLE001 - a failing contender leaves its cell empty
            print(f"{row['case']}: {name} failed: {type(exc).__name__}: {str(exc)[:300]}")
    timed = {name: (lambda fn=fns[name]: fn(q, k, v, causal)) for name in outputs}
    for name, ms in time_interleaved(timed, warmup=5, iters=20).items():
        row[name] = round(flops / ms / 1e9, 1)
    ours = outputs.pop("epicute", None)
    ok = ours is not None
    if ok and outputs:
        peer, theirs = next(iter(outputs.items()))
        # SDPA returns (batch, heads, seqlen, dim) views of (batch, seqlen, heads, dim) memory.
        theirs = theirs.transpose(1, 2) if theirs.shape != q.shape else theirs
        err = ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item()
        print(f"{row['case']}: epicute vs {peer} rel err {err:.2e}")
        ok = err <= TOLERANCE
    return row, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one case per head_dim")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    fns = contenders()
    results = [
        bench_case(d, s, b, h, causal, fns)
        for d, s, b, h in (QUICK if args.quick else CASES)
        for causal in (False, True)
    ]
    rows = [row for row, _ in results]
    print_table(rows, "TFLOPS")
    command = "python bench/attention.py" + (" " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "")
    write_result(args.out, "attention", command, "TFLOPS", True, rows)
    bad = [row["case"] for row, ok in results if not ok]
    if bad:
        print(f"epicute failed or was wrong on: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
