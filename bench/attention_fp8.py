"""fp8 attention forward throughput: epicute's e4m3 kernel vs epicute's bf16 forward and cuDNN's fp8 SDPA, TFLOPS.

Usage: python bench/attention_fp8.py [--cases d128-s8192,...] [--out PATH]
Cases: head_dim 64/128/256 at seqlen 2k-16k (batch x seqlen = 32k tokens, heads x head_dim = 2048, FA3's
convention), causal and not, and GQA rows (32 query heads over 8 K/V heads). Columns:

- ``epicute``: ``epicute.attention`` on e4m3 q, k, v with per-tensor descales, bf16 O: the whole call, including
  the pass that lays V out keys-contiguous (:mod:`epicute.attention.fp8`);
- ``epicute_bf16``: ``epicute.attention`` on the bf16 tensors the fp8 ones were quantized from (the issue's
  baseline: the ratio column);
- ``epicute_v_slots``: the same fp8 kernel on V already in that layout (``v_layout="slots"``, as an fp8 KV cache
  holds it): the kernel alone;
- ``cudnn_fp8``: ``scaled_dot_product_attention`` on the fp8 tensors under the cuDNN backend, where the installed
  torch takes them (torch 2.11 on the H200 does not: "No available kernel", its checks want fp16/bf16).

Every contender is first checked against the bf16 forward on the dequantized inputs (relative error <= 0.1: P is
rounded to e4m3, ~4 % RMS; the GPU tests hold the kernel to twice what that rounding alone gives), then timed as
``triton.testing.do_bench`` times (L2 flushed before each call), medians of interleaved rounds. FLOPs are
4 * b * h * sq * sk * d, halved for causal. Writes bench/results/attention_fp8.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from common import Row, check_contenders, finish_peer_run, start_peer_run, time_interleaved

TOKENS, HIDDEN = 32768, 2048
#: (head_dim, seqlen, query heads per K/V head)
CASES = [(d, s, 1) for d in (64, 128, 256) for s in (2048, 4096, 8192, 16384)] + [(128, 8192, 4), (128, 16384, 4)]
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "attention_fp8.json"
TOLERANCE = 0.1
E4M3 = torch.float8_e4m3fn


def quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (x.abs().amax().float() / 448).reshape(1)
    return (x.float() / scale).to(E4M3), scale


def run_case(d: int, s: int, group: int, causal: bool) -> tuple[Row, bool]:
    import epicute
    from epicute.attention.fp8 import value_layout
    from epicute.benchmark import time_flushed

    batch, heads = TOKENS // s, HIDDEN // d
    heads_kv = heads // group
    q16 = torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16)
    k16, v16 = (torch.randn(batch, s, heads_kv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    (q, qs), (k, ks), (v, vs) = (quantized(t) for t in (q16, k16, v16))
    scales = {"q_descale": qs, "k_descale": ks, "v_descale": vs}
    v_slots = value_layout(v)
    row: Row = {"case": f"d{d} b{batch} h{heads}" + (f"/{heads_kv}" if group > 1 else "") + f" s{s}"
                + (" causal" if causal else "")}  # fmt: skip
    print(row["case"])
    dequantized = [(t.float() * sc).to(torch.bfloat16) for t, sc in ((q, qs), (k, ks), (v, vs))]
    ref = epicute.attention(*dequantized, causal=causal).float()

    def error(o) -> float:
        o = o.transpose(1, 2) if o.shape != ref.shape else o
        return ((o.float() - ref).norm() / ref.norm()).item()

    def ours():
        return epicute.attention(q, k, v, causal=causal, **scales)

    def slots():
        return epicute.attention(q, k, v_slots, causal=causal, v_layout="slots", **scales)

    def bf16():
        return epicute.attention(q16, k16, v16, causal=causal)

    calls = {"epicute": (ours, ours), "epicute_bf16": (bf16, bf16), "epicute_v_slots": (slots, slots)}
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                            enable_gqa=group > 1)  # fmt: skip

        calls["cudnn_fp8"] = (cudnn, cudnn)
    except ImportError as exc:
        print(f"  cudnn_fp8        unavailable ({exc})")
    timed, ok = check_contenders(calls, error, TOLERANCE)
    flops = 4 * batch * heads * s * s * d // (2 if causal else 1)
    for name, ms in time_interleaved(timed, timer=time_flushed).items():
        row[name] = round(flops / (ms * 1e-3) / 1e12, 1)
    return row, ok


def parse_cases(text: str) -> list[tuple[int, int, int]]:
    """``dD-sS[-gG]`` items, comma-separated (e.g. ``d128-s8192,d128-s8192-g4``)."""
    cases = []
    for item in text.split(","):
        fields = dict((f[0], int(f[1:])) for f in item.split("-"))
        cases.append((fields["d"], fields["s"], fields.get("g", 1)))
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=parse_cases, help="comma-separated dD-sS[-gG] list (default: all)")
    args = start_peer_run(parser, DEFAULT_OUT)
    if args is None:
        return 2
    rows, all_ok = [], True
    for d, s, group in args.cases or CASES:
        for causal in (False, True):
            row, ok = run_case(d, s, group, causal)
            rows.append(row)
            all_ok = all_ok and ok
    return finish_peer_run(args.out, "attention_fp8", rows, all_ok)


if __name__ == "__main__":
    sys.exit(main())
