"""GPU correctness of the grouped GEMM against a float32 reference of the same math, group by group.

Group sizes cover 0, 1, odd, tile multiples +- 1, one group, skewed routing and more groups than a
warp scans at once (G > 32); outputs are NaN-poisoned so rows a group's store misses show, and rows
past the last group (when ``out`` is given) must keep their poison.
"""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute import ops
from epicute.epilogue.gated import split_gate_up
from tests.conftest import rel_err
from tests.grouped.test_grouped import fp8_variable_k_operands, reference_fp8, reference_fp8_variable_k

pytestmark = pytest.mark.gpu

BF16_TOL = 1e-2  # bf16 output rounding of fp32 accumulations (~2^-9 relative per element)
# fp8 WGMMA sums each 128-wide k-tile in a reduced-precision accumulator before the fp32 promotion: an fp32 D
# of the dense blockwise GEMM measured 1.3e-4 at K = 16384 (bench/NOTES.md, "fp8 blockwise: promotion").
FP8_FP32_TOL = 1e-3


def offsets_of(sizes) -> torch.Tensor:
    return torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0).to(torch.int32).cuda()


def reference(a, b, offsets) -> torch.Tensor:
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    return torch.cat([a[s:e].double() @ b[g].double() for g, (s, e) in enumerate(zip(starts, ends))])


def weights(groups, n, k, major, dtype=torch.bfloat16):
    """B (G, K, N): row-major, or the transpose of a row-major (G, N, K) weight."""
    if major == "k":
        return torch.randn(groups, n, k, device="cuda", dtype=dtype).transpose(-2, -1)
    return torch.randn(groups, k, n, device="cuda", dtype=dtype)


SIZES = {
    "mixed": [0, 1, 37, 128, 129, 255, 3],
    "one_group": [301],
    "empty_ends": [0, 64, 0, 0, 190, 0],
    "many_groups": [int(x) for x in torch.randint(0, 70, (45,), generator=torch.Generator().manual_seed(1))],
    "skewed": [2000, 300, 41, 7, 1, 1, 0, 2],
}


@pytest.mark.parametrize("name", list(SIZES))
@pytest.mark.parametrize("b_major", ["k", "n"])
def test_grouped_matches_reference(name, b_major):
    sizes = SIZES[name]
    k, n = 200, 264
    offsets = offsets_of(sizes)
    total = int(offsets[-1])
    a = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
    b = weights(len(sizes), n, k, b_major)
    out = torch.full((total, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    d = epicute.grouped_gemm(a, b, offsets, out=out)
    assert d.data_ptr() == out.data_ptr()
    assert rel_err(d, reference(a, b, offsets)) < BF16_TOL


PAIRED = {"cluster_m": 2, "cluster_n": 1, "pair_tiles": True}


@pytest.mark.parametrize("name", ["mixed", "many_groups", "skewed", "odd_row_tiles"])
@pytest.mark.parametrize("tile_n", [128, 64])
def test_paired_tiles_match_reference(name, tile_n):
    """Paired clusters: groups of 1, 2 (pairs along M) and odd numbers of row tiles (the last one pairs along N),
    N of 3 column tiles at 128 (the last N pair's second CTA is past N: it must store nothing) or 6 at 64;
    D NaN-poisoned, and rows past the last group must keep their poison."""
    sizes = {**SIZES, "odd_row_tiles": [129, 1, 385, 256, 0, 640]}[name]
    k, n = 200, 376
    offsets = offsets_of(sizes)
    total = int(offsets[-1])
    a = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
    b = weights(len(sizes), n, k, "k")
    out = torch.full((total + 64, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    d = epicute.grouped_gemm(a, b, offsets, out=out[:total], config={**PAIRED, "tile_n": tile_n})
    assert rel_err(d, reference(a, b, offsets)) < BF16_TOL
    assert torch.isnan(out[total:]).all()


def test_grouped_fp16_and_fp32_out():
    sizes = [5, 0, 130, 77]
    offsets = offsets_of(sizes)
    total, k, n = int(offsets[-1]), 96, 136
    a = torch.randn(total, k, device="cuda", dtype=torch.float16)
    b = weights(len(sizes), n, k, "n", torch.float16)
    d = epicute.grouped_gemm(a, b, offsets, out_dtype=torch.float32)
    assert d.dtype == torch.float32 and d.shape == (total, n)
    assert rel_err(d, reference(a, b, offsets)) < 1e-5  # fp32 D: exact fp16 products, fp32 sums
    d16 = epicute.grouped_gemm(a, b, offsets)
    assert d16.dtype == torch.float16 and rel_err(d16, reference(a, b, offsets)) < 2e-3


def test_rows_past_the_last_group_are_not_written():
    offsets = offsets_of([10, 20])  # a has 50 rows; rows 30.. belong to no group
    a = torch.randn(50, 64, device="cuda", dtype=torch.bfloat16)
    b = weights(2, 64, 64, "k")
    out = torch.full((50, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    epicute.grouped_gemm(a, b, offsets, out=out)
    assert torch.isnan(out[30:]).all()
    assert rel_err(out[:30], reference(a[:30], b, offsets)) < BF16_TOL


def test_decreasing_offsets_on_the_gpu_stay_inside_out():
    """Unchecked malformed offsets (on the GPU) never write outside ``out`` (the guard rows stay NaN)."""
    guard = torch.full((3 * 64, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = guard[64:128]
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    b = weights(3, 64, 64, "k")
    bad = torch.tensor([50, 10, 1000], dtype=torch.int32, device="cuda")
    epicute.grouped_gemm(a, b, bad, out=out)
    assert torch.isnan(guard[:64]).all() and torch.isnan(guard[128:]).all()


@pytest.mark.parametrize("config", [{"persistent": False}, {"schedule": "pingpong", "tile_n": 128}, {"tile_n": 64},
                                    {**PAIRED, "schedule": "pingpong", "tile_n": 64}])  # fmt: skip
def test_grouped_configs(config):
    sizes = [130, 1, 0, 257, 64]
    offsets = offsets_of(sizes)
    total, k, n = int(offsets[-1]), 320, 200
    a = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
    b = weights(len(sizes), n, k, "k")
    d = epicute.grouped_gemm(a, b, offsets, config=config)
    assert rel_err(d, reference(a, b, offsets)) < BF16_TOL


def test_grouped_epilogue_operand_kinds_and_aux_output():
    sizes = [33, 0, 140, 1, 90]
    groups = len(sizes)
    offsets = offsets_of(sizes)
    total, k, n = int(offsets[-1]), 128, 192
    a = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
    b = weights(groups, n, k, "k")
    bias = torch.randn(groups, n, device="cuda", dtype=torch.bfloat16)  # per expert
    shared = torch.randn(n, device="cuda", dtype=torch.bfloat16)  # all experts
    score = torch.rand(total, device="cuda", dtype=torch.float32)  # router weight per token
    residual = torch.randn(total, n, device="cuda", dtype=torch.bfloat16)

    def epi(acc, bias, shared, score, residual, alpha):
        pre = alpha * acc + bias + shared
        return {"D": ops.silu(pre) * score + residual, "pre": pre}

    args = dict(bias=bias, shared=shared, score=epicute.ColVector(score), residual=residual, alpha=0.5)
    got = epicute.grouped_gemm(a, b, offsets, epilogue=epi, out_dtypes={"pre": torch.float32}, **args)
    acc = reference(a, b, offsets).float()
    group_of_row = torch.repeat_interleave(torch.arange(groups, device="cuda"), torch.tensor(sizes, device="cuda"))
    pre = 0.5 * acc + bias.float()[group_of_row] + shared.float()
    want = torch.nn.functional.silu(pre) * score[:, None] + residual.float()
    assert got["pre"].dtype == torch.float32
    assert rel_err(got["pre"], pre) < 1e-5
    assert rel_err(got["D"], want) < BF16_TOL
    ref = epicute.grouped_gemm(a.cpu(), b.cpu(), offsets.cpu(), epilogue=epi, backend="reference",
                               out_dtypes={"pre": torch.float32},
                               **{**args, "score": epicute.ColVector(score.cpu()), "bias": bias.cpu(),
                                  "shared": shared.cpu(), "residual": residual.cpu()})  # fmt: skip
    assert rel_err(got["D"].cpu(), ref["D"]) < BF16_TOL


def test_grouped_k_zero_and_no_rows():
    offsets = offsets_of([3, 0, 5])
    a = torch.randn(8, 0, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(3, 0, 64, device="cuda", dtype=torch.bfloat16)
    assert (epicute.grouped_gemm(a, b, offsets) == 0).all()
    empty = epicute.grouped_gemm(torch.randn(0, 64, device="cuda", dtype=torch.bfloat16), weights(2, 64, 64, "k"),
                                 offsets_of([0, 0]))  # fmt: skip
    assert empty.shape == (0, 64)


def test_grouped_matches_torch_grouped_mm_layout():
    """The same arguments as torch._grouped_mm (offs = group ends), fresh random routing."""
    groups, k, n = 8, 256, 512
    sizes = torch.multinomial(torch.ones(groups), 3000, replacement=True).bincount(minlength=groups).tolist()
    offsets = offsets_of(sizes)
    a = torch.randn(3000, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(groups, n, k, device="cuda", dtype=torch.bfloat16)
    d = epicute.grouped_gemm(a, w.transpose(-2, -1), offsets)
    assert rel_err(d, reference(a, w.transpose(-2, -1), offsets)) < BF16_TOL


def test_grouped_cuda_graph_capture():
    sizes = [100, 0, 31]
    offsets = offsets_of(sizes)
    a = torch.randn(131, 64, device="cuda", dtype=torch.bfloat16)
    b = weights(3, 128, 64, "k")
    out = torch.empty(131, 128, device="cuda", dtype=torch.bfloat16)
    epicute.grouped_gemm(a, b, offsets, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        epicute.grouped_gemm(a, b, offsets, out=out)
    offsets.copy_(offsets_of([31, 100, 0]))  # new routing, same graph
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference(a, b, offsets)) < BF16_TOL


@pytest.mark.parametrize("name", ["mixed", "many_groups", "skewed"])
@pytest.mark.parametrize("b_major", ["k", "n"])
def test_gated_swiglu_with_router_weights(name, b_major):
    """Each expert's gate and up projections interleaved in one weight; the epilogue gets both halves of
    each output column and the token's router weight. Checked against float64 math on the separate
    projections, with D NaN-poisoned."""
    sizes = SIZES[name]
    k, n = 136, 200
    offsets = offsets_of(sizes)
    total = int(offsets[-1])
    a = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
    w_gate = torch.randn(len(sizes), n, k, device="cuda", dtype=torch.bfloat16)
    w_up = torch.randn(len(sizes), n, k, device="cuda", dtype=torch.bfloat16)
    w = epicute.interleave_gate_up(w_gate, w_up)
    b = w.transpose(-2, -1) if b_major == "k" else w.transpose(-2, -1).contiguous()
    score = torch.rand(total, 1, device="cuda")
    bias = torch.randn(len(sizes), n, device="cuda", dtype=torch.bfloat16)
    out = torch.full((total, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    d = epicute.grouped_gemm(a, b, offsets, out=out, gated=True, score=score, bias=bias,
                             epilogue=lambda gate, up, score, bias: ops.silu(gate + bias) * up * score)  # fmt: skip
    assert d.data_ptr() == out.data_ptr()
    gate = reference(a, w_gate.transpose(-2, -1), offsets)
    up = reference(a, w_up.transpose(-2, -1), offsets)
    group = torch.repeat_interleave(torch.arange(len(sizes), device="cuda"), torch.tensor(sizes, device="cuda"))
    want = torch.nn.functional.silu(gate + bias.double()[group]) * up * score.double()
    assert rel_err(d, want) < BF16_TOL


RAGGED_K_SIZES = {
    "mixed": [0, 1, 37, 64, 65, 255, 3],
    "one_group": [301],
    "empty_ends": [0, 64, 0, 0, 190, 0],
    "many_groups": SIZES["many_groups"],
}


def reference_ragged_k(x, dy, offsets) -> torch.Tensor:
    """dW[g] = x[rows of g].T @ dy[rows of g] in float64."""
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    return torch.stack([x[s:e].double().t() @ dy[s:e].double() for s, e in zip(starts, ends)])


RAGGED_K_CONFIGS = {
    "planned": None,
    "cluster_2x1": {"cluster_m": 2, "cluster_n": 1},
    "cluster_1x2": {"cluster_m": 1, "cluster_n": 2, "tile_n": 128},
    "persistent_1x1": {"cluster_m": 1, "cluster_n": 1, "persistent": True},
    # Ping-pong: each warpgroup steps its ring over the other's tiles by their groups' k-tiles.
    "pingpong_2x1": {"schedule": "pingpong", "tile_n": 192, "cluster_m": 2, "cluster_n": 1},
    "pingpong_1x1": {"schedule": "pingpong", "tile_n": 64, "cluster_m": 1, "cluster_n": 1},
}


@pytest.mark.parametrize("name", list(RAGGED_K_SIZES))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", list(RAGGED_K_CONFIGS))
def test_variable_k_weight_gradient(name, out_dtype, config):
    """Weight gradients of an MoE layer: each group's K rows (tokens) reduce into its own (M, N); groups of
    0 rows give zeros. D is NaN-poisoned."""
    sizes = RAGGED_K_SIZES[name]
    offsets = offsets_of(sizes)
    total, m, n = int(offsets[-1]), 200, 264
    x = torch.randn(total, m, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(total, n, device="cuda", dtype=torch.bfloat16)
    out = torch.full((len(sizes), m, n), float("nan"), device="cuda", dtype=out_dtype)
    dw = epicute.grouped_gemm(x.t(), dy, offsets, out=out, config=RAGGED_K_CONFIGS[config])
    assert dw.data_ptr() == out.data_ptr()
    want = reference_ragged_k(x, dy, offsets)
    tol = 1e-5 if out_dtype == torch.float32 else BF16_TOL
    assert rel_err(dw, want) < tol
    for g, size in enumerate(sizes):
        if size == 0:
            assert not dw[g].any()


def test_variable_k_with_an_epilogue():
    """dW_g * lr_scale + per-expert row, accumulated into an existing gradient tile (a tile operand)."""
    sizes = [130, 0, 7, 400]
    offsets = offsets_of(sizes)
    total, m, n = int(offsets[-1]), 136, 520
    x = torch.randn(total, m, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(total, n, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(len(sizes), m, n, device="cuda", dtype=torch.float32)
    bias = torch.randn(len(sizes), n, device="cuda", dtype=torch.float32)
    dw = epicute.grouped_gemm(
        x.t(), dy, offsets, out_dtype=torch.float32, config={"tile_n": 128}, grad=grad, bias=bias, scale=0.5,
        epilogue=lambda acc, grad, bias, scale: grad + scale * acc + bias,
    )  # fmt: skip
    want = grad.double() + 0.5 * reference_ragged_k(x, dy, offsets) + bias.double()[:, None, :]
    assert dw.shape == (len(sizes), m, n) and rel_err(dw, want) < 1e-5


@pytest.mark.parametrize("config", ["planned", "cluster_2x1", "pingpong_2x1"])
def test_variable_k_never_reads_the_next_groups_rows(config):
    """A group's last k-tile box reaches into the next group's rows; NaN there (both operands) must not reach
    this group's sum. Groups 0 and 2 end mid-tile before a poisoned group 1."""
    sizes = [37, 69, 100, 5]
    offsets = offsets_of(sizes)
    total, m, n = int(offsets[-1]), 72, 136
    x = torch.randn(total, m, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(total, n, device="cuda", dtype=torch.bfloat16)
    poisoned = slice(sizes[0], sizes[0] + sizes[1])
    x[poisoned], dy[poisoned] = float("nan"), float("inf")
    x[sizes[0] + sizes[1] + sizes[2] :] = float("nan")  # group 3 poisons group 2's tail
    dw = epicute.grouped_gemm(x.t(), dy, offsets, out_dtype=torch.float32, config=RAGGED_K_CONFIGS[config])
    want = reference_ragged_k(x, dy, offsets)
    for g in (0, 2):
        assert torch.isfinite(dw[g]).all() and rel_err(dw[g], want[g]) < 1e-5


def test_variable_k_at_mixture_of_experts_size():
    """8 experts' weight gradients over 16384 Zipf-routed tokens (the bench's wgrad8 at a quarter of N), every
    group ending mid-tile, the operands allocated after a large buffer so they sit at high addresses."""
    ballast = torch.empty(1 << 30, dtype=torch.int8, device="cuda")
    sizes = [5243, 3001, 2617, 1777, 1503, 1100, 777, 366]
    offsets = offsets_of(sizes)
    total, m, n = int(offsets[-1]), 4096, 3584
    x = torch.randn(total, m, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(total, n, device="cuda", dtype=torch.bfloat16)
    dw = epicute.grouped_gemm(x.t(), dy, offsets)
    torch.cuda.synchronize()
    del ballast
    ends = offsets.tolist()
    for g, (s, e) in enumerate(zip([0, *ends[:-1]], ends)):
        want = x[s:e].float().t() @ dy[s:e].float()
        assert rel_err(dw[g], want) < BF16_TOL


# ---- fp8 inputs with blockwise scales (DeepSeek-V3's recipe, per group)

FP8_CONFIGS = {
    "planned": None,
    "cluster_2x1": {"cluster_m": 2, "cluster_n": 1},
    "cluster_1x2": {"cluster_m": 1, "cluster_n": 2},
    "paired": {"cluster_m": 2, "cluster_n": 1, "pair_tiles": True},
    "persistent_128": {"persistent": True, "tile_n": 128},
    "tile_192": {"tile_n": 192},  # 64-column chunks promoted with their own B blocks, one partial
}


def fp8_inputs(sizes, k, n, b_dtype=torch.float8_e4m3fn):
    """fp8 tokens and per-group weights (b = w.transpose(-2, -1)), blockwise scales in torch's layouts (A's
    M-major), offsets."""
    offsets = offsets_of(sizes)
    total, groups, kb, nb = int(offsets[-1]), len(sizes), -(-k // 128), -(-n // 128)
    x = (torch.randn(total, k, device="cuda") * 2).to(torch.float8_e4m3fn)
    w = (torch.randn(groups, n, k, device="cuda") * 2).to(b_dtype)
    sa = torch.rand(kb, total, device="cuda").t() + 0.5
    sb = torch.rand(groups, nb, kb, device="cuda") + 0.5
    return x, w.transpose(-2, -1), offsets, sa, sb


@pytest.mark.parametrize("name", ["mixed", "one_group", "many_groups", "skewed"])
@pytest.mark.parametrize("config", list(FP8_CONFIGS))
def test_fp8_blockwise_matches_reference(name, config):
    """K 400 (a partial last scale block), N 200 (a partial B block), NaN-poisoned D: every group's rows read
    their own A scales and their group's B scales."""
    sizes = SIZES[name]
    x, b, offsets, sa, sb = fp8_inputs(sizes, k=400, n=200)
    out = torch.full((x.shape[0], 200), float("nan"), device="cuda", dtype=torch.bfloat16)
    d = epicute.grouped_gemm(x, b, offsets, a_scale=sa, b_scale=sb, out=out, config=FP8_CONFIGS[config])
    assert d.data_ptr() == out.data_ptr()
    assert rel_err(d, reference_fp8(x, b, offsets, sa, sb)) < BF16_TOL


def test_fp8_blockwise_e5m2_weights_with_an_epilogue():
    """e4m3 tokens x e5m2 weights, fp32 D, per-expert bias and per-token router weights after the promotion."""
    sizes = [130, 0, 7, 400, 1]
    x, b, offsets, sa, sb = fp8_inputs(sizes, k=768, n=392, b_dtype=torch.float8_e5m2)
    bias = torch.randn(len(sizes), 392, device="cuda")
    score = torch.rand(x.shape[0], 1, device="cuda")
    d = epicute.grouped_gemm(
        x, b, offsets, a_scale=sa, b_scale=sb, out_dtype=torch.float32, bias=bias, score=score,
        epilogue=lambda acc, bias, score: (acc + bias) * score,
    )  # fmt: skip
    group = torch.repeat_interleave(torch.arange(len(sizes), device="cuda"), torch.tensor(sizes, device="cuda"))
    want = (reference_fp8(x, b, offsets, sa, sb) + bias.double()[group]) * score.double()
    assert d.dtype == torch.float32 and rel_err(d, want) < FP8_FP32_TOL


# ---- gathered rows (a_index)

GATHER_CONFIGS = {
    "planned": {},
    "cluster_2x1": {"cluster_m": 2, "cluster_n": 1},
    "pingpong": {"schedule": "pingpong", "tile_n": 128},
    "tile_n64_one_tile_per_cta": {"tile_n": 64, "persistent": False},
}


def routed_tokens(tokens: int, sizes: list[int]) -> torch.Tensor:
    """Each grouped row's token: any token, repeats and all (top-k routing reads a token once per expert)."""
    return torch.randint(0, tokens, (sum(sizes),), device="cuda", dtype=torch.int32)


@pytest.mark.parametrize("name", ["mixed", "empty_ends", "many_groups", "skewed"])
@pytest.mark.parametrize("config", list(GATHER_CONFIGS))
def test_gathered_rows_match_the_gathered_reference(name, config):
    """Row r reads x[a_index[r]]; K = 200 is not a multiple of the 64-wide k-tile, and x's rows are padded with NaN
    past K (the last k-tile's chunks past K must be zero-filled, never read), and D is NaN-poisoned."""
    sizes = SIZES[name]
    k, n = 200, 264
    offsets = offsets_of(sizes)
    padded = torch.full((1000, k + 56), float("nan"), device="cuda", dtype=torch.bfloat16)
    padded[:, :k] = torch.randn(1000, k, device="cuda", dtype=torch.bfloat16)
    x = padded[:, :k]
    index = routed_tokens(1000, sizes)
    b = weights(len(sizes), n, k, "k")
    out = torch.full((index.numel(), n), float("nan"), device="cuda", dtype=torch.bfloat16)
    d = epicute.grouped_gemm(x, b, offsets, a_index=index, out=out, config=GATHER_CONFIGS[config])
    assert d.data_ptr() == out.data_ptr()
    assert rel_err(d, reference(x[index.long()], b, offsets)) < BF16_TOL


def test_gathered_rows_with_int64_index_fp16_and_a_gated_epilogue():
    """Top-2 routing as a mixture-of-experts layer has it: argsort of the experts, int64, each token twice;
    SwiGLU with the router weight per grouped row. x's last rows hold inf, which no index reaches."""
    tokens, experts, k, n = 777, 6, 136, 200
    x = torch.randn(tokens + 5, k, device="cuda", dtype=torch.float16)
    x[tokens:] = float("inf")
    chosen = torch.randint(0, experts, (tokens, 2), device="cuda")
    order = torch.argsort(chosen.flatten(), stable=True)
    index = order // 2  # int64
    sizes = torch.bincount(chosen.flatten(), minlength=experts).tolist()
    offsets = offsets_of(sizes)
    w_gate = torch.randn(experts, n, k, device="cuda", dtype=torch.float16)
    w_up = torch.randn(experts, n, k, device="cuda", dtype=torch.float16)
    w = epicute.interleave_gate_up(w_gate, w_up).transpose(-2, -1)
    score = torch.rand(index.numel(), 1, device="cuda")
    d = epicute.grouped_gemm(x, w, offsets, a_index=index, gated=True, score=score,
                             epilogue=lambda gate, up, score: ops.silu(gate) * up * score)  # fmt: skip
    rows = x[index]
    gate = reference(rows, w_gate.transpose(-2, -1), offsets)
    up = reference(rows, w_up.transpose(-2, -1), offsets)
    assert rel_err(d, torch.nn.functional.silu(gate) * up * score.double()) < BF16_TOL


def test_gathered_rows_at_mixture_of_experts_size():
    """8 experts, 4096 tokens routed top-2 (8192 grouped rows) at K 4096, N 2048: every tile full-size, the
    index spread over all of x."""
    tokens, experts, k, n = 4096, 8, 4096, 2048
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    chosen = torch.randint(0, experts, (tokens, 2), device="cuda")
    index = torch.argsort(chosen.flatten(), stable=True) // 2
    offsets = offsets_of(torch.bincount(chosen.flatten(), minlength=experts).tolist())
    b = weights(experts, n, k, "k")
    d = epicute.grouped_gemm(x, b, offsets, a_index=index)
    assert rel_err(d, torch._grouped_mm(x[index], b, offs=offsets).double()) < BF16_TOL


def test_gathered_out_of_range_index_stays_inside_x():
    """An unchecked index outside x reads a clamped row, never outside x (no fault); checked, it is an error."""
    x = torch.randn(50, 64, device="cuda", dtype=torch.bfloat16)
    b = weights(2, 128, 64, "k")
    offsets = offsets_of([3, 4])
    index = torch.tensor([0, 1, 2, 49, 10**6, -5, 3], device="cuda", dtype=torch.int32)
    d = epicute.grouped_gemm(x, b, offsets, a_index=index)
    clamped = index.clamp(0, 49).long()
    assert rel_err(d, reference(x[clamped], b, offsets)) < BF16_TOL
    with pytest.raises(epicute.EpicuteError, match="a_index"):
        epicute.grouped_gemm(x, b, offsets, a_index=index, check_offsets=True)


def test_torch_compile_runs_gated_gathered_grouped_gemms_like_eager():
    """An MoE up-projection (gathered tokens, interleaved gate/up experts, SwiGLU with router weights) and its
    weight gradient under torch.compile(fullgraph=True): one epicute op each, results as eager."""
    torch._dynamo.reset()
    tokens, experts, k, n = 333, 4, 136, 200
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    chosen = torch.randint(0, experts, (tokens, 2), device="cuda")
    index = torch.argsort(chosen.flatten(), stable=True) // 2
    offsets = offsets_of(torch.bincount(chosen.flatten(), minlength=experts).tolist())
    w_gate, w_up = (torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w13 = epicute.interleave_gate_up(w_gate, w_up)
    score = torch.rand(index.numel(), 1, device="cuda")

    def layer(x, w13, offsets, index, score):
        h = epicute.grouped_gemm(x, w13.transpose(-2, -1), offsets, a_index=index, gated=True, score=score,
                                 epilogue=lambda gate, up, score: ops.silu(gate) * up * score)  # fmt: skip
        return h, epicute.grouped_gemm(x[index].t(), h, offsets)

    compiled = torch.compile(layer, fullgraph=True)
    (h, dw), (h_eager, dw_eager) = compiled(x, w13, offsets, index, score), layer(x, w13, offsets, index, score)
    assert h.shape == (index.numel(), n) and dw.shape == (experts, k, n)
    assert rel_err(h, h_eager.double()) < 1e-6 and rel_err(dw, dw_eager.double()) < 1e-6


def test_torch_compile_runs_a_dense_gated_gemm_like_eager():
    torch._dynamo.reset()
    x = torch.randn(129, 136, device="cuda", dtype=torch.bfloat16)
    w13 = epicute.interleave_gate_up(torch.randn(200, 136, device="cuda", dtype=torch.bfloat16),
                                     torch.randn(200, 136, device="cuda", dtype=torch.bfloat16))  # fmt: skip

    def mlp(x, w13):
        return epicute.gemm(x, w13.t(), gated=True, epilogue=lambda gate, up: ops.silu(gate) * up)

    got, want = torch.compile(mlp, fullgraph=True)(x, w13), mlp(x, w13)
    assert got.shape == (129, 200) and rel_err(got, want.double()) < 1e-6


# ---- reductions in grouped epilogues


def reductions(acc, bias):
    y = acc + bias
    return {"D": y, "rows": ops.row_sum(y), "rowmax": ops.row_max(y), "cols": ops.col_sum(y), "colmax": ops.col_max(y),
            "peak": ops.amax(y)}  # fmt: skip


def check_reductions(got, y, offsets):
    """Row reductions per row, column and whole-tile ones per group (an empty group: the identity)."""
    assert rel_err(got["rows"], y.sum(1)) < 1e-5 and rel_err(got["rowmax"], y.amax(1)) < 1e-6
    ends = offsets.tolist()
    for g, (s, e) in enumerate(zip([0, *ends[:-1]], ends)):
        if e == s:
            assert (got["cols"][g] == 0).all() and (got["colmax"][g] == -float("inf")).all() and got["peak"][g] == 0
            continue
        assert rel_err(got["cols"][g], y[s:e].sum(0)) < 1e-5
        assert rel_err(got["colmax"][g], y[s:e].amax(0)) < 1e-6
        assert rel_err(got["peak"][g], y[s:e].abs().amax()) < 1e-6


@pytest.mark.parametrize("name", ["mixed", "empty_ends", "many_groups", "skewed"])
@pytest.mark.parametrize("config", [{}, {"cluster_m": 2, "cluster_n": 1}, {"schedule": "pingpong", "tile_n": 128},
                                    {"cluster_m": 1, "cluster_n": 2, "tile_n": 64},
                                    {**PAIRED, "tile_n": 128}])  # fmt: skip
def test_grouped_reductions_per_row_and_per_group(name, config):
    """Groups that share 16-row bands (sizes 1, 3, 37...), empty groups, clusters that pad groups: each tile row has
    its own partial slots, reduced per group on the GPU. D is fp32 and NaN-poisoned."""
    sizes = SIZES[name]
    k, n = 200, 264
    offsets = offsets_of(sizes)
    total = int(offsets[-1])
    a = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
    b = weights(len(sizes), n, k, "k")
    bias = torch.randn(len(sizes), n, device="cuda", dtype=torch.bfloat16)
    out = torch.full((total, n), float("nan"), device="cuda")
    got = epicute.grouped_gemm(a, b, offsets, epilogue=reductions, bias=bias, out=out, config=config)
    group = torch.repeat_interleave(torch.arange(len(sizes), device="cuda"), torch.tensor(sizes, device="cuda"))
    y = reference(a, b, offsets) + bias.double()[group]
    assert rel_err(got["D"], y) < 1e-5
    check_reductions(got, y, offsets)
    again = epicute.grouped_gemm(a, b, offsets, epilogue=reductions, bias=bias, out_dtype=torch.float32, config=config)
    for key in ("rows", "cols", "colmax", "peak"):  # a fixed combine order: bitwise the same
        assert torch.equal(got[key], again[key]), key


def test_grouped_reductions_with_gathered_rows_and_gated_experts():
    tokens, experts, k, n = 500, 5, 136, 200
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    chosen = torch.randint(0, experts, (tokens, 2), device="cuda")
    index = torch.argsort(chosen.flatten(), stable=True) // 2
    sizes = torch.bincount(chosen.flatten(), minlength=experts).tolist()
    offsets = offsets_of(sizes)
    w_gate, w_up = (torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w13 = epicute.interleave_gate_up(w_gate, w_up).transpose(-2, -1)
    bias = torch.randn(experts, n, device="cuda", dtype=torch.bfloat16)
    got = epicute.grouped_gemm(x, w13, offsets, a_index=index, gated=True, bias=bias, out_dtype=torch.float32,
                               epilogue=lambda gate, up, bias: reductions(ops.silu(gate) * up, bias))  # fmt: skip
    rows = x[index]
    group = torch.repeat_interleave(torch.arange(experts, device="cuda"), torch.tensor(sizes, device="cuda"))
    h = torch.nn.functional.silu(reference(rows, w_gate.transpose(-2, -1), offsets))
    y = h * reference(rows, w_up.transpose(-2, -1), offsets) + bias.double()[group]
    assert rel_err(got["D"], y) < 1e-5
    check_reductions(got, y, offsets)


def test_variable_k_reductions_are_the_batched_gemms():
    sizes = [70, 0, 129, 33]
    offsets = offsets_of(sizes)
    x = torch.randn(sum(sizes), 96, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(sum(sizes), 136, device="cuda", dtype=torch.bfloat16)
    epilogue = lambda acc: {"D": acc, "cols": ops.col_sum(acc), "peak": ops.amax(acc)}
    got = epicute.grouped_gemm(x.t(), dy, offsets, out_dtype=torch.float32, epilogue=epilogue)
    want = reference_ragged_k(x, dy, offsets)
    assert got["cols"].shape == (4, 136) and got["peak"].shape == ()
    assert rel_err(got["cols"], want.sum(1)) < 1e-5 and rel_err(got["peak"], want.abs().amax()) < 1e-6


@pytest.mark.parametrize("config", [{}, {"cluster_m": 2, "cluster_n": 1}, {"tile_n": 192}])
def test_gathered_fp8_rows_read_their_tokens_scales(config):
    """fp8 experts over gathered tokens: each grouped row reads x[index] and that token's 1x128 scales; fp32 D
    against float64 math on the dequantized values (K = 400: a partial last scale block)."""
    tokens, experts, k, n = 500, 5, 400, 264
    x = (torch.randn(tokens, k, device="cuda") * 2).to(torch.float8_e4m3fn)
    w = (torch.randn(experts, n, k, device="cuda") * 2).to(torch.float8_e4m3fn)
    sa = torch.rand(tokens, -(-k // 128), device="cuda") + 0.5
    sb = torch.rand(experts, -(-n // 128), -(-k // 128), device="cuda") + 0.5
    chosen = torch.randint(0, experts, (tokens, 2), device="cuda")
    index = torch.argsort(chosen.flatten(), stable=True) // 2
    offsets = offsets_of(torch.bincount(chosen.flatten(), minlength=experts).tolist())
    out = torch.full((index.numel(), n), float("nan"), device="cuda")
    d = epicute.grouped_gemm(x, w.transpose(-2, -1), offsets, a_index=index, a_scale=sa, b_scale=sb, out=out,
                             config=config)  # fmt: skip
    rows = index.cpu()
    want = reference_fp8(x.cpu()[rows], w.transpose(-2, -1).cpu(), offsets.cpu(), sa.cpu()[rows], sb.cpu())
    assert rel_err(d.cpu(), want) < FP8_FP32_TOL


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("name", ["mixed", "skewed"])
def test_a_paired_d_holds_d_up_in_its_odd_blocks(name, gated):
    """An epilogue returning D_up (an MoE backward's d gate and d up): the kernel stores both halves of each
    group's rows into one (total_M, 2N) D through the ragged view. D's memory is NaN before the call (the
    allocator hands back the poisoned block freed just before)."""
    sizes = SIZES[name]
    k, n = 136, 200
    offsets = offsets_of(sizes)
    total = int(offsets[-1])
    a = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(total, n, device="cuda", dtype=torch.bfloat16)
    if gated:
        w_gate, w_up = (torch.randn(len(sizes), n, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        b = epicute.interleave_gate_up(w_gate, w_up).transpose(-2, -1)
        gate, up = reference(a, w_gate.transpose(-2, -1), offsets), reference(a, w_up.transpose(-2, -1), offsets)
        want = (g.double() * up, g.double() * torch.sigmoid(gate))
        fn = lambda gate, up, g: {"D": g * up, "D_up": g * ops.sigmoid(gate)}
    else:
        b = weights(len(sizes), n, k, "k")
        acc = reference(a, b, offsets)
        want = (acc + g.double(), acc * g.double())
        fn = lambda acc, g: {"D": acc + g, "D_up": acc * g}
    torch.full((total, 2 * n), float("nan"), device="cuda", dtype=torch.bfloat16)  # freed at once: D reuses it
    d = epicute.grouped_gemm(a, b, offsets, gated=gated, g=g, epilogue=fn)
    assert d.shape == (total, 2 * n)
    d_half, up_half = split_gate_up(d.double())
    assert rel_err(d_half, want[0]) < BF16_TOL and rel_err(up_half, want[1]) < BF16_TOL


# ---- fp8 variable K: weight gradients over groups of 128-row blocks of K

FP8_VARIABLE_K_CONFIGS = {
    "planned": None,
    "cluster_1x2": {"cluster_m": 1, "cluster_n": 2},
    "persistent_2x1": {"cluster_m": 2, "cluster_n": 1, "persistent": True, "tile_n": 128},
    "tile_n_256": {"cluster_m": 1, "cluster_n": 1, "tile_n": 256},
}


@pytest.mark.parametrize("config", list(FP8_VARIABLE_K_CONFIGS))
def test_fp8_variable_k_weight_gradient(config):
    """dW[g] over each group's 128-row blocks of K (empty groups give zeros; K rows past the last group, NaN in
    both operands' values, are read by none); fp32 D NaN-poisoned; M and N not tile multiples."""
    sizes = [256, 0, 128, 1024, 0, 384]
    a, b, offsets, sa, sb = fp8_variable_k_operands(sizes, m=328, n=200, room=256)
    a[:, -200:] = float("nan")  # past the last group
    b[-200:] = float("nan")
    want = reference_fp8_variable_k(a, b, offsets, sa, sb)
    a, b, offsets, sa, sb = (t.cuda() for t in (a, b, offsets, sa, sb))
    out = torch.full((len(sizes), 328, 200), float("nan"), device="cuda")
    d = epicute.grouped_gemm(a, b, offsets, a_scale=sa, b_scale=sb, out=out, config=FP8_VARIABLE_K_CONFIGS[config])
    assert d.data_ptr() == out.data_ptr() and rel_err(d.cpu(), want) < FP8_FP32_TOL
    assert not d[1].any() and not d[4].any()


def test_fp8_variable_k_unaligned_groups_get_nan():
    """Offsets the host never read (on the GPU, unchecked) that split a 128-row block: that group's D is NaN, the
    aligned groups' are right."""
    a, b, offsets, sa, sb = fp8_variable_k_operands([256, 256, 128])
    want = reference_fp8_variable_k(a, b, offsets, sa, sb)
    bad = torch.tensor([256, 300, 640], dtype=torch.int32)  # group 1 ends, and group 2 starts, inside a block
    d = epicute.grouped_gemm(a.cuda(), b.cuda(), bad.cuda(), a_scale=sa.cuda(), b_scale=sb.cuda(),
                             out_dtype=torch.float32)  # fmt: skip
    assert d[1].isnan().all() and d[2].isnan().all() and rel_err(d[0].cpu(), want[0]) < FP8_FP32_TOL

