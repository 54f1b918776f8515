"""Decode-shaped GEMMs and decode attention (serving): epicute vs cuBLAS and flash-attn-4, in GB/s.

Usage: python bench/decode.py [--shapes 1x14336x4096,...] [--attention 64x8192,...] [--out PATH]
bf16 activations x (M, K) and a row-major (N, K) weight used as ``w.t()``, bf16 D, as
``../shared/bench/PEERS.md`` calls cuBLAS. GB/s counts the bytes a GEMM must move once: weight,
activations and output. Each contender's first call is checked against a float32 reference (D
NaN-poisoned where it takes ``out``) and not timed; then all are timed as ``triton.testing.do_bench``
times them (L2 flushed before each call, calls back to back; :func:`epicute.benchmark.time_flushed`),
medians of interleaved rounds. epicute plans these itself (``explain`` shows split-K where the
output tiles are too few for the SMs).

Decode attention rows (``attn_b{batch}_k{keys}``): one query per sequence, GQA 32 query heads over 8
K/V heads (``attn_b{batch}_k{keys}_gqa{g}``: 8 g query heads, the ratios 3, 5 and 7 of Llama-3.2-3B and
Qwen2.5 whose groups do not divide a 64-row tile, beside their ratio-4 rows), head_dim 128, causal,
over a paged bf16 cache of 128-key pages in random order with
``seqused_k`` (flash-attn-4's ``flash_attn_varlen_func`` on the same tensors, as PEERS.md calls it);
GB/s counts the K and V bytes read. The first call of each is checked against the float32 reference
of two of the sequences. Writes bench/results/decode.json (and $OUT/decode.json when OUT is set).

fp8 KV cache rows (``attn_fp8_b{batch}_k{keys}``, GQA 4, head_dim 128, 128-key pages): ``epicute`` is
``attention_with_kvcache`` over an ``epicute.nn.PagedKVCache`` of e4m3 keys and values (per-head scales; q
quantized per call, the fp8 kernel), ``epicute_bf16`` the same call over a bf16 cache of the same values. Both
columns count the bf16 cache's K and V bytes, so their ratio is the tokens/s ratio (the fp8 column is an
effective rate: the fp8 cache reads half those bytes). ``epicute_graph`` and ``epicute_bf16_graph``: the same steps
replayed from CUDA graphs, as a serving loop runs them: the GPU's time alone (an eager step whose host path is longer
than the L2 flush plus its kernels is timed with the GPU waiting on the host, which at batch 1 depends on the host
machine's speed). Checked against the float32 reference of the dequantized cache within 8e-2 (q and P rounded to
e4m3).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from common import Row, check_contenders, finish_peer_run, start_peer_run, time_interleaved
from gemm import parse_shapes

ALL_SHAPES = [(m, n, k) for n, k in ((14336, 4096), (4096, 14336), (8192, 8192)) for m in (1, 16, 64, 128)]
#: (batch, keys per sequence[, query heads per K/V head]) of the decode attention rows: the serving
#: shapes at ratio 4, then ratios 3, 5 and 7 beside ratio 4 at batch 1 and 32, short and long contexts.
ATTENTION_CASES = [(64, 8192), (8, 32768), (1, 131072)] + [
    (batch, keys, group) for batch, keys in ((1, 4096), (1, 131072), (32, 2048), (32, 32768)) for group in (4, 3, 5, 7)
]
HEADS_KV, HEAD_DIM, PAGE = 8, 128, 128
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "decode.json"
TOLERANCE = 1e-2
#: (batch, keys per sequence) of the fp8 KV cache rows: the issue's serving shapes.
FP8_CACHE_CASES = [(1, 131072), (32, 16384)]
FP8_TOLERANCE = 8e-2


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


def run_attention_case(batch: int, keys: int, group: int | None = None) -> tuple[Row, bool]:
    import epicute
    from epicute.attention.api import reference_attention
    from epicute.attention.validate import check_attention_args
    from epicute.benchmark import time_flushed

    pages = keys // PAGE
    shape = (batch * pages, PAGE, HEADS_KV, HEAD_DIM)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(batch * pages, device="cuda").view(batch, pages).to(torch.int32)
    used = torch.full((batch,), keys, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, 1, HEADS_KV * (group or 4), HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    row: Row = {"case": f"attn_b{batch}_k{keys}" + (f"_gqa{group}" if group else "")}
    plan = epicute.explain_attention(q, k, v, causal=True, page_table=table, seqused_k=used, file=None)
    print(row["case"], f"(pack_gqa {plan.config.pack_gqa}, num_splits {plan.config.num_splits})")
    picks = sorted({0, batch - 1})  # checked sequences: the float32 reference of all would not fit
    sub = check_attention_args(q[picks], k, v, causal=True, softmax_scale=None, page_table=table[picks],
                               seqused_k=used[picks])  # fmt: skip
    ref = reference_attention(sub, out_dtype=torch.float32, device="cuda")[0]["D"]

    def error(o) -> float:
        o = (o[0] if isinstance(o, tuple) else o)[picks].float()
        return ((o - ref).norm() / ref.norm()).item()

    def ours():
        return epicute.attention(q, k, v, causal=True, page_table=table, seqused_k=used)

    calls = {"epicute": (ours, ours)}
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func

        def fa():
            return flash_attn_varlen_func(q, k, v, seqused_k=used, page_table=table, causal=True)

        calls["fa_cute"] = (fa, fa)
    except ImportError as exc:
        print(f"  fa_cute          not installed ({exc})")
    timed, ok = check_contenders(calls, error, TOLERANCE)
    moved = 2 * 2 * batch * keys * HEADS_KV * HEAD_DIM
    for name, ms in time_interleaved(timed, timer=time_flushed).items():
        row[name] = round(moved / (ms * 1e-3) / 1e9, 1)
    return row, ok


def run_fp8_cache_case(batch: int, keys: int) -> tuple[Row, bool]:
    from epicute.attention.api import reference_attention
    from epicute.attention.fp8 import values_of_slots
    from epicute.attention.validate import check_attention_args
    from epicute.benchmark import time_flushed
    from epicute.nn import PagedKVCache, attention_with_kvcache

    pages = keys // PAGE
    table = torch.randperm(batch * pages, device="cuda").view(batch, pages).to(torch.int32)
    used = torch.full((batch,), keys, device="cuda", dtype=torch.int32)
    caches = {}
    for dtype in (torch.float8_e4m3fn, torch.bfloat16):
        scale = {"k_scale": 0.01, "v_scale": 0.01} if dtype != torch.bfloat16 else {}
        caches[dtype] = PagedKVCache(batch, keys, HEADS_KV, HEAD_DIM, page_size=PAGE, page_table=table,
                                     seqlens=used, device="cuda", dtype=dtype, **scale)  # fmt: skip
    fp8, bf16 = caches[torch.float8_e4m3fn], caches[torch.bfloat16]
    k = torch.randn(batch * pages, PAGE, HEADS_KV, HEAD_DIM, device="cuda")
    v = torch.randn_like(k)
    # the fp8 cache's contents, and the bf16 cache holding the same (dequantized) values
    fp8.k_pages.copy_((k / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn))  # e4m3 has no inf: out of range is NaN
    fp8.v_pages.copy_((v / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn))
    bf16.k_pages.copy_(fp8.k_pages.float() * 0.01)
    bf16.v_pages.copy_(values_of_slots(fp8.v_pages, PAGE).float() * 0.01)
    q = torch.randn(batch, 1, HEADS_KV * 4, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    row: Row = {"case": f"attn_fp8_b{batch}_k{keys}"}
    print(row["case"])
    picks = sorted({0, batch - 1})
    sub = check_attention_args(q[picks], bf16.k_pages, bf16.v_pages, causal=True, softmax_scale=None,
                               page_table=table[picks], seqused_k=used[picks])  # fmt: skip
    ref = reference_attention(sub, out_dtype=torch.float32, device="cuda")[0]["D"]

    def error(o) -> float:
        return ((o[picks].float() - ref).norm() / ref.norm()).item()

    def ours():
        return attention_with_kvcache(q, fp8)

    def theirs():
        return attention_with_kvcache(q, bf16)

    # A serving step replayed from a CUDA graph: the GPU's time, whatever the host's speed.
    runs = {"epicute": (ours, ours), "epicute_bf16": (theirs, theirs)}
    for name, step in (("epicute_graph", ours), ("epicute_bf16_graph", theirs)):
        graph, out = captured(step)
        runs[name] = (lambda graph=graph, out=out: (graph.replay(), out)[1], graph.replay)
    timed, ok = check_contenders(runs, error, FP8_TOLERANCE)
    moved = 2 * 2 * batch * keys * HEADS_KV * HEAD_DIM  # the bf16 cache's bytes, for both columns
    for name, ms in time_interleaved(timed, timer=time_flushed).items():
        row[name] = round(moved / (ms * 1e-3) / 1e9, 1)
    return row, ok


def captured(step) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``step`` captured in a CUDA graph (after warm-up calls on a side stream, as torch's docs do it), and the
    output tensor its replays write."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def parse_attention(text: str) -> list[tuple[int, int]]:
    """``BATCHxKEYS`` or ``BATCHxKEYSxGROUP`` items, comma-separated, or 'none'."""
    return [] if text == "none" else [tuple(int(x) for x in item.split("x")) for item in text.split(",")]


def parse_gemm_shapes(text: str) -> list:
    return [] if text == "none" else parse_shapes(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_gemm_shapes,
                        help="comma-separated MxNxK list, or 'none' (default: the issue's set)")  # fmt: skip
    parser.add_argument("--attention", type=parse_attention, help="comma-separated BATCHxKEYS[xGROUP] list, or 'none'"
                        " (default: the issue's set)")  # fmt: skip
    parser.add_argument("--fp8-cache", type=parse_attention, help="comma-separated BATCHxKEYS list of fp8 KV cache "
                        "rows, or 'none' (default: the issue's set)")  # fmt: skip
    args = start_peer_run(parser, DEFAULT_OUT)
    if args is None:
        return 2
    rows, all_ok = [], True
    for shape in ALL_SHAPES if args.shapes is None else args.shapes:
        row, ok = run_case(shape)
        rows.append(row)
        all_ok = all_ok and ok
    for case in ATTENTION_CASES if args.attention is None else args.attention:
        row, ok = run_attention_case(*case)
        rows.append(row)
        all_ok = all_ok and ok
    for case in FP8_CACHE_CASES if args.fp8_cache is None else args.fp8_cache:
        row, ok = run_fp8_cache_case(*case)
        rows.append(row)
        all_ok = all_ok and ok
    return finish_peer_run(args.out, "decode", rows, all_ok, unit="GB/s")


if __name__ == "__main__":
    sys.exit(main())
