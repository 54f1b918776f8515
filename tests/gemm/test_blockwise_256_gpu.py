"""256-wide blockwise fp8 tiles on the GPU (issue 56, item 4), and the call they exist for.

A 256-wide tile's sum takes 128 registers a thread, and a whole k-tile partial beside it would take 128
more, so each k-tile's WGMMAs run in two 128-column halves (one block of N each) into a half-width partial,
each half promoted with its own block's B scale before the next half is issued. They are what a gated epilogue
with ``ops.quantize_groups`` needs: 256 accumulator columns are 128 output columns, one whole quantize group.
That is DeepSeek-V3's dense MLP in one GEMM: gate/up with blockwise scales, SwiGLU, 1x128 quantization for the
down projection, whose blockwise GEMM then takes the quantized output and its scales.

Every kernel result is checked against the float32 reference of the same math (``backend="reference"``) and,
for the gated calls, against float64 math on the two projections taken apart (so a wrong half, block, register
pairing or interleave shows); outputs are NaN-poisoned, sizes ragged (N not a multiple of the tile, K of 128,
odd M), scales spread over eight binades so that a scale read from the wrong block shows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import epicute
from epicute import ops
from tests.conftest import rel_err

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
E4M3 = torch.float8_e4m3fn
#: bf16 D of fp8 inputs: the issue's bound (tests/gemm/test_fp8_gpu.py).
TOL = 2e-2
#: e4m3's relative step: a dequantized value is within it of what was quantized (tests/gemm/test_group_quant_gpu.py).
E4M3_STEP = 2.0**-4


def quantized(*shape):
    """Values spread over the format's range (amax 64), as a quantizer leaves them."""
    return (torch.randn(*shape, device=DEVICE) * 16).clamp(-64, 64).to(E4M3)


def spread_scales(*shape):
    """Scales over eight binades, so that a block read from the wrong place shows."""
    return torch.exp2(torch.randint(-10, -2, shape, device=DEVICE).float()) * (1 + torch.rand(*shape, device=DEVICE))


def blockwise_operands(m, n, k):
    """A ``(M, K)``, the ``(N, K)`` weight, A's scales in torch._scaled_mm's M-major ``(M, K/128)`` and the
    weight's ``(N/128, K/128)``."""
    kb, nb = -(-k // 128), -(-n // 128)
    return quantized(m, k), quantized(n, k), spread_scales(kb, m).t(), spread_scales(nb, kb)


def dequantized(a, w, sa, sw):
    """float64 A and weight, each times its blockwise scales."""
    k, n = a.shape[-1], w.shape[-2]
    a64 = a.double() * sa.double().repeat_interleave(128, dim=-1)[..., :k]
    w64 = w.double() * sw.double().repeat_interleave(128, dim=-1)[..., :k].repeat_interleave(128, dim=-2)[..., :n, :]
    return a64, w64


def swiglu_quantize(ue8m0):
    def epilogue(gate, up):
        q, scales = ops.quantize_groups(ops.silu(gate) * up, ue8m0=ue8m0)
        return {"D": q, "scales": scales}

    return epilogue


def swiglu(gate, up):
    return ops.silu(gate) * up


def group_dequantized(q, scales):
    """A quantized D times its per-row, per-128-column scales, in float64."""
    return q.double() * scales.double().repeat_interleave(128, dim=-1)[..., : q.shape[-1]]


# ------------------------------------------------------------------ plain GEMMs in 256-wide tiles

PINS_256 = {
    "cooperative-2x1": {"tile_n": 256},
    "cooperative-1x1": {"tile_n": 256, "cluster_m": 1},
    "cooperative-1x2": {"tile_n": 256, "cluster_m": 1, "cluster_n": 2},
    "one-tile-per-cta": {"tile_n": 256, "persistent": False, "cluster_m": 1},
    "pingpong-64x256": {"schedule": "pingpong", "tile_m": 64, "tile_n": 256},
}


@pytest.mark.parametrize("pins", list(PINS_256.values()), ids=list(PINS_256))
def test_blockwise_256_wide_tiles_promote_each_half_with_its_block(pins):
    """Every 256-wide tile spans two 128-wide blocks of N: each half of a k-tile is promoted with its own block's
    B scale. N past the last whole tile (712, 136, 4104), K past the last whole block (528, 272, 1040)."""
    for m, n, k in [(333, 712, 528), (129, 136, 272), (1000, 4104, 1040), (1, 16, 16)]:
        a, w, sa, sw = blockwise_operands(m, n, k)
        out = torch.full((m, n), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        got = epicute.gemm(a, w.t(), a_scale=sa, b_scale=sw, out=out, config=pins)
        assert got.data_ptr() == out.data_ptr()
        ref = epicute.gemm(a, w.t(), a_scale=sa, b_scale=sw, out_dtype=torch.float32, config=pins,
                           backend="reference")  # fmt: skip
        assert rel_err(out, ref.to(DEVICE)) <= TOL, (m, n, k, pins)
        a64, w64 = dequantized(a, w, sa, sw)
        assert rel_err(out, a64 @ w64.t()) <= TOL, (m, n, k, pins)


# ------------------------------------------------------------------ DeepSeek-V3's dense MLP: gate/up, SwiGLU, quantize

MLP_CONFIGS = {"planned": None, "pingpong-64x256": {"schedule": "pingpong", "tile_m": 64, "tile_n": 256}}


@pytest.mark.parametrize("config", list(MLP_CONFIGS.values()), ids=list(MLP_CONFIGS))
@pytest.mark.parametrize("ue8m0", [True, False], ids=["ue8m0", "fp32-scales"])
@pytest.mark.parametrize("m,n,k", [(999, 400, 1040), (257, 1024, 2064), (1, 144, 272)])
def test_blockwise_swiglu_then_quantize_matches_the_reference(m, n, k, ue8m0, config):
    """fp8 blockwise gate/up -> SwiGLU -> 1x128 quantization in one GEMM, in 256-wide tiles (128 output
    columns: one whole group). N = 400 ends inside a group (its last scale covers 16 columns)."""
    w_gate, w_up = quantized(n, k), quantized(n, k)
    w = epicute.interleave_gate_up(w_gate, w_up)  # (2N, K): gate and up in blocks of 8 rows
    a, _, sa, sw = blockwise_operands(m, 2 * n, k)
    if config is None:
        plan = epicute.explain(a, w.t(), a_scale=sa, b_scale=sw, gated=True, epilogue=swiglu_quantize(ue8m0),
                               file=None)  # fmt: skip
        assert (plan.config.schedule, plan.config.tile_n) == ("cooperative", 256)
    out = torch.full((m, n), float("nan"), device=DEVICE).to(E4M3)  # fp8 NaN poison
    got = epicute.gemm(a, w.t(), a_scale=sa, b_scale=sw, gated=True, epilogue=swiglu_quantize(ue8m0), out=out,
                       config=config)  # fmt: skip
    assert got["D"].data_ptr() == out.data_ptr() and got["D"].dtype == E4M3
    assert got["scales"].shape == (m, -(-n // 128)) and got["scales"].stride(0) == 1  # M-major: the next a_scale
    assert torch.isfinite(got["scales"]).all()

    ref = epicute.gemm(a, w.t(), a_scale=sa, b_scale=sw, gated=True, epilogue=swiglu_quantize(ue8m0),
                       config=config, backend="reference")  # fmt: skip
    x = epicute.gemm(a, w.t(), a_scale=sa, b_scale=sw, gated=True, epilogue=swiglu, out_dtype=torch.float32,
                     config=config, backend="reference").to(DEVICE)  # fmt: skip
    ref_scales = ref["scales"].to(DEVICE)
    # A scale is amax / fp8_max: off by the accumulation's rounding, or (UE8M0) equal unless amax sits within
    # that rounding of a power of two.
    if ue8m0:
        assert (got["scales"] == ref_scales).float().mean() > 0.99
    else:
        assert rel_err(got["scales"], ref_scales) < 5e-3
    dequant = group_dequantized(got["D"], got["scales"])
    assert rel_err(dequant, x) < E4M3_STEP
    assert rel_err(dequant, group_dequantized(ref["D"].to(DEVICE), ref_scales)) < TOL

    # The same SwiGLU from the two projections taken apart, in float64 (no gate/up layout involved).
    a64, w64 = dequantized(a, w, sa, sw)
    gate, up = (a64 @ w64.t()).unflatten(-1, (n // 8, 2, 8)).unbind(-2)
    x64 = F.silu(gate.flatten(-2)) * up.flatten(-2)
    assert rel_err(x, x64) < 1e-5
    assert rel_err(dequant, x64) < E4M3_STEP


def test_blockwise_mlp_quantized_output_feeds_the_down_projection():
    """DeepSeek-V3's dense MLP end to end at odd sizes: h = SwiGLU(x @ w13) quantized per 1x128 in the gate/up
    GEMM's epilogue, then the down projection's blockwise GEMM takes h and its scales as they come."""
    m, k, hidden, n = 1000, 1040, 1408, 1040
    x, _, xs, _ = blockwise_operands(m, 2 * hidden, k)
    w13 = epicute.interleave_gate_up(quantized(hidden, k), quantized(hidden, k))
    w13s = spread_scales(2 * hidden // 128, -(-k // 128))
    w2, w2s = quantized(n, hidden), spread_scales(-(-n // 128), hidden // 128)

    h = epicute.gemm(x, w13.t(), a_scale=xs, b_scale=w13s, gated=True, epilogue=swiglu_quantize(True))
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    epicute.gemm(h["D"], w2.t(), a_scale=h["scales"], b_scale=w2s, out=out)

    ref_h = epicute.gemm(x, w13.t(), a_scale=xs, b_scale=w13s, gated=True, epilogue=swiglu_quantize(True),
                         backend="reference")  # fmt: skip
    ref = epicute.gemm(ref_h["D"], w2.t().cpu(), a_scale=ref_h["scales"], b_scale=w2s.cpu(), out_dtype=torch.float32,
                       backend="reference")  # fmt: skip
    assert rel_err(out, ref.to(DEVICE)) < TOL


def test_bf16_swiglu_then_quantize_where_ping_pong_was_planned_and_refused():
    """The planner used to take ping-pong here and then refuse its 128x256 tile (256 accumulator registers per
    thread): now the cooperative 128x256 tile, whole groups, against the reference."""
    m, n, k = 1531, 4000, 264
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    w = epicute.interleave_gate_up(torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k**0.5,
                                   torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k**0.5)  # fmt: skip
    plan = epicute.explain(x, w.t(), gated=True, epilogue=swiglu_quantize(False), file=None)
    assert (plan.config.schedule, plan.config.tile_n) == ("cooperative", 256)
    out = torch.full((m, n), float("nan"), device=DEVICE).to(E4M3)
    got = epicute.gemm(x, w.t(), gated=True, epilogue=swiglu_quantize(False), out=out)
    ref = epicute.gemm(x, w.t(), gated=True, epilogue=swiglu_quantize(False), backend="reference")
    assert got["D"].data_ptr() == out.data_ptr()
    assert rel_err(got["scales"], ref["scales"].to(DEVICE)) < 1e-5
    dequant = group_dequantized(got["D"], got["scales"])
    assert rel_err(dequant, group_dequantized(ref["D"].to(DEVICE), ref["scales"].to(DEVICE))) < TOL
