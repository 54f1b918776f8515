"""Attention backward (training): epicute vs flash-attn-4, cuDNN and SDPA flash, in TFLOPS.

Usage: python bench/attention_bwd.py [--cases NAME,...] [--out PATH]
bf16, layout (batch, seqlen, heads, head_dim), called as ``../shared/bench/PEERS.md`` calls the
peers: each contender's forward runs once with q, k, v requiring grad, then
``torch.autograd.grad(o, (q, k, v), do, retain_graph=True)`` is timed (the backward pass only).
TFLOPS count 2.5x the forward's 4·b·h·sq·sk·d matmul FLOPs, halved when causal. Each contender's
gradients are first checked against a float32 autograd reference of the first (batch, key/value
head) and its query heads, 2048 queries at a time (the whole problem's float32 scores would not fit;
GQA 8:1 and 16:1 rows, up to 32 K keys, are issue 60's), then all are timed as
``triton.testing.do_bench`` times them (L2 flushed before each call; :func:`epicute.benchmark.time_flushed`),
medians of interleaved rounds. Writes bench/results/attention_bwd.json (and $OUT/attention_bwd.json).

``<case>_deterministic`` rows time the deterministic backwards (``deterministic=True``: dQ's parts
added in a fixed order), epicute's against flash-attn-4's, on a case's inputs.

The ``varlen`` case packs sequences of mixed lengths (flash-attn's varlen layout, ``cu_seqlens``) and
gives two rows: its forward (q, k, v not requiring grad; peer: flash-attn-4's
``flash_attn_varlen_func``) and its backward (the same call's gradients), FLOPs summed per sequence.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from common import Row, check_contenders, finish_peer_run, start_peer_run, time_interleaved

#: name -> (batch, seqlen, heads_q, heads_kv, head_dim, causal)
CASES = {
    "b4_h16_s8192_d128": (4, 8192, 16, 16, 128, False),
    "b4_h16_s8192_d128_causal": (4, 8192, 16, 16, 128, True),
    "b8_h8_s4096_d64_causal": (8, 4096, 8, 8, 64, True),
    "b2_h16_s8192_d256_causal": (2, 8192, 16, 16, 256, True),
    "b16_h16_s2048_d128": (16, 2048, 16, 16, 128, False),
    "b1_h16_s16384_d128": (1, 16384, 16, 16, 128, False),
    "b2_hq32_hkv8_s8192_d128_causal": (2, 8192, 32, 8, 128, True),
    # GQA 8:1 and 16:1 (issue 60): Llama-3-70B's attention (64 / 8 heads), Qwen3-30B-A3B's at 32 K (32 / 4)
    "b1_hq64_hkv8_s8192_d128_causal": (1, 8192, 64, 8, 128, True),
    "b1_hq32_hkv4_s32768_d128_causal": (1, 32768, 32, 4, 128, True),
    "b1_hq64_hkv4_s8192_d128_causal": (1, 8192, 64, 4, 128, True),
    # head_dim 256 at 8:1 (Qwen3-Next's gated attention: 16 / 2 heads) and 2:1 (Gemma-3-12B's: 16 / 8)
    "b1_hq16_hkv2_s8192_d256_causal": (1, 8192, 16, 2, 256, True),
    "b1_hq16_hkv8_s16384_d256_causal": (1, 16384, 16, 8, 256, True),
    # short causal walks, the widest grid band (backward_plan.SHORT_CAUSAL_SEQLEN): Qwen2.5-7B's 7:1 at 4 K, 4:1 at 2 K
    "b2_hq28_hkv4_s4096_d128_causal": (2, 4096, 28, 4, 128, True),
    "b4_hq32_hkv8_s2048_d128_causal": (4, 2048, 32, 8, 128, True),
    # a short ragged walk whose kernels take about what a step's host work does (Llama-3-8B's heads, 1000 tokens)
    "b3_hq32_hkv8_s1000_d128_causal": (3, 1000, 32, 8, 128, True),
}
#: name -> (sequence lengths, heads_q, heads_kv, head_dim, causal): 16 sequences of 257-8000 tokens (65 K).
VARLEN_CASES = {
    "varlen_16seq_h16_d128_causal": (
        (8000, 257, 4096, 1031, 6000, 512, 7777, 3000, 999, 5120, 2048, 4500, 300, 7000, 6400, 7800),
        16,
        16,
        128,
        True,
    ),
}
#: Cases also timed in deterministic mode (epicute and flash-attn-4 only; cuDNN and SDPA have none).
DETERMINISTIC_CASES = ("b4_h16_s8192_d128", "b4_h16_s8192_d128_causal", "b2_hq32_hkv8_s8192_d128_causal")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "attention_bwd.json"
TOLERANCE = 1e-2


#: Query rows per float32 reference pass: its scores stay ~2 GB per 8 heads however long the keys run.
REFERENCE_ROWS = 2048


def reference_grads(q, k, v, do, causal: bool):
    """float32 autograd of the first (batch, key/value head) and its query heads: (dq, dk, dv) slices. The queries
    go in blocks of :data:`REFERENCE_ROWS` (exact: each query's softmax is its own), dK and dV summed over them."""
    group, seqlen_q = q.shape[2] // k.shape[2], q.shape[1]
    k1, v1 = (t[:1, :, :1].detach().float().requires_grad_() for t in (k, v))
    dq, dk, dv = [], torch.zeros_like(k1), torch.zeros_like(v1)
    for first in range(0, seqlen_q, REFERENCE_ROWS):
        rows = slice(first, first + REFERENCE_ROWS)
        q1 = q[:1, rows, :group].detach().float().requires_grad_()
        o = _first_group_attention(q1, k1, v1, causal, first, seqlen_q)
        grads = torch.autograd.grad(o, (q1, k1, v1), do[:1, rows, :group].float())
        dq.append(grads[0])
        dk += grads[1]
        dv += grads[2]
    return torch.cat(dq, dim=1), dk, dv


def _first_group_attention(q1, k1, v1, causal: bool, first_query: int = 0, seqlen_q: int | None = None):
    """float32 O ``(1, rows, group, d)`` of one key/value head's query heads (q1 ``(1, rows, group, d)``: queries
    ``first_query`` on of ``seqlen_q``, all by default; k1 and v1 ``(1, sk, 1, d)``), causal bottom-right aligned."""
    group = q1.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q1, k1.expand(-1, -1, group, -1)) * q1.shape[-1] ** -0.5
    if causal:
        rows, sk = q1.shape[1], k1.shape[1]
        sq = rows if seqlen_q is None else seqlen_q
        queries = torch.arange(first_query, first_query + rows, device=q1.device)
        hidden = torch.arange(sk, device=q1.device)[None] > queries[:, None] + sk - sq
        s = s.masked_fill(hidden, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v1.expand(-1, -1, group, -1))


def run_case(name: str, deterministic: bool = False) -> tuple[Row, bool]:
    """One case's row; ``deterministic``: the ``<name>_deterministic`` row (epicute and flash-attn-4)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import epicute
    from epicute.benchmark import time_flushed
    from epicute.errors import EpicuteError

    batch, seqlen, hq, hkv, d, causal = CASES[name]
    q = torch.randn(batch, seqlen, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, seqlen, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(batch, seqlen, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(batch, seqlen, hq, d, device="cuda", dtype=torch.bfloat16)
    ref = reference_grads(q, k, v, do, causal)
    group = hq // hkv
    row: Row = {"case": f"{name}_deterministic" if deterministic else name}
    print(row["case"])

    def error(grads) -> float:
        dq, dk, dv = grads
        got = (dq[:1, :, :group], dk[:1, :, :1], dv[:1, :, :1])
        return max(((g.float() - r).norm() / r.norm()).item() for g, r in zip(got, ref))

    def backward_of(forward, inputs, grad_out, to_bshd=lambda t: t):
        o = forward()
        o = o[0] if isinstance(o, tuple) else o

        def run():
            return tuple(to_bshd(g) for g in torch.autograd.grad(o, inputs, grad_out, retain_graph=True))

        return run

    calls = {}
    try:
        ours = backward_of(
            lambda: epicute.attention(q, k, v, causal=causal, deterministic=deterministic), (q, k, v), do
        )
        calls["epicute"] = (ours, ours)
    except EpicuteError as exc:  # a case the backward does not cover is recorded without epicute
        print(f"  epicute          not supported: {exc}")
    try:
        from flash_attn.cute.interface import flash_attn_func

        fa = backward_of(lambda: flash_attn_func(q, k, v, causal=causal, deterministic=deterministic), (q, k, v), do)
        calls["fa_cute"] = (fa, fa)
    except Exception as exc:  # noqa: BLE001 - a missing or failing peer must not stop the others
        print(f"  fa_cute          not run ({type(exc).__name__}: {exc})")
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    do_t = do.transpose(1, 2).contiguous()
    sdpa = (("cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION))
    for peer, backend in () if deterministic else sdpa:
        try:
            with sdpa_kernel([backend]):
                run = backward_of(
                    lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=hq != hkv),
                    (qt, kt, vt), do_t, lambda g: g.transpose(1, 2),
                )  # fmt: skip
                run()
            calls[peer] = (run, run)
        except Exception as exc:  # noqa: BLE001
            print(f"  {peer:16s} not run ({type(exc).__name__}: {exc})")
    timed, ok = check_contenders(calls, error, TOLERANCE)
    flops = 2.5 * 4 * batch * hq * seqlen * seqlen * d / (2 if causal else 1)
    for contender, ms in time_interleaved(timed, timer=time_flushed).items():
        row[contender] = round(flops / (ms * 1e-3) / 1e12, 1)
    return row, ok or "epicute" not in calls


def run_varlen_case(name: str) -> tuple[list[Row], bool]:
    """The varlen case's forward and backward rows (see the module docstring)."""
    import epicute
    from epicute.benchmark import time_flushed

    lengths, hq, hkv, d, causal = VARLEN_CASES[name]
    total = sum(lengths)
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    packed = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": max(lengths), "max_seqlen_k": max(lengths)}
    q = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16)
    first = lengths[0]  # checked on the first sequence, whose gradients depend on it alone
    ref = reference_grads(q[None, :first], k[None, :first], v[None, :first], do[None, :first], causal)
    ref_o = _first_group_attention(
        *(t[None, :first, :n].detach().float() for t, n in ((q, hq // hkv), (k, 1), (v, 1))), causal
    )[0]
    group = hq // hkv
    flops_fwd = sum(4 * hq * n * n * d for n in lengths) / (2 if causal else 1)
    print(name)

    def fwd_error(o) -> float:
        got = o[:first, :group].float()
        return ((got - ref_o).norm() / ref_o.norm()).item()

    def bwd_error(grads) -> float:
        dq, dk, dv = grads
        got = (dq[:first, :group], dk[:first, :1], dv[:first, :1])
        return max(((g.float() - r[0]).norm() / r[0].norm()).item() for g, r in zip(got, ref))

    forward = {"epicute": lambda: epicute.attention(q.detach(), k.detach(), v.detach(), causal=causal, **packed)}
    backward = {}
    o = epicute.attention(q, k, v, causal=causal, **packed)
    backward["epicute"] = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func

        fa_args = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": max(lengths),
                   "max_seqlen_k": max(lengths), "causal": causal}  # fmt: skip

        def fa_forward():
            out = flash_attn_varlen_func(q.detach(), k.detach(), v.detach(), **fa_args)
            return out[0] if isinstance(out, tuple) else out

        fa_o = flash_attn_varlen_func(q, k, v, **fa_args)
        fa_o = fa_o[0] if isinstance(fa_o, tuple) else fa_o
        forward["fa_cute"] = fa_forward
        backward["fa_cute"] = lambda: torch.autograd.grad(fa_o, (q, k, v), do, retain_graph=True)
    except Exception as exc:  # noqa: BLE001 - a missing or failing peer must not stop the others
        print(f"  fa_cute          not run ({type(exc).__name__}: {exc})")
    rows, all_ok = [], True
    for suffix, calls, error, flops in (("fwd", forward, fwd_error, flops_fwd), ("bwd", backward, bwd_error,
                                                                                   2.5 * flops_fwd)):  # fmt: skip
        timed, ok = check_contenders({n: (f, f) for n, f in calls.items()}, error, TOLERANCE)
        row: Row = {"case": f"{name}_{suffix}"}
        for contender, ms in time_interleaved(timed, timer=time_flushed).items():
            row[contender] = round(flops / (ms * 1e-3) / 1e12, 1)
        rows.append(row)
        all_ok = all_ok and ok
    return rows, all_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    deterministic = [f"{name}_deterministic" for name in DETERMINISTIC_CASES]
    parser.add_argument("--cases", type=lambda s: s.split(","), default=[*CASES, *VARLEN_CASES, *deterministic],
                        help="comma-separated names")  # fmt: skip
    args = start_peer_run(parser, DEFAULT_OUT)
    if args is None:
        return 2
    rows, all_ok = [], True
    for name in args.cases:
        if name in VARLEN_CASES:
            case_rows, ok = run_varlen_case(name)
        else:
            row, ok = run_case(name.removesuffix("_deterministic"), name.endswith("_deterministic"))
            case_rows = [row]
        rows += case_rows
        all_ok = all_ok and ok
        torch.cuda.empty_cache()
    return finish_peer_run(args.out, "attention_bwd", rows, all_ok)


if __name__ == "__main__":
    sys.exit(main())
