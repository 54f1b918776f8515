"""fp8 GEMMs on the GPU against a float32 reference of the dequantized math.

e4m3, e5m2 and the two mixed; tensorwise scales (a float, or a GPU tensor the kernel reads: a CUDA
graph replays the new value), rowwise scales, batched, composed with epilogues; odd M, N and K;
D NaN-poisoned through ``out=``. bf16 D: rel err <= 2e-2 (the issue's bound for fp8 inputs). With
tensorwise and rowwise scales the WGMMA's fp8 accumulation is not promoted to fp32 along K, so the
error grows with K; blockwise scales promote every 128-wide k-tile. The last test measures both at
K = 16384 against a bf16 GEMM of the same values and prints them.
"""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute import ops
from tests.conftest import rel_err

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TOL = 2e-2
#: (M, N, K): odd M, N a multiple of 8 (bf16 D rows), K a multiple of 16 (fp8 TMA rows)
SHAPES = [(1, 16, 16), (17, 48, 64), (129, 136, 272), (1000, 4104, 1040), (4097, 1000, 4096)]


@pytest.fixture(autouse=True)
def _exact_reference():
    torch.backends.cuda.matmul.allow_tf32 = False


def quantized(*shape, dtype=E4M3):
    """Values spread over the format's range (amax 64), as a quantizer leaves them."""
    return (torch.randn(*shape, device="cuda") * 16).clamp(-64, 64).to(dtype)


def reference(a, w, a_scale, b_scale):
    lead, m, n = a.shape[:-2], a.shape[-2], w.shape[-2]

    def factor(scale, shape):
        if isinstance(scale, float) or scale.numel() == 1:
            return scale if isinstance(scale, float) else scale.reshape(())
        return scale.reshape(*lead, *shape)

    return (a.float() @ w.float().transpose(-1, -2)) * factor(a_scale, (m, 1)) * factor(b_scale, (1, n))


def check(a, w, a_scale, b_scale, what=""):
    out = torch.full((*a.shape[:-1], w.shape[-2]), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = epicute.gemm(a, w.transpose(-1, -2), a_scale=a_scale, b_scale=b_scale, out=out)
    assert got.data_ptr() == out.data_ptr()
    err = rel_err(out, reference(a, w, a_scale, b_scale))
    assert err <= TOL, f"rel err {err:.2e} for {what} a{tuple(a.shape)} {a.dtype} x w{tuple(w.shape)} {w.dtype}"


@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E5M2), (E4M3, E5M2), (E5M2, E4M3)],
                         ids=["e4m3", "e5m2", "e4m3xe5m2", "e5m2xe4m3"])  # fmt: skip
def test_tensorwise_and_rowwise_match_the_dequantized_reference(dtypes):
    for m, n, k in SHAPES:
        a, w = quantized(m, k, dtype=dtypes[0]), quantized(n, k, dtype=dtypes[1])
        check(a, w, 1 / 256, 1 / 128, "tensorwise floats")
        check(a, w, torch.tensor(0.01, device="cuda"), torch.tensor([0.02], device="cuda"), "tensorwise tensors")
        sa = torch.rand(m, device="cuda") / 64 + 1e-3
        sb = torch.rand(1, n, device="cuda") / 64 + 1e-3
        check(a, w, sa, sb, "rowwise")
        check(a, w, sa[:, None], 0.5, "rowwise x tensorwise")


def test_batched():
    l, m, n, k = 3, 129, 264, 512
    a, w = quantized(l, m, k), quantized(l, n, k)
    check(a, w, torch.rand(l, m, device="cuda") / 64, torch.rand(l, n, device="cuda") / 64, "batched rowwise")
    check(a, w, 0.01, torch.tensor(0.01, device="cuda"), "batched tensorwise")


def test_scales_compose_with_epilogues():
    m, n, k = 1000, 1040, 1024  # N a multiple of 16: the fp8 aux tile's rows are 16-byte TMA rows
    a, w = quantized(m, k), quantized(n, k, dtype=E5M2)
    sa, sb = torch.rand(m, device="cuda") / 64, torch.rand(n, device="cuda") / 64
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)

    def epi(acc, bias):
        return {"D": ops.gelu(acc + bias), "pre": acc, "amax": ops.amax(acc), "q": ops.quantize(acc, 0.5)}

    got = epicute.gemm(a, w.t(), a_scale=sa, b_scale=sb, epilogue=epi, bias=bias, out_dtypes={"pre": torch.float32})
    acc = reference(a, w, sa, sb)
    assert rel_err(got["pre"], acc) <= TOL
    assert rel_err(got["D"], torch.nn.functional.gelu(acc + bias.float())) <= TOL
    assert rel_err(got["amax"], acc.abs().amax()) <= TOL
    assert got["q"].dtype == E4M3 and rel_err(got["q"].float(), (acc * 0.5).clamp(-448, 448)) <= 2.0**-4


def test_tensorwise_scale_tensors_are_read_on_the_gpu_inside_cuda_graphs():
    m, n, k = 256, 512, 256
    a, w = quantized(m, k), quantized(n, k)
    sa, sb = torch.tensor(0.01, device="cuda"), torch.tensor(0.02, device="cuda")
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    epicute.gemm(a, w.t(), a_scale=sa, b_scale=sb, out=out)  # compiles and caches the kernel
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        epicute.gemm(a, w.t(), a_scale=sa, b_scale=sb, out=out)
    sa.fill_(0.03)  # a new value, not captured: the kernel reads it when the graph replays
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference(a, w, sa, sb)) <= TOL


# ------------------------------------------------------------------ blockwise
def block_reference(a, w, sa, sw):
    """float32 ``(a * sa) @ (w * sw).t()``: sa (.., M, KB) per 1x128 block, sw (.., NB, KB) per 128x128 block."""
    k, n = a.shape[-1], w.shape[-2]
    a_deq = a.float() * sa.repeat_interleave(128, dim=-1)[..., :k]
    w_deq = w.float() * sw.repeat_interleave(128, dim=-1)[..., :k].repeat_interleave(128, dim=-2)[..., :n, :]
    return a_deq @ w_deq.transpose(-1, -2)


def spread_scales(*shape):
    """Scales over eight binades, so that a block read from the wrong place shows."""
    return torch.exp2(torch.randint(-10, -2, shape, device="cuda").float()) * (1 + torch.rand(*shape, device="cuda"))


def check_blockwise(a, w, sa, sw, b_scale=None, what=""):
    out = torch.full((*a.shape[:-1], w.shape[-2]), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = epicute.gemm(a, w.transpose(-1, -2), a_scale=sa, b_scale=sw if b_scale is None else b_scale, out=out)
    assert got.data_ptr() == out.data_ptr()
    err = rel_err(out, block_reference(a, w, sa, sw))
    assert err <= TOL, f"rel err {err:.2e} for blockwise {what} a{tuple(a.shape)} {a.dtype} x w{tuple(w.shape)}"


@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E5M2), (E4M3, E5M2)], ids=["e4m3", "e5m2", "e4m3xe5m2"])
def test_blockwise_matches_the_dequantized_reference_in_every_scale_layout(dtypes):
    for m, n, k in SHAPES:
        a, w = quantized(m, k, dtype=dtypes[0]), quantized(n, k, dtype=dtypes[1])
        kb, nb = -(-k // 128), -(-n // 128)
        sa_torch = spread_scales(kb, m).t()  # torch._scaled_mm's M-major (M, KB)
        sw = spread_scales(nb, kb)  # the (N, K) weight's (NB, KB)
        check_blockwise(a, w, sa_torch, sw, sw.t(), "torch layouts")
        check_blockwise(a, w, sa_torch.contiguous(), sw, what="row-major a_scale, weight-layout b_scale")


@pytest.mark.parametrize("cluster", [(1, 2), (2, 1), (1, 1)], ids=["1x2", "2x1", "1x1"])
def test_blockwise_under_every_cluster_shape(cluster):
    """The load warp copies each stage's scales: a cluster's spare tile past N (3 tiles of N under a 1x2
    cluster) reads B's last block, and every CTA of a multicast pair copies its own rows' A scales."""
    m, n, k = 333, 296, 528
    a, w = quantized(m, k), quantized(n, k)
    sa, sw = spread_scales(-(-k // 128), m).t(), spread_scales(-(-n // 128), -(-k // 128))
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    config = {"cluster_m": cluster[0], "cluster_n": cluster[1]}
    epicute.gemm(a, w.t(), a_scale=sa, b_scale=sw, out=out, config=config)
    assert rel_err(out, block_reference(a, w, sa, sw)) <= TOL


@pytest.mark.parametrize(
    "pins", [{}, {"cluster_m": 1, "cluster_n": 2}, {"cluster_m": 1}, {"split_k": 3}],
    ids=["2x1", "1x2", "1x1", "split3"],
)  # fmt: skip
def test_blockwise_192_wide_tiles_promote_each_column_chunk_with_its_block(pins):
    """A 192-wide tile starts on a multiple of 64, so every other tile straddles two 128-wide blocks of N: each
    of its 64-column chunks is promoted with its own block's B scale (one partial per warpgroup)."""
    for m, n, k in [(333, 712, 528), (129, 136, 272), (1000, 4104, 1040)]:
        a, w = quantized(m, k), quantized(n, k)
        sa, sw = spread_scales(-(-k // 128), m).t(), spread_scales(-(-n // 128), -(-k // 128))
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        epicute.gemm(a, w.t(), a_scale=sa, b_scale=sw, out=out, config={"tile_n": 192, **pins})
        assert rel_err(out, block_reference(a, w, sa, sw)) <= TOL, (m, n, k, pins)


@pytest.mark.parametrize(
    "pins",
    [{}, {"cluster_m": 1, "cluster_n": 2}, {"cluster_m": 1}, {"tile_n": 64}, {"tile_n": 192}, {"split_k": 3}],
    ids=["2x1", "1x2", "1x1", "tile64", "tile192", "split3"],
)  # fmt: skip
def test_blockwise_scales_by_tma_and_bulk_copy_at_odd_shapes_and_batched(pins):
    """Scales in aligned layouts (here padded past odd M and KB: A's M-major, B's K-major, strides 16-byte
    aligned) arrive by one copy each per k-tile: A's TMA box is the tile's rows (those past M read zeros), B's
    bulk copy the aligned group of four blocks of K holding the k-tile's (past KB, the row's padding). The same
    values in other layouts (A row-major, B N-major) take cp.async; every pairing must give the same GEMM. A
    192-wide tile keeps cp.async for B (its chunks straddle blocks); K = 2064 wraps the ring, and a split of K
    starts inside a group."""
    from epicute.epilogue.scales import BlockScales

    for l, m, n, k in [(1, 333, 712, 528), (1, 1, 136, 272), (2, 129, 264, 400), (1, 200, 392, 2064)]:
        a, w = quantized(l, m, k), quantized(l, n, k)
        kb, nb, m_pad, kb_pad = -(-k // 128), -(-n // 128), -(-m // 4) * 4, -(-k // 512) * 4
        sa = spread_scales(l, kb, m_pad)[:, :, :m].transpose(1, 2)  # (L, M, KB), M-major, row stride m_pad
        sw = spread_scales(l, nb, kb_pad)[:, :, :kb]  # (L, NB, KB), K-major, row stride kb_pad
        assert BlockScales(sa, sw).a_tma and BlockScales(sa, sw).b_bulk
        if l == 1:
            a, w, sa, sw = a[0], w[0], sa[0], sw[0]
        want = block_reference(a, w, sa, sw)
        for sa_form, sw_form in ((sa, sw), (sa.contiguous(), sw), (sa, sw.transpose(-1, -2).contiguous().transpose(
                -1, -2)), (sa.contiguous(), sw.contiguous())):  # fmt: skip
            out = torch.full((*a.shape[:-1], n), float("nan"), device="cuda", dtype=torch.bfloat16)
            epicute.gemm(a, w.transpose(-1, -2), a_scale=sa_form, b_scale=sw_form, out=out, config=pins)
            assert rel_err(out, want) <= TOL, (l, m, n, k, pins, sa_form.stride(), sw_form.stride())


def test_blockwise_scales_shared_by_every_batch():
    """Scales broadcast over the batch (a zero batch stride, ``expand``) in the TMA/bulk-copy layouts and the
    cp.async ones: every batch reads the same blocks."""
    from epicute.epilogue.scales import BlockScales

    l, m, n, k = 3, 200, 264, 1040
    a, w = quantized(l, m, k), quantized(l, n, k)
    kb, nb = -(-k // 128), -(-n // 128)
    sa_m = spread_scales(kb, m).t()  # (M, KB) M-major, row stride M (a multiple of 4)
    sw_k = spread_scales(nb, -(-kb // 4) * 4)[:, :kb]  # (NB, KB) K-major, 16-byte aligned rows
    for (sa, sw), copies in (((sa_m, sw_k), (True, True)), ((sa_m.contiguous(), sw_k.contiguous()), (False, False))):
        sa_l, sw_l = sa.expand(l, m, kb), sw.expand(l, nb, kb)
        assert sa_l.stride(0) == 0 and sw_l.stride(0) == 0
        assert (BlockScales(sa_l, sw_l).a_tma, BlockScales(sa_l, sw_l).b_bulk) == copies
        check_blockwise(a, w, sa_l, sw_l, what=f"broadcast scales {sa_l.stride()} {sw_l.stride()}")


@pytest.mark.parametrize("split_k", [2, 3, 4])
@pytest.mark.parametrize("m,n,k", [(128, 392, 1040), (33, 264, 256)])
def test_blockwise_split_k_reads_each_split_s_scales(m, n, k, split_k):
    """Each split promotes its own k-tiles with their blocks' scales (K = 256 under 3 and 4 splits leaves
    splits with no k-tile); full 128-row tiles reduce every value of their partials."""
    a, w = quantized(m, k), quantized(n, k)
    sa, sw = spread_scales(-(-k // 128), m).t(), spread_scales(-(-n // 128), -(-k // 128))
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    epicute.gemm(a, w.t(), a_scale=sa, b_scale=sw, out=out, config={"tile_n": 128, "split_k": split_k})
    assert rel_err(out, block_reference(a, w, sa, sw)) <= TOL, (m, n, k, split_k)


def test_blockwise_batched_k_zero_and_epilogues():
    l, m, n, k = 3, 129, 264, 400
    a, w = quantized(l, m, k), quantized(l, n, k)
    sa, sw = spread_scales(l, m, 4), spread_scales(l, 3, 4)
    check_blockwise(a, w, sa, sw, what="batched")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)

    def epi(acc, bias):
        return {"D": ops.gelu(acc + bias), "pre": acc, "amax": ops.amax(acc), "rows": ops.row_sum(acc)}

    got = epicute.gemm(a, w.transpose(1, 2), a_scale=sa, b_scale=sw, epilogue=epi, bias=bias,
                       out_dtypes={"pre": torch.float32})  # fmt: skip
    acc = block_reference(a, w, sa, sw)
    assert rel_err(got["pre"], acc) <= TOL
    assert rel_err(got["D"], torch.nn.functional.gelu(acc + bias.float())) <= TOL
    assert rel_err(got["amax"], acc.abs().amax()) <= TOL
    assert rel_err(got["rows"], acc.sum(-1)) <= TOL
    a0, w0 = torch.empty(m, 0, device="cuda", dtype=E4M3), torch.empty(n, 0, device="cuda", dtype=E4M3)
    got = epicute.gemm(a0, w0.t(), a_scale=torch.ones(m, 0, device="cuda"), b_scale=torch.ones(3, 0, device="cuda"),
                       epilogue=lambda acc, bias: acc + bias, bias=bias)  # fmt: skip
    assert rel_err(got, bias.float().expand(m, n)) == 0  # K = 0: the epilogue of a zero accumulator


def test_promotion_keeps_long_k_at_the_level_of_a_bf16_gemm(capsys):
    """fp8 WGMMA accumulates with reduced precision: without promotion (tensorwise scales) the error
    grows with K; blockwise scales promote each 128-wide k-tile into fp32. Compared with a bf16 GEMM of
    the same values (fp8 values are exact in bf16), in fp32 D (the accumulation's error alone) and bf16
    D (what a layer stores); printed for the record."""
    m, n = 512, 1024
    errors = {}
    for k in (1024, 16384):
        a, w = quantized(m, k), quantized(n, k)
        want = reference(a, w, 1 / 64, 1 / 64)
        sa, sw = (
            torch.full((m, k // 128), 1 / 64, device="cuda"),
            torch.full((n // 128, k // 128), 1 / 64, device="cuda"),
        )
        for out in (torch.float32, torch.bfloat16):
            runs = {
                "fast": epicute.gemm(a, w.t(), a_scale=1 / 64, b_scale=1 / 64, out_dtype=out),
                "promoted": epicute.gemm(a, w.t(), a_scale=sa, b_scale=sw, out_dtype=out),
                "bf16": epicute.gemm(a.bfloat16() / 64, (w.bfloat16() / 64).t(), out_dtype=out),  # /64: exact
            }
            errors[k, out] = {name: rel_err(x, want) for name, x in runs.items()}
    with capsys.disabled():
        for (k, out), e in errors.items():
            print(
                f"\nfp8 e4m3, K={k}, {str(out)[6:]} D: rel err {e['fast']:.2e} without promotion, "
                f"{e['promoted']:.2e} promoted (blockwise), {e['bf16']:.2e} for a bf16 GEMM of the same values"
            )
    fp32_d, bf16_d = errors[16384, torch.float32], errors[16384, torch.bfloat16]
    assert fp32_d["promoted"] * 10 < fp32_d["fast"]
    assert bf16_d["promoted"] <= 1.1 * bf16_d["bf16"]  # the output's rounding dominates, as in a bf16 GEMM
