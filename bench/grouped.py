"""Grouped GEMM (mixture-of-experts) throughput: epicute.grouped_gemm vs torch._grouped_mm, quack's
varlen-M GEMM and a loop of torch.mm, in TFLOPS (2 * total_M * N * K per call).

Usage: python bench/grouped.py [--cases even8,skewed8,even64,skewed128,decode64,swiglu8,wgrad8,fp8block8,gather8,
                                wgrad32_dsv3,half8_down] [--out PATH]
Inputs as ``../shared/bench/PEERS.md`` calls the peers: bf16 tokens ``x`` (total_M, K) sorted by
expert, weights ``w`` (G, N, K) row-major passed as ``w.transpose(-2, -1)``, ``offs`` int32 group ends
(quack takes ``cu_seqlens_m``, the same with a leading 0). Group sizes are multiples of 8 (as in
PEERS.md): even splits, Zipf-skewed ones (expert i gets a share ~ 1/(i+1), shuffled), one expert taking half
the rows (``half8_down``, a Mixtral down projection), and the decode case's top-8 routing of 512 tokens over 64
experts rounded to multiples of 8. Every contender's first
call is checked against a float32 reference and not timed; then all are timed as
``triton.testing.do_bench`` times them (L2 flushed before each call), medians of interleaved rounds.
The gated case (``swiglu8``) is an MoE up-projection with its activation: B holds each expert's gate
and up projections (N = 2 x 7168), D = silu(gate) * up * router weight (7168 columns). epicute runs it
as one kernel (``gated=True``, weights interleaved once by ``epicute.interleave_gate_up``), and beside
it the plain grouped GEMM of the same B (``epicute_plain``: the fused epilogue's cost is the ratio);
torch runs ``torch._grouped_mm`` over the concatenated ``[gate; up]`` weight, then the activation in
eager torch (``torch_grouped_mm``). TFLOPS count the GEMM's 2 * total_M * 2N * K for all three.
The fp8 case (``fp8block8``) runs e4m3 tokens and weights with DeepSeek-V3's blockwise scales
(tokens per 1x128, weights per 128x128 block), bf16 out: ``epicute.grouped_gemm(x, wt, offs,
a_scale=, b_scale=)`` against a loop of cuBLAS blockwise ``torch._scaled_mm`` per expert
(``cublas_blockwise_loop``; torch has no blockwise grouped GEMM), with epicute's bf16 grouped GEMM
of the same shapes beside it (``epicute_bf16``, not checked).
The gathered case (``gather8``) reads its rows through an index, as an MoE layer whose tokens stay where they
are: 8192 tokens, each routed to two experts (16384 grouped rows, Zipf-sized groups):
``epicute.grouped_gemm(x, wt, offs, a_index=index)``, quack with ``A_idx``, and ``torch._grouped_mm`` of
``x[index]`` (the permuted copy timed with it); ``epicute_pregathered`` is epicute's grouped GEMM of the
copy made beforehand (not checked), so the gather's own cost is its ratio to ``epicute``.
The variable-K case (``wgrad8``) is an MoE weight gradient, dW_g = x_g^T dy_g over each expert's tokens
(x (tokens, 4096), dy (tokens, 14336), Zipf routing): ``epicute.grouped_gemm(x.t(), dy, offs)``,
``torch._grouped_mm`` of the same 2-D operands, quack with ``cu_seqlens_k`` and a loop of ``torch.mm``;
``wgrad32_dsv3`` the same at DeepSeek-V3's expert-parallel shape (32 experts, D 32 x 7168 x 4096, even routing).
Writes bench/results/grouped.json (and $OUT/grouped.json when OUT is set).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
from common import Row, check_contenders, finish_peer_run, time_interleaved

#: name -> (experts, total tokens routed, K, N, routing)
CASES = {
    "even8": (8, 16384, 4096, 14336, "even"),
    "skewed8": (8, 16384, 4096, 14336, "zipf"),
    "even64": (64, 16384, 7168, 2048, "even"),
    "skewed128": (128, 32768, 2048, 1536, "zipf"),
    "decode64": (64, 512 * 8, 7168, 2048, "top8"),
    "swiglu8": (8, 16384, 4096, 14336, "zipf"),  # gated: N = gate + up columns
    "wgrad8": (8, 16384, 4096, 14336, "zipf"),  # variable K: tokens are the reduction, D (G, 4096, 14336)
    "fp8block8": (8, 16384, 4096, 14336, "zipf"),  # fp8 e4m3 inputs, blockwise scales per group
    "gather8": (8, 16384, 4096, 14336, "zipf"),  # rows gathered from 8192 tokens, each routed to 2 experts
    # DeepSeek-V3's expert-parallel weight gradient: 32 local experts, D (32, 7168, 4096) (issue 60)
    "wgrad32_dsv3": (32, 16384, 7168, 4096, "even"),
    # Mixtral's down projection with one expert taking half the tokens (issue 60)
    "half8_down": (8, 16384, 14336, 4096, "half"),
}
GATED = {"swiglu8"}
VARIABLE_K = {"wgrad8", "wgrad32_dsv3"}
FP8 = {"fp8block8"}
GATHER = {"gather8"}
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "grouped.json"
TOLERANCE = 1e-2


def group_sizes(experts: int, total: int, routing: str, gen: torch.Generator) -> list[int]:
    """Rows per expert, multiples of 8 adding up to ``total`` (a multiple of 8)."""
    units = total // 8
    if routing == "even":
        weights = torch.ones(experts)
    elif routing == "half":  # one expert (at random) takes half the rows, the others share the rest evenly
        weights = torch.full((experts,), 1.0 / (experts - 1), dtype=torch.float64)
        weights[int(torch.randint(experts, (1,), generator=gen))] = 1.0
    elif routing == "zipf":
        weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
        weights = weights[torch.randperm(experts, generator=gen)]
    else:  # top-8 routing of total/8 tokens: each picks 8 distinct experts at random
        picks = torch.rand(total // 8, experts, generator=gen).topk(8, dim=1).indices.flatten()
        weights = torch.bincount(picks, minlength=experts).double()
    counts = torch.floor(weights / weights.sum() * units).long()
    counts[torch.argmax(weights)] += units - int(counts.sum())
    return (counts * 8).tolist()


def contenders(sizes: list[int]) -> dict:
    """Functions of ``(x, wt, offs)`` returning (total_M, N) bf16."""
    import epicute

    ends = torch.cumsum(torch.tensor(sizes), 0).tolist()
    starts = [0, *ends[:-1]]

    def loop(x, wt, offs):
        out = torch.empty(x.shape[0], wt.shape[2], device=x.device, dtype=x.dtype)
        for g, (s, e) in enumerate(zip(starts, ends)):
            if e > s:
                torch.mm(x[s:e], wt[g], out=out[s:e])
        return out

    found = {
        "epicute": lambda x, wt, offs: epicute.grouped_gemm(x, wt, offs),
        "torch_grouped_mm": lambda x, wt, offs: torch._grouped_mm(x, wt, offs=offs, out_dtype=torch.bfloat16),
    }
    try:
        from quack.gemm_interface import gemm as qgemm

        zero = torch.zeros(1, dtype=torch.int32, device="cuda")

        def quack(x, wt, offs):
            return qgemm(x, wt, cu_seqlens_m=torch.cat([zero, offs]), tuned=False)

        found["quack"] = quack
    except ImportError:
        print("quack not installed: no quack column")
    found["torch_loop"] = loop
    return found


def measure(row: Row, calls: dict, ref: torch.Tensor, flops: int, unchecked: dict | None = None) -> tuple[Row, bool]:
    """Check each contender of ``calls`` (label -> (checked call, timed call)) against ``ref``, then time them and
    ``unchecked`` ones as do_bench does, interleaved; TFLOPS of ``flops`` per call into ``row``."""
    from epicute.benchmark import time_flushed

    timed, ok = check_contenders(calls, lambda got: ((got.float() - ref).norm() / ref.norm()).item(), TOLERANCE)
    for label, ms in time_interleaved({**timed, **(unchecked or {})}, timer=time_flushed).items():
        row[label] = round(flops / (ms * 1e-3) / 1e12, 1)
    return row, ok


def run_case(name: str, gen: torch.Generator) -> tuple[Row, bool]:
    experts, total, k, n, routing = CASES[name]
    sizes = group_sizes(experts, total, routing, gen)
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32).cuda()
    x = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
    wt = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
    ends = offs.tolist()
    ref = torch.cat([x[s:e].float() @ wt[g].float() for g, (s, e) in enumerate(zip([0, *ends[:-1]], ends))])
    row: Row = {"case": f"{name}: {experts} experts, {total} rows, K {k}, N {n}, {routing} (largest group "
                        f"{max(sizes)}, {sizes.count(0)} empty)"}  # fmt: skip
    print(row["case"])
    calls = {label: (functools.partial(fn, x, wt, offs),) * 2 for label, fn in contenders(sizes).items()}
    return measure(row, calls, ref, 2 * total * n * k)


def run_gated_case(name: str, gen: torch.Generator) -> tuple[Row, bool]:
    """The fused SwiGLU with router weights against the plain grouped GEMM and torch's unfused chain."""
    import epicute

    experts, total, k, n, routing = CASES[name]
    half = n // 2
    sizes = group_sizes(experts, total, routing, gen)
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32).cuda()
    x = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
    w_gate, w_up = (torch.randn(experts, half, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(2))
    w13 = torch.cat([w_gate, w_up], dim=1)  # torch's layout: [gate; up] per expert
    w_interleaved = epicute.interleave_gate_up(w_gate, w_up)
    score = torch.rand(total, 1, device="cuda")
    ends = offs.tolist()
    ref = []
    for g, (s, e) in enumerate(zip([0, *ends[:-1]], ends)):
        h = x[s:e].float() @ w13[g].float().t()
        ref.append(torch.nn.functional.silu(h[:, :half]) * h[:, half:] * score[s:e])
    ref = torch.cat(ref)

    def swiglu(gate, up, score):
        return epicute.ops.silu(gate) * up * score

    def torch_unfused(x, w13t, offs, score):
        h = torch._grouped_mm(x, w13t, offs=offs, out_dtype=torch.bfloat16)
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up * score

    wt = w_interleaved.transpose(-2, -1)
    fused = functools.partial(epicute.grouped_gemm, x, wt, offs, gated=True, epilogue=swiglu, score=score)
    calls = {
        "epicute": (fused, fused),
        "torch_grouped_mm": (functools.partial(torch_unfused, x, w13.transpose(-2, -1), offs, score),) * 2,
    }
    row: Row = {"case": f"{name}: {experts} experts, {total} rows, K {k}, gate+up N {n} -> silu(gate) * up * "
                        f"router weight, {routing} (largest group {max(sizes)})"}  # fmt: skip
    print(row["case"])
    plain = functools.partial(epicute.grouped_gemm, x, wt, offs)  # the same GEMM, no activation: not checked
    return measure(row, calls, ref, 2 * total * n * k, unchecked={"epicute_plain": plain})


def run_variable_k_case(name: str, gen: torch.Generator) -> tuple[Row, bool]:
    """Weight gradients over each expert's tokens: the groups split the reduction."""
    import epicute
    from epicute.benchmark import time_flushed

    experts, total, m, n, routing = CASES[name]
    sizes = group_sizes(experts, total, routing, gen)
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32).cuda()
    x = torch.randn(total, m, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(total, n, device="cuda", dtype=torch.bfloat16)
    ends = offs.tolist()
    spans = list(zip([0, *ends[:-1]], ends))

    def loop(x, dy):
        out = torch.empty(experts, m, n, device="cuda", dtype=torch.bfloat16)
        for g, (s, e) in enumerate(spans):
            torch.mm(x[s:e].t(), dy[s:e], out=out[g])
        return out

    calls = {
        "epicute": lambda: epicute.grouped_gemm(x.t(), dy, offs),
        "torch_grouped_mm": lambda: torch._grouped_mm(x.t(), dy, offs=offs, out_dtype=torch.bfloat16),
    }
    try:
        from quack.gemm_interface import gemm as qgemm

        cu = torch.cat([torch.zeros(1, dtype=torch.int32, device="cuda"), offs])
        calls["quack"] = lambda: qgemm(x.t(), dy, cu_seqlens_k=cu, tuned=False)
    except ImportError:
        print("quack not installed: no quack column")
    calls["torch_loop"] = lambda: loop(x, dy)

    def error(got) -> float:  # group by group against float32, so the check holds one (M, N) at a time
        num = den = 0.0
        for g, (s, e) in enumerate(spans):
            ref = x[s:e].float().t() @ dy[s:e].float()
            num += float((got[g].float() - ref).norm() ** 2)
            den += float(ref.norm() ** 2)
        return (num / den) ** 0.5

    row: Row = {"case": f"{name}: weight gradient, {experts} experts, {total} tokens (the reduction, {routing}), "
                        f"D {experts} x {m} x {n} (largest group {max(sizes)})"}  # fmt: skip
    print(row["case"])
    timed, ok = check_contenders({label: (fn, fn) for label, fn in calls.items()}, error, TOLERANCE)
    for label, ms in time_interleaved(timed, timer=time_flushed).items():
        row[label] = round(2 * total * n * m / (ms * 1e-3) / 1e12, 1)
    return row, ok


def run_fp8_case(name: str, gen: torch.Generator) -> tuple[Row, bool]:
    """fp8 experts with blockwise scales against a loop of cuBLAS's blockwise ``torch._scaled_mm``."""
    import epicute

    experts, total, k, n, routing = CASES[name]
    sizes = group_sizes(experts, total, routing, gen)
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32).cuda()
    e4m3 = torch.float8_e4m3fn
    x = (torch.randn(total, k, device="cuda") * 0.5).to(e4m3)
    w = (torch.randn(experts, n, k, device="cuda") * 0.5).to(e4m3)
    sa = torch.rand(k // 128, total, device="cuda").t() + 0.5  # torch's M-major A scales
    sb = torch.rand(experts, n // 128, k // 128, device="cuda") + 0.5
    ends = offs.tolist()
    spans = list(zip([0, *ends[:-1]], ends))
    # cuBLAS takes each group's A scales M-major and compact: copies made once, outside the timing.
    sa_groups = [sa[s:e].t().contiguous().t() for s, e in spans]

    def loop():
        out = torch.empty(total, n, device="cuda", dtype=torch.bfloat16)
        for g, (s, e) in enumerate(spans):
            if e > s:
                out[s:e] = torch._scaled_mm(x[s:e], w[g].t(), scale_a=sa_groups[g], scale_b=sb[g].t(),
                                            out_dtype=torch.bfloat16)  # fmt: skip
        return out

    ref = []
    for g, (s, e) in enumerate(spans):
        a = x[s:e].float() * sa[s:e].repeat_interleave(128, 1)
        b = w[g].float() * sb[g].repeat_interleave(128, 0).repeat_interleave(128, 1)
        ref.append(a @ b.t())
    ref = torch.cat(ref)
    fused = functools.partial(epicute.grouped_gemm, x, w.transpose(-2, -1), offs, a_scale=sa, b_scale=sb)
    calls = {"epicute": (fused, fused), "cublas_blockwise_loop": (loop, loop)}
    row: Row = {"case": f"{name}: fp8 e4m3 blockwise, {experts} experts, {total} rows, K {k}, N {n}, {routing} "
                        f"(largest group {max(sizes)})"}  # fmt: skip
    print(row["case"])
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16).transpose(-2, -1)
    bf16 = functools.partial(epicute.grouped_gemm, xb, wb, offs)
    return measure(row, calls, ref, 2 * total * n * k, unchecked={"epicute_bf16": bf16})


def run_gather_case(name: str, gen: torch.Generator) -> tuple[Row, bool]:
    """Gathered rows (``a_index``) against quack's ``A_idx`` and torch's copy-then-grouped-GEMM."""
    import epicute

    experts, total, k, n, routing = CASES[name]
    tokens = total // 2
    sizes = group_sizes(experts, total, routing, gen)
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32).cuda()
    index = (torch.randperm(total, generator=gen) % tokens).to(torch.int32).cuda()  # every token twice
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    wt = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
    rows = x[index.long()]
    ends = offs.tolist()
    ref = torch.cat([rows[s:e].float() @ wt[g].float() for g, (s, e) in enumerate(zip([0, *ends[:-1]], ends))])
    row: Row = {"case": f"{name}: {experts} experts, {tokens} tokens x 2 gathered into {total} rows, K {k}, N {n}, "
                        f"{routing} (largest group {max(sizes)})"}  # fmt: skip
    print(row["case"])
    index64 = index.long()
    calls = {
        "epicute": functools.partial(epicute.grouped_gemm, x, wt, offs, a_index=index),
        "torch_grouped_mm": lambda: torch._grouped_mm(x[index64], wt, offs=offs, out_dtype=torch.bfloat16),
    }
    try:
        from quack.gemm_interface import gemm as qgemm

        cu = torch.cat([torch.zeros(1, dtype=torch.int32, device="cuda"), offs])
        calls["quack"] = lambda: qgemm(x, wt, cu_seqlens_m=cu, A_idx=index, tuned=False)
    except ImportError:
        print("quack not installed: no quack column")
    pregathered = functools.partial(epicute.grouped_gemm, rows, wt, offs)
    return measure(row, {label: (fn, fn) for label, fn in calls.items()}, ref, 2 * total * n * k,
                   unchecked={"epicute_pregathered": pregathered})  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result JSON path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    gen = torch.Generator().manual_seed(0)
    rows, all_ok = [], True
    for name in args.cases.split(","):
        run = (
            run_gated_case if name in GATED else run_variable_k_case if name in VARIABLE_K
            else run_fp8_case if name in FP8 else run_gather_case if name in GATHER else run_case
        )  # fmt: skip
        row, ok = run(name, gen)
        rows.append(row)
        all_ok = all_ok and ok
        torch.cuda.empty_cache()
    return finish_peer_run(args.out, "grouped", rows, all_ok)


if __name__ == "__main__":
    sys.exit(main())
