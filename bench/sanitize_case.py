"""One small epicute call for compute-sanitizer to watch (see bench/device.sh).

Usage: python bench/sanitize_case.py CASE   (CASES below; `FAMILIES` groups them by kernel family)
`small` is one aligned 128x256x64 tile problem; `ragged` (M=129, N=136, K=72) exercises the
partial-tile paths; `pingpong` gives every CTA of the ping-pong schedule two or three ragged
tiles, so both warpgroups' turns and the shared staging buffers are exercised; `epilogue` runs
every stage of the GEMM's epilogue chain (a TMA-loaded operand tile, a parked vector, an aux tile
staged beside D, row/column/whole reductions) under ping-pong; `attention` runs attention's
output chain (O and an aux tile staged in turn in Q's buffer, reductions) on persistent CTAs,
some of which walk two tiles; `fp8_quantize` a blockwise-scaled fp8 GEMM whose epilogue quantizes
D in 1x128 groups; `grouped` a grouped GEMM over ragged groups (an empty one too); `attention_gqa`
a causal GQA prefill (ping-pong, dynamic tiles); `decode_paged` packed GQA decode over a paged cache
with split-KV and its combine (ratio 4, and a padded ratio 3); `backward` the attention backward
(GQA, causal, ragged lengths); `linear_backward` a linear + bias + GELU + residual layer's forward and
backward (the saved pre-activation, the K = 0 gradient pass with its bias-gradient reduction, the data
and weight GEMMs); `moe_backward` a small MoE expert block's forward and backward (gathered rows,
the gated epilogue's gradient, the variable-K weight gradients); `paired` a ragged GEMM storing a paired
output (``D_up`` beside D, staged block-major) with a column sum (predicated partial stores); `moe_fp8_backward`
the same expert block trained in fp8 (gathered fp8 rows, the derivative's epilogue with the routing weight's row
sum, variable-K fp8 weight gradients over padded experts); `backward_head_split` the `backward` case with its GQA
group split over CTAs (dK and dV reduce-added in fp32, cast by the postprocess), `backward_head_split_d256` at
head_dim 256; `split_k` a tile's K in three splits, summed by the last to finish.
Prints PASS/FAIL and exits 1 on failure.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

#: name -> (M, N, K, config overrides) of the GEMM cases
GEMM_CASES: dict[str, tuple[int, int, int, dict]] = {
    "small": (128, 256, 64, {}),
    "ragged": (129, 136, 72, {}),
    "pingpong": (2049, 2056, 72, {"schedule": "pingpong", "tile_n": 128}),
    "epilogue": (2049, 2056, 72, {"schedule": "pingpong", "tile_n": 128}),
    # ReuseSmemC: D staged in the residual's ring, the slot given back once its store is read; 2 tiles per CTA.
    "reuse_smem_c": (2049, 3080, 72, {"schedule": "cooperative", "tile_n": 192, "reuse_smem_c": True}),
    # 224 columns: seven 32-column store subtiles; a ragged last tile (472 = 2 x 224 + 24) in a 2x1 cluster.
    "wide224": (257, 472, 72, {"schedule": "cooperative", "tile_n": 224, "cluster_m": 2}),
    # 256-row tiles, two 64-row blocks a consumer warpgroup: swapped 256x144 (D^T stored column-major; the ragged
    # M = 301 in three 144-wide tiles, the last one 13 rows), and unswapped 256x128 in a 2x1 cluster, ragged.
    "swapped256": (301, 600, 72, {"swap_ab": True, "schedule": "cooperative", "tile_m": 256, "tile_n": 144}),
    "tall256": (301, 264, 72, {"schedule": "cooperative", "tile_m": 256, "tile_n": 128, "cluster_m": 2}),
    "split_k": (33, 600, 2000, {"split_k": 3}),
    "swapped208": (301, 600, 72, {"swap_ab": True, "schedule": "cooperative", "tile_m": 128, "tile_n": 208}),
    # Swapped 256 x 112 tiles over more tiles than SMs (46 x 3 = 138: some CTAs run two), M and N ragged.
    "swapped256_persistent": (301, 11528, 72, {"swap_ab": True, "schedule": "cooperative", "tile_m": 256,
                                               "tile_n": 112, "persistent": True}),
}
#: case -> the kernel family it watches (rows of bench/results/sanitize.json)
FAMILIES = {
    "small": "gemm", "ragged": "gemm", "pingpong": "gemm", "epilogue": "gemm epilogue",
    "wide224": "gemm (128x224 tiles)", "swapped256": "gemm (swapped 256x144 tiles)",
    "tall256": "gemm (256x128 tiles)", "split_k": "gemm (split-K)",
    "swapped208": "gemm (swapped 128x208 tiles)", "swapped256_persistent": "gemm (swapped 256x112, persistent)",
    "reuse_smem_c": "gemm epilogue (D staged in the operand ring)",
    "fp8_quantize": "fp8 blockwise + quantize_groups", "grouped": "grouped gemm",
    "attention": "attention forward (epilogue)", "attention_gqa": "attention forward (GQA prefill)",
    "decode_paged": "attention decode (paged, split-KV)", "backward": "attention backward",
    "linear_backward": "gemm backward (K = 0 gradient pass)", "moe_backward": "grouped gemm backward",
    "quantize": "group quantizer (epicute.quantize)", "paired": "gemm epilogue (paired D, column sums)",
    "attention_fp8": "fp8 attention forward (prefill, packed, paged decode)",
    "moe_fp8_backward": "grouped gemm fp8 (gathered, gated, variable K)",
    "backward_head_split": "attention backward (GQA group split over CTAs, dK and dV reduce-added)",
    "backward_head_split_d256": "attention backward at head_dim 256 (the group split over CTAs)",
    "backward_head_split_ragged": "attention backward (a group of 4 split 3 + 1 over CTAs)",
}  # fmt: skip
CASES = tuple(FAMILIES)
TOLERANCE = 1e-2
#: fp8 attention rounds P to e4m3 (~4 % RMS on O; tests/attention/test_fp8_gpu.py bounds it precisely), fp8 experts
#: their GEMMs' inputs (tests/nn/fp8_cases.py): a wrong or unwritten value still reads as an error of order 1.
CASE_TOLERANCE = {"attention_fp8": 0.1, "moe_fp8_backward": 2.0**-3}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()  # NaN when unwritten


def gemm_case(name: str) -> dict[str, float]:
    import epicute
    from epicute import ops

    m, n, k, config = GEMM_CASES[name]
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    # NaN poison: any element the kernel fails to write makes the error NaN, hence FAIL.
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    if name == "reuse_smem_c":
        epicute.gemm(a, b, epilogue=lambda acc, bias, residual: ops.gelu(acc + bias) + residual, out=out,
                     config=config, bias=bias, residual=residual)  # fmt: skip
        want = torch.nn.functional.gelu(a.float() @ b.float() + bias.float()) + residual.float()
        return {"D": rel_err(out, want)}
    if name != "epilogue":
        epicute.gemm(a, b, out=out, config=config)
        return {"D": rel_err(out, a.float() @ b.float())}

    def epi(acc, bias, residual):
        y = acc + bias
        return {"D": y + residual, "pre": y, "rs": ops.row_sum(acc), "cm": ops.col_amax(acc), "am": ops.amax(acc)}

    got = epicute.gemm(a, b, epilogue=epi, out=out, config=config, bias=bias, residual=residual)
    ref = epicute.gemm(a, b, epilogue=epi, bias=bias, residual=residual, backend="reference")
    return {name: rel_err(got[name], ref[name].to(got[name].device)) for name in ref}


def paired_case() -> dict[str, float]:
    import epicute
    from epicute import ops

    a = torch.randn(333, 96, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(96, 200, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(333, 200, device="cuda", dtype=torch.bfloat16)

    def epi(acc, g):
        return {"D": acc * g, "D_up": acc + g, "cs": ops.col_sum(acc)}

    got = epicute.gemm(a, b, epilogue=epi, g=g)
    ref = epicute.gemm(a, b, epilogue=epi, g=g, backend="reference")
    return {name: rel_err(got[name], ref[name].to(got[name].device)) for name in ref}


def attention_case() -> dict[str, float]:
    import epicute
    from epicute import ops

    # 12 m-blocks x 12 heads = 144 tiles: more than SMs, so some CTAs walk two.
    q, k, v = (torch.randn(1, 1500, 12, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def epi(o):
        return {"D": o, "half": ops.cast(o * 0.5, torch.float16), "rs": ops.row_sum(o), "am": ops.amax(o)}

    # Static persistent tiles: racecheck reports the dynamic tile slot's hand-off (a producer's plain
    # shared-memory writes, ordered for the consumers by mbarriers), which it does not model
    # (bench/NOTES.md, 'Sanitizer' under 'The house finished'); the outputs' staging is the same either way.
    # Staged in their own buffer (planned) and in Q's.
    ref = epicute.attention(q, k, v, causal=True, epilogue=epi, backend="reference")
    errors = {}
    for own in (True, False):
        config = {"persistent": True, "dynamic_tiles": False, "o_buffer": own}
        got = epicute.attention(q, k, v, causal=True, epilogue=epi, config=config)
        errors.update({f"{name} o_buffer={own}": rel_err(got[name], ref[name].to(got[name].device)) for name in ref})
    return errors


def fp8_quantize_case() -> dict[str, float]:
    import epicute

    m, n, k = 257, 384, 512
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    a_scale = torch.rand(k // 128, m, device="cuda").t() + 0.5  # (M, K/128), M-major
    b_scale = torch.rand(n // 128, k // 128, device="cuda") + 0.5

    def epi(acc):
        q, scales = epicute.ops.quantize_groups(epicute.ops.silu(acc), ue8m0=True)
        return {"D": q, "scales": scales}

    got = epicute.gemm(a, w.t(), a_scale=a_scale, b_scale=b_scale, epilogue=epi)
    ref = epicute.gemm(a, w.t(), a_scale=a_scale, b_scale=b_scale, epilogue=epi, backend="reference")
    dequant = {name: (r["D"].float().cpu().view(m, n // 128, 128) * r["scales"].cpu()[..., None]).view(m, n)
               for name, r in (("got", got), ("ref", ref))}  # fmt: skip
    return {"D": rel_err(dequant["got"], dequant["ref"]), "scales": rel_err(got["scales"].cpu(), ref["scales"])}


def quantize_case() -> dict[str, float]:
    """A ragged last group (K = 400) and a row count that leaves the last CTA part empty."""
    import epicute

    x = torch.randn(37, 400, device="cuda", dtype=torch.bfloat16) * 10
    got = epicute.quantize(x, ue8m0=True)
    ref = epicute.quantize(x, ue8m0=True, backend="reference")
    dequant = [(q.float().cpu() * s.cpu().repeat_interleave(128, -1)[:, :400]) for q, s in (got, ref)]
    errors = {"D": rel_err(*dequant), "scales": rel_err(got[1].cpu(), ref[1].cpu())}
    # Whole rows of 1024 (rowwise: 32 values a lane, one warp a row), a part-filled CTA: an fp8 cache step's q.
    z = torch.randn(13, 1024, device="cuda", dtype=torch.bfloat16) * 10
    got, ref = (epicute.quantize(z, recipe="rowwise", backend=b) for b in ("kernel", "reference"))
    errors["rowwise"] = max(rel_err(got[0].float().cpu(), ref[0].float().cpu()), rel_err(got[1].cpu(), ref[1].cpu()))
    # The tile quantizer: part-filled tiles both ways, rows and the zero-padded transpose from one read.
    from epicute.quantize.api import quantize_pair

    y = torch.randn(131, 272, device="cuda", dtype=torch.bfloat16) * 10
    for rows, columns in (("groups", "blocks"), ("blocks", "groups")):
        made = quantize_pair(y, rows, columns, ue8m0=True)
        want = quantize_pair(y, rows, columns, ue8m0=True, backend="reference")
        for side, recipe, got_pair, want_pair in zip(("rows", "columns"), (rows, columns), made, want):
            errors[f"{side} {recipe}"] = max(
                rel_err(got_pair[0].float().cpu(), want_pair[0].float().cpu()),
                rel_err(got_pair[1].cpu(), want_pair[1].cpu()),
            )
    return errors


def grouped_case() -> dict[str, float]:
    import epicute

    sizes = torch.tensor([129, 0, 300, 17])
    x = torch.randn(int(sizes.sum()), 136, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(sizes), 264, 136, device="cuda", dtype=torch.bfloat16)
    offs = sizes.cumsum(0).to(device="cuda", dtype=torch.int32)
    got = epicute.grouped_gemm(x, w.transpose(-2, -1), offs)
    ref = epicute.grouped_gemm(x, w.transpose(-2, -1), offs, backend="reference")
    return {"D": rel_err(got, ref.to(got.device))}


def attention_gqa_case() -> dict[str, float]:
    import epicute

    q = torch.randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 300, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    got = epicute.attention(q, k, v, causal=True)
    ref = epicute.attention(q, k, v, causal=True, backend="reference")
    return {"O": rel_err(got, ref.to(got.device))}


def decode_paged_case() -> dict[str, float]:
    import epicute

    errors = {}
    for heads_q in (8, 6):  # GQA 4:1, and a padded 3:1 group
        k, v = (torch.randn(9, 64, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        table = torch.randperm(9, device="cuda")[:8].view(2, 4).to(torch.int32)
        used = torch.tensor([200, 256], device="cuda", dtype=torch.int32)
        q = torch.randn(2, 1, heads_q, 128, device="cuda", dtype=torch.bfloat16)
        kw = {"causal": True, "page_table": table, "seqused_k": used}
        got = epicute.attention(q, k, v, config={"num_splits": 3}, **kw)
        ref = epicute.attention(q, k, v, backend="reference", **kw)
        errors[f"O gqa{heads_q // 2}"] = rel_err(got, ref.to(got.device))
    return errors


def attention_fp8_case() -> dict[str, float]:
    """e4m3 prefill (ragged, causal, GQA), packed sequences and a paged fp8 cache's decode with split-KV."""
    import epicute
    from epicute.nn import PagedKVCache, attention_with_kvcache

    e4m3, errors = torch.float8_e4m3fn, {}
    q, k, v = (torch.randn(2, 300, h, 128, device="cuda").to(e4m3) for h in (8, 2, 2))
    got = epicute.attention(q, k, v, causal=True, q_descale=0.5, v_descale=2.0)
    ref = epicute.attention(q, k, v, causal=True, q_descale=0.5, v_descale=2.0, backend="reference")
    errors["O prefill"] = rel_err(got, ref.to(got.device))
    cu = torch.tensor([0, 77, 300, 301], device="cuda", dtype=torch.int32)
    qp, kp, vp = (t.view(-1, t.size(2), 128)[:301] for t in (q, k, v))
    kw = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "causal": True}
    got = epicute.attention(qp, kp, vp, **kw)
    errors["O packed"] = rel_err(got, epicute.attention(qp, kp, vp, backend="reference", **kw).to(got.device))
    cache = PagedKVCache(2, 256, 2, 128, page_size=64, device="cuda", dtype=e4m3, k_scale=0.05, v_scale=0.05)
    cache.append(*(torch.randn(2, 200, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)))
    q1 = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    got = attention_with_kvcache(q1, cache, config={"num_splits": 3})
    with epicute.use_backend("reference"):
        ref = attention_with_kvcache(q1, cache)
    errors["O paged decode"] = rel_err(got, ref.to(got.device))
    return errors


def backward_case(heads: int | None = None, head_dim: int = 128) -> dict[str, float]:
    """``heads``: query heads per CTA forced (the group of 4 split over CTAs, dK and dV reduce-added in fp32: the
    planner does so only at long causal sequences, too slow for the sanitizer)."""
    import epicute
    from epicute.attention import backward_plan

    if heads is not None:
        backward_plan.heads_per_cta = lambda *args: heads

    q = torch.randn(2, 300, 8, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 257, 2, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))  # fmt: skip
    from epicute.attention.api import reference_attention
    from epicute.attention.validate import check_attention_args

    do = torch.randn_like(q)
    got = torch.autograd.grad(epicute.attention(q, k, v, causal=True), (q, k, v), do)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    call = dataclasses.replace(check_attention_args(q, k, v, causal=True, softmax_scale=None),
                               q=leaves[0], k=leaves[1], v=leaves[2])  # fmt: skip
    out = reference_attention(call, out_dtype=torch.float32, device="cuda")[0]["D"]
    ref = torch.autograd.grad(out, leaves, do.float())
    return {name: rel_err(g, r.to(g.device)) for name, g, r in zip(("dq", "dk", "dv"), got, ref)}


def _float64_grads(fn, tensors: tuple, upstream: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().double().requires_grad_() for t in tensors]
    return list(torch.autograd.grad(fn(*leaves), leaves, upstream.double()))


def linear_backward_case() -> dict[str, float]:
    from epicute import ops
    from epicute.nn import functional as EF

    # K >= 256: the forward saves the pre-activation and the backward runs the K = 0 gradient pass.
    m, n, k = 257, 392, 320
    x, w = torch.randn(m, k, device="cuda") / k**0.5, torch.randn(n, k, device="cuda")
    b, r = torch.randn(n, device="cuda"), torch.randn(m, n, device="cuda")
    tensors = tuple(t.bfloat16().requires_grad_() for t in (x, w, b, r))
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    y = EF.linear(*tensors[:3], epilogue=lambda acc, residual: ops.gelu(acc) + residual, residual=tensors[3])
    got = torch.autograd.grad(y, tensors, dy)
    ref = _float64_grads(lambda x, w, b, r: torch.nn.functional.gelu(x @ w.t() + b) + r, tensors, dy)
    return {name: rel_err(g, r) for name, g, r in zip(("dx", "dw", "db", "dresidual"), got, ref)}


def moe_backward_case(fp8: bool = False) -> dict[str, float]:
    from epicute import interleave_gate_up
    from epicute.nn import fp8_moe_experts
    from epicute.nn import functional as EF

    tokens, hidden, inter, experts, top_k = 67, 128, 192, 4, 2
    x = torch.randn(tokens, hidden, device="cuda")
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda") / hidden**0.5
    down = torch.randn(experts, hidden, inter, device="cuda") / inter**0.5
    index = torch.rand(tokens, experts, device="cuda").argsort(-1)[:, :top_k]
    weights = torch.rand(tokens, top_k, device="cuda").softmax(-1)
    tensors = tuple(t.bfloat16().requires_grad_() for t in (x, gate_up, down, weights))
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    if fp8:  # the interleaved weight fp8 experts train, built differentiably from [gate; up]
        gate_up_i = interleave_gate_up(*tensors[1].chunk(2, dim=-2))
        y = fp8_moe_experts(tensors[0], gate_up_i, tensors[2], index, tensors[3])
    else:
        y = EF.moe_experts(tensors[0], tensors[1], tensors[2], index, tensors[3])
    got = torch.autograd.grad(y, tensors, dy)

    def reference(x, gate_up, down, weights):
        out = torch.zeros_like(x)
        for slot in range(top_k):
            e = index[:, slot]
            gate, up = (gate_up[e] @ x.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * up
            out = out + weights[:, slot, None] * (down[e] @ h.unsqueeze(-1)).squeeze(-1)
        return out

    ref = _float64_grads(reference, tensors, dy)
    return {name: rel_err(g, r) for name, g, r in zip(("dx", "dgate_up", "ddown", "dweights"), got, ref)}


SPECIAL_CASES = {
    "attention": attention_case, "fp8_quantize": fp8_quantize_case, "grouped": grouped_case,
    "attention_gqa": attention_gqa_case, "decode_paged": decode_paged_case, "backward": backward_case,
    "linear_backward": linear_backward_case, "moe_backward": moe_backward_case, "quantize": quantize_case,
    "paired": paired_case, "attention_fp8": attention_fp8_case, "moe_fp8_backward": lambda: moe_backward_case(fp8=True),
    "backward_head_split": lambda: backward_case(heads=1),
    "backward_head_split_d256": lambda: backward_case(heads=1, head_dim=256),
    "backward_head_split_ragged": lambda: backward_case(heads=3),
}  # fmt: skip


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        print(f"usage: {sys.argv[0]} {'|'.join(CASES)}")
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    name = sys.argv[1]
    torch.manual_seed(0)
    errors = SPECIAL_CASES[name]() if name in SPECIAL_CASES else gemm_case(name)
    torch.cuda.synchronize()
    tolerance = CASE_TOLERANCE.get(name, TOLERANCE)
    ok = all(err <= tolerance for err in errors.values())  # False for NaN too
    listed = ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
    print(f"{'PASS' if ok else 'FAIL'} {name}: rel err {listed}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
