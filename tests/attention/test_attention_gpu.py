"""GPU correctness of the SM90 attention kernel against the float32 reference.

Odd sequence lengths (1, 17, 129, 1000, 4097), seqlen_q != seqlen_k both ways,
causal and not, MHA / GQA 4:1 / MQA, every head_dim, bf16 and fp16, score_mod
and epilogue, whose outputs are the GEMM's: aux tiles, reductions, fp8 O with its
amax. O is NaN-poisoned through ``out=``, LSE, aux tiles and reduction workspaces
through the runtime's buffer seams, so an element the kernel never writes fails. The reference runs on
the GPU in float32 with TF32 off (same math as ``backend="reference"``).
"""

from __future__ import annotations

import math

import pytest
import torch

import epicute
from epicute import ops
from epicute.attention.api import reference_attention
from epicute.attention.launch import tile_counter
from epicute.attention.prepare import hooks_of
from epicute.attention.validate import check_attention_args
from tests.conftest import assert_attention_close, poison_attention_outputs, rel_err

pytestmark = pytest.mark.gpu

TOL = 1e-2


@pytest.fixture(autouse=True)
def _poisoned_outputs_and_exact_reference(monkeypatch):
    poison_attention_outputs(monkeypatch, backward=False)


def qkv(b, sq, sk, hq, hkv, d, dtype=torch.bfloat16):
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    return q, k, v


def check(q, k, v, causal=False, score_mod=None, epilogue=None, config=None, **operands):
    out = torch.full_like(q, float("nan"))
    got, lse = epicute.attention(
        q,
        k,
        v,
        causal=causal,
        score_mod=score_mod,
        epilogue=epilogue,
        out=out,
        return_lse=True,
        config=config,
        **operands,
    )
    assert got.data_ptr() == out.data_ptr()
    call = check_attention_args(q, k, v, causal=causal, softmax_scale=None)
    score, epi = hooks_of(call, score_mod, epilogue, operands)
    ref, ref_lse = reference_attention(call, score, epi, out_dtype=torch.float32, device="cuda")
    ref = ref["D"]
    what = f"q{tuple(q.shape)} k{tuple(k.shape)} causal={causal}"
    assert_attention_close(out, lse, ref, ref_lse, what, TOL)


LENGTHS = [(1, 1), (17, 17), (129, 129), (1000, 1000), (4097, 4097), (17, 1000), (1000, 17), (129, 4097), (4097, 129)]


@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_odd_lengths(d, causal):
    for sq, sk in LENGTHS:
        check(*qkv(1, sq, sk, 2, 2, d), causal=causal)


@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("hkv", (2, 1), ids=("gqa4", "mqa"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_gqa_and_mqa(d, hkv, causal):
    for sq, sk in ((1000, 1000), (129, 1000), (257, 77)):
        check(*qkv(2, sq, sk, 4 * hkv if hkv == 2 else 3, hkv, d), causal=causal)


@pytest.mark.parametrize("d", (64, 128))
def test_fp16(d):
    for causal in (False, True):
        check(*qkv(2, 1000, 999 + 1, 4, 2, d, torch.float16), causal=causal)


@pytest.mark.parametrize("d", (64, 128, 256))
def test_score_mods(d):
    q, k, v = qkv(2, 1000, 1000, 4, 2, d)

    def softcap(s, b, h, q_idx, kv_idx):
        return 5.0 * ops.tanh(s / 5.0)

    def alibi(s, b, h, q_idx, kv_idx, slopes):
        return s + slopes * (kv_idx - q_idx)

    def rel_bias(s, b, h, q_idx, kv_idx, scale):
        return s - scale * ops.log(1.0 + ops.abs(q_idx - kv_idx)) + 0.01 * h - 0.02 * b

    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / 4) for i in range(4)], device="cuda")
    for causal in (False, True):
        check(q, k, v, causal=causal, score_mod=softcap)
        check(q, k, v, causal=causal, score_mod=alibi, slopes=slopes)
        check(q, k, v, causal=causal, score_mod=rel_bias, scale=0.5)


@pytest.mark.parametrize("d", (64, 128, 256))
def test_epilogues(d):
    q, k, v = qkv(2, 1000, 777, 4, 1, d)
    gate = torch.randn_like(q)
    residual = torch.randn(2, 1000, 4, d, device="cuda", dtype=torch.float32)
    bias = torch.randn(d, device="cuda", dtype=torch.bfloat16)

    def gated(o, gate, residual, alpha):
        return alpha * o * ops.sigmoid(gate) + residual

    def biased(o, bias):
        return ops.gelu(o + bias)

    for causal in (False, True):
        check(q, k, v, causal=causal, epilogue=gated, gate=gate, residual=residual, alpha=1.5)
        check(q, k, v, causal=causal, epilogue=biased, bias=bias)


@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dynamic", (False, True), ids=("static", "dynamic"))
def test_persistent_ctas_walk_many_tiles(d, causal, dynamic):
    # More tiles than SMs, so every CTA runs several (ragged m-blocks, GQA, both seqlen orders):
    # O staged in Q's buffer and the K/V ring positions must hand over cleanly from tile to tile,
    # and (dynamic) every tile is claimed exactly once from the counter, which each launch leaves at 0.
    persistent = {"persistent": True, "dynamic_tiles": dynamic}
    for b, sq, sk, hq, hkv in ((2, 1000, 1000, 24, 6), (3, 4097, 129, 8, 8), (2, 17, 4097, 96, 8)):
        check(*qkv(b, sq, sk, hq, hkv, d), causal=causal, config=persistent)
    q, k, v = qkv(2, 1000, 777, 24, 6, d)
    slopes = torch.rand(24, device="cuda")
    check(q, k, v, causal=causal, config=persistent, score_mod=lambda s, b, h, qi, ki, slopes: s + slopes * (ki - qi),
          epilogue=lambda o, gate: o * ops.sigmoid(gate), slopes=slopes, gate=torch.randn_like(q))  # fmt: skip
    torch.cuda.synchronize()
    assert tile_counter(q.device).item() == 0


@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("own", (False, True), ids=("in_q", "own"))
def test_outputs_staged_in_qs_buffer_or_their_own(d, causal, own):
    """O and an aux tile staged one after the other in Q's buffer (the O store hands Q back) or in their own buffer
    (the consumers hand Q back after the tile's last QK^T, so the next tile's Q lands under this one's epilogue),
    over walks of many tiles: ragged m-blocks, GQA, both seqlen orders."""
    config = {"o_buffer": own}
    for b, sq, sk, hq, hkv in ((2, 1000, 1000, 24, 6), (3, 4097, 129, 8, 8), (2, 17, 4097, 96, 8)):
        check(*qkv(b, sq, sk, hq, hkv, d), causal=causal, config=config)

    def gated(o, gate):
        return {"D": o * ops.sigmoid(gate), "pre": o}

    q, k, v = qkv(2, 1000, 777, 24, 6, d)
    gate = torch.randn_like(q)
    got = epicute.attention(q, k, v, causal=causal, epilogue=gated, gate=gate, config=config)
    call = check_attention_args(q, k, v, causal=causal, softmax_scale=None)
    _, epi = hooks_of(call, None, gated, {"gate": gate})
    ref, _ = reference_attention(call, None, epi, device="cuda")
    for name in ("D", "pre"):
        assert rel_err(got[name].float(), ref[name].float()) <= TOL, f"{name}, d{d} causal={causal} own={own}"


def test_tile_counters_are_per_stream():
    # Two streams running dynamically scheduled launches at once must not share a counter.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        on_side = tile_counter(torch.device("cuda"))
    assert on_side.data_ptr() != tile_counter(torch.device("cuda")).data_ptr()
    config = {"persistent": True, "dynamic_tiles": True}
    cases = [qkv(2, 1000, 1000, 24, 6, 128), qkv(4, 777, 2000, 16, 4, 128)]
    outs = [torch.full_like(q, float("nan")) for q, _, _ in cases]
    torch.cuda.synchronize()
    for stream, (q, k, v), out in zip((torch.cuda.current_stream(), side), cases, outs):
        with torch.cuda.stream(stream):
            epicute.attention(q, k, v, causal=True, config=config, out=out)
    torch.cuda.synchronize()
    for (q, k, v), out in zip(cases, outs):
        call = check_attention_args(q, k, v, causal=True, softmax_scale=None)
        ref = reference_attention(call, out_dtype=torch.float32, device="cuda")[0]["D"]
        assert rel_err(out, ref) <= TOL


@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("lazy", (True, False), ids=("lazy", "eager"))
def test_rescaling_with_growing_scores(d, lazy):
    """Key norms ramp up 30x along the sequence, so row maxima keep rising: some blocks move a row's
    max by less than the lazy-rescale threshold (P above 1 kept unnormalized), others by more."""
    q, k, v = qkv(2, 1000, 4097, 4, 2, d)
    k *= torch.linspace(1.0, 30.0, 4097, device="cuda", dtype=k.dtype)[None, :, None, None]
    for causal in (False, True):
        check(q, k, v, causal=causal, config={"lazy_rescale": lazy})


def test_score_mod_and_epilogue_together():
    q, k, v = qkv(1, 129, 4097, 8, 2, 128)
    check(q, k, v, causal=True, score_mod=lambda s, b, h, qi, ki: ops.minimum(s, 2.0),
          epilogue=lambda o, scale: o * scale, scale=math.pi)  # fmt: skip


def test_softmax_scale_and_large_batch():
    q, k, v = qkv(3, 300, 300, 6, 3, 64)
    out, lse = epicute.attention(q, k, v, softmax_scale=0.3, return_lse=True)
    call = check_attention_args(q, k, v, causal=False, softmax_scale=0.3)
    ref, ref_lse = reference_attention(call, out_dtype=torch.float32, device="cuda")
    ref = ref["D"]
    assert rel_err(out, ref) <= TOL
    assert rel_err(lse, ref_lse) <= 1e-4


def test_epilogue_outputs_aux_tiles_and_reductions():
    """O gets in the kernel what a GEMM's D gets: aux tiles (fp16 and fp8 here, staged in Q's
    buffer after O), reductions over head_dim (row_*), over the queries (col_*) and over everything
    (amax), deterministic run to run; every head_dim (d64: three warpgroups), GQA, causal with
    seqlen_q > seqlen_k (fully masked rows: O = 0 reaches the reductions as zeros)."""

    def outputs(o, bias, gate):
        y = o + bias
        return {"D": y, "pre": o * ops.sigmoid(gate), "q8": ops.quantize(o, 4.0),
                "rs": ops.row_sum(y), "rmax": ops.row_max(o), "cs": ops.col_sum(o), "cam": ops.col_amax(y),
                "am": ops.amax(o)}  # fmt: skip

    for d in (64, 128, 256):
        for causal, (sq, sk) in ((False, (1000, 777)), (True, (1000, 257))):
            q, k, v = qkv(2, sq, sk, 4, 2, d)
            bias = torch.randn(d, device="cuda", dtype=torch.bfloat16)
            gate = torch.randn_like(q)
            kwargs = dict(causal=causal, epilogue=outputs, bias=bias, gate=gate, out_dtypes={"pre": torch.float16})
            got = epicute.attention(q, k, v, **kwargs)
            call = check_attention_args(q, k, v, causal=causal, softmax_scale=None)
            score, epi = hooks_of(call, None, outputs, {"bias": bias, "gate": gate}, {"pre": "fp16"})
            ref, _ = reference_attention(call, score, epi, device="cuda")
            what = f"d{d} causal={causal}"
            assert got["pre"].dtype == torch.float16 and got["q8"].dtype == torch.float8_e4m3fn, what
            for name in ("D", "pre"):
                assert rel_err(got[name].float(), ref[name].float()) <= TOL, f"{name} for {what}"
            # fp8: O * 4 in e4m3 is off the fp32 reference by at most half a step, 2^-4 relative.
            o_ref = reference_attention(call, device="cuda", out_dtype=torch.float32)[0]["D"]
            assert rel_err(got["q8"].float(), (o_ref * 4.0).clamp(-448, 448)) <= 2.0**-4, f"q8 for {what}"
            for name in ("rs", "rmax", "cs", "cam", "am"):
                assert got[name].shape == ref[name].shape, f"{name} for {what}"
                assert rel_err(got[name], ref[name]) <= TOL, f"{name} for {what}"
            again = epicute.attention(q, k, v, **kwargs)
            for name in ("rs", "rmax", "cs", "cam", "am"):
                assert torch.equal(again[name], got[name]), f"{name} not bitwise reproducible for {what}"


@pytest.mark.parametrize("d", (64, 128, 256))
def test_fp8_o_with_its_amax(d):
    """``epilogues.tensor_quant``: O * scale quantized to e4m3 (saturating) and max |O * scale| (what
    delayed scaling reads to pick the next scale), the recipe that feeds an fp8 GEMM; ``out=`` takes
    the fp8 O."""
    q, k, v = qkv(2, 1000, 1000, 4, 2, d)
    out = torch.full(q.shape, float("nan"), dtype=torch.float8_e4m3fn, device="cuda")
    got = epicute.attention(q, k, v, causal=True, epilogue=epicute.epilogues.tensor_quant, scale=300.0, out=out)
    assert got["D"].data_ptr() == out.data_ptr() and got["D"].dtype == torch.float8_e4m3fn
    call = check_attention_args(q, k, v, causal=True, softmax_scale=None)
    o_ref = reference_attention(call, device="cuda", out_dtype=torch.float32)[0]["D"]
    # The scale saturates the largest values at 448: the reference saturates the same way.
    assert rel_err(got["D"].float(), (o_ref * 300.0).clamp(-448, 448)) <= 2.0**-4
    assert rel_err(got["amax"], (o_ref * 300.0).abs().amax()) <= TOL


def test_repeat_calls_skip_validation_and_stay_right(monkeypatch):
    """A plain call's second signature-equal call binds fresh tensors to the first call's validated problem and
    plan (no check_attention_args): each result matches its own reference; a misaligned repeat, a different
    layout and packed sequences whose longest lengths must be read are validated again."""
    from epicute.attention import api

    calls = []
    checked = api.check_attention_args
    monkeypatch.setattr(api, "check_attention_args", lambda *a, **kw: calls.append(1) or checked(*a, **kw))
    api._VALIDATED.clear()
    for causal in (True, True, True):
        q, k, v = qkv(2, 129, 333, 8, 2, 128)
        out, lse = epicute.attention(q, k, v, causal=causal, return_lse=True)
        call = check_attention_args(q, k, v, causal=causal, softmax_scale=None)
        ref, ref_lse = reference_attention(call, out_dtype=torch.float32, device="cuda")
        assert_attention_close(out, lse, ref["D"], ref_lse, "repeat", TOL)
    assert len(calls) == 1
    base = torch.randn(2 * 129 * 8 * 128 + 1, device="cuda", dtype=torch.bfloat16)
    shifted = base[1:].view(2, 129, 8, 128)  # the repeat's signature, 2 bytes past a 16-byte boundary
    with pytest.raises(epicute.AlignmentError, match="q.data_ptr"):
        epicute.attention(shifted, k, v, causal=True)
    epicute.attention(q, k, v, causal=False)  # another signature
    assert len(calls) == 3
    lengths = torch.tensor([0, 100, 333], device="cuda", dtype=torch.int32)
    qp = torch.randn(333, 8, 128, device="cuda", dtype=torch.bfloat16)
    kp = torch.randn(333, 2, 128, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        epicute.attention(qp, kp, kp, causal=True, cu_seqlens_q=lengths, cu_seqlens_k=lengths)
    assert len(calls) == 5  # the offsets are read (and checked) on every call without max_seqlen
