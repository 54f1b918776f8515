"""GPU correctness of fp8 attention (e4m3 Q, K, V with descales, O in bf16) against float32 math.

Inputs are random bf16 tensors quantized to e4m3 with a scale (one per tensor, or one per sequence and
key/value head), so the reference and the kernel read the same dequantized values; O is NaN-poisoned. The
kernel rounds P to e4m3 before the PV WGMMA (FlashAttention-3's recipe), which the float32 reference does not:
O is held to twice the error that rounding P alone gives (the same math with P rounded to e4m3 at each row's
maximum: ``reference_attention(p_dtype=...)``), plus 2**-8, bf16 O's own rounding; a value tile read in the wrong
key order, a missed scale or a wrong block gives errors of order 1. LSE does not see P's rounding; it is held to
1e-3, not bf16's 1e-4: fp8 WGMMA accumulates with fewer bits than fp32 (DeepSeek-V3's report measured about 14
on Hopper), and the first run measured 1.13e-4 at head_dim 256 (MQA, 1031 keys).
"""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute import ops
from epicute.attention.api import reference_attention
from epicute.attention.validate import check_attention_args
from tests.conftest import poison_attention_outputs, rel_err

pytestmark = pytest.mark.gpu

E4M3 = torch.float8_e4m3fn
BF16_ROUNDING = 2.0**-8  # bf16 O's unit roundoff
LSE_TOL = 1e-3


@pytest.fixture(autouse=True)
def _poisoned_outputs_and_exact_reference(monkeypatch):
    poison_attention_outputs(monkeypatch, backward=False)


def quantized(shape, per_head: tuple[int, int] | None = None):
    """A random tensor as e4m3 and its descale: one scale, or (with ``per_head`` = (batch, heads_kv), shape
    ``(batch, seqlen, heads, d)``) one per (batch, key/value head), a query head using its group's."""
    x = torch.randn(shape, device="cuda") * (0.5 + torch.rand((), device="cuda") * 2)
    if per_head is None:
        scale = x.abs().amax() / 448
        return (x / scale).to(E4M3), scale.float().reshape(1)
    batch, heads_kv = per_head
    group = shape[2] // heads_kv
    amax = x.abs().amax(dim=(1, 3)).view(batch, heads_kv, group).amax(dim=2)
    scale = (amax / 448).float()
    expanded = scale.repeat_interleave(group, dim=1)[:, None, :, None]
    return (x / expanded).to(E4M3), scale


def p_rounding_error(call, score=None) -> float:
    """The relative error rounding P to e4m3 alone gives O: the float32 math with each row's P (at the row's
    maximum) rounded to e4m3, against the float32 math."""
    exact = reference_attention(call, score, out_dtype=torch.float32, device="cuda")[0]["D"]
    emulated = reference_attention(call, score, out_dtype=torch.float32, device="cuda", p_dtype=E4M3)[0]["D"]
    return rel_err(emulated, exact)


def check(q, k, v, causal=False, score_mod=None, descales=(None, None, None), **kwargs):
    names = ("q_descale", "k_descale", "v_descale")
    scales = dict(zip(names, descales))
    got, lse = epicute.attention(q, k, v, causal=causal, score_mod=score_mod, return_lse=True, **scales, **kwargs)
    assert got.dtype == torch.bfloat16
    call = check_attention_args(q, k, v, causal=causal, softmax_scale=None, require_cuda=False, **scales, **{
        n: kwargs[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k") if n in kwargs})
    score = None
    if score_mod is not None:
        from epicute.attention.prepare import hooks_of

        score, _ = hooks_of(call, score_mod, None, {})
    ref, ref_lse = reference_attention(call, score, None, out_dtype=torch.float32, device="cuda")
    bound = 2 * p_rounding_error(call, score) + BF16_ROUNDING
    err = rel_err(got, ref["D"])
    what = f"q{tuple(q.shape)} k{tuple(k.shape)} causal={causal}"
    assert err <= bound, f"O rel err {err:.3e} > {bound:.3e} for {what}"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), f"LSE -inf pattern differs for {what}"
    if (~empty).any():
        lse_err = rel_err(lse[~empty], ref_lse[~empty])
        assert lse_err <= LSE_TOL, f"LSE rel err {lse_err:.2e} for {what}"


LENGTHS = [(1, 1), (17, 17), (129, 129), (1000, 1000), (17, 1000), (1000, 17), (4097, 129), (129, 4097)]


@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_fp8_odd_lengths(d, causal):
    for sq, sk in LENGTHS:
        q, qs = quantized((2, sq, 4, d))
        k, ks = quantized((2, sk, 4, d))
        v, vs = quantized((2, sk, 4, d))
        check(q, k, v, causal, descales=(qs, ks, vs))


@pytest.mark.parametrize("d", (128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_fp8_o_staged_in_qs_buffer(d, causal):
    """The planner stages fp8 attention's bf16 O in a buffer of its own; pinned back into Q's buffer (sized for
    bf16 O, Q in its first half), over walks of many tiles, it gives the same results."""
    for b, sq, sk, hq, hkv in ((2, 1000, 1000, 24, 6), (3, 4097, 129, 8, 8)):
        (q, qs), (k, ks), (v, vs) = quantized((b, sq, hq, d)), quantized((b, sk, hkv, d)), quantized((b, sk, hkv, d))
        check(q, k, v, causal, descales=(qs, ks, vs), config={"o_buffer": False})


@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("hq,hkv", ((8, 2), (6, 1), (14, 2)), ids=("gqa4", "mqa6", "gqa7"))
def test_fp8_gqa_with_per_head_descales(d, hq, hkv):
    for causal in (False, True):
        q, qs = quantized((3, 777, hq, d), per_head=(3, hkv))
        k, ks = quantized((3, 1031, hkv, d), per_head=(3, hkv))
        v, vs = quantized((3, 1031, hkv, d), per_head=(3, hkv))
        check(q, k, v, causal, descales=(qs, ks, vs))


@pytest.mark.parametrize("d", (64, 128))
def test_fp8_decode_packs_gqa_and_splits_keys(d):
    # one query per sequence, GQA 8:1, long cache: packed GQA and split-KV plans
    q, qs = quantized((2, 1, 16, d))
    k, ks = quantized((2, 20000, 2, d))
    v, vs = quantized((2, 20000, 2, d))
    plan = epicute.explain_attention(q, k, v, file=None)
    assert plan.config.pack_gqa == 8 and plan.config.num_splits > 1
    check(q, k, v, descales=(qs, ks, vs))


@pytest.mark.parametrize("d", (128, 256))  # d256 with a score_mod plans 96-key blocks
def test_fp8_score_mod_softcap(d):
    q, qs = quantized((2, 500, 4, d))
    k, ks = quantized((2, 700, 4, d))
    v, vs = quantized((2, 700, 4, d))
    softcap = lambda s, b, h, qi, ki: 30 * ops.tanh(s / 30)
    check(q, k, v, True, score_mod=softcap, descales=(qs, ks, vs))


@pytest.mark.parametrize("d", (64, 128, 256))
def test_fp8_packed_sequences(d):
    lengths_q, lengths_k = [5, 0, 1000, 129, 1, 300], [7, 3, 1000, 4000, 16, 17]
    cu_q = torch.tensor([0, *lengths_q], device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lengths_k], device="cuda").cumsum(0).to(torch.int32)
    q, qs = quantized((sum(lengths_q), 8, d))
    k, ks = quantized((sum(lengths_k), 2, d))
    v, vs = quantized((sum(lengths_k), 2, d))
    for causal in (False, True):
        check(q, k, v, causal, descales=(qs, ks, vs), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
              max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))  # fmt: skip


def test_fp8_o_through_the_epilogue():
    q, qs = quantized((2, 333, 4, 128))
    k, ks = quantized((2, 333, 4, 128))
    v, vs = quantized((2, 333, 4, 128))
    r = epicute.attention(q, k, v, q_descale=qs, k_descale=ks, v_descale=vs,
                          epilogue=epicute.epilogues.tensor_quant, scale=4.0)  # fmt: skip
    call = check_attention_args(q, k, v, causal=False, softmax_scale=None, q_descale=qs, k_descale=ks, v_descale=vs)
    ref = reference_attention(call, out_dtype=torch.float32, device="cuda")[0]["D"]
    assert r["D"].dtype == E4M3
    bound = 2 * p_rounding_error(call) + 2 ** -4  # plus O * 4's own rounding to e4m3
    err = rel_err(r["D"].float(), (ref * 4).clamp(-448, 448))
    assert err <= bound, f"fp8 O rel err {err:.3e} > {bound:.3e}"
    amax_err = abs(r["amax"].item() - (ref * 4).abs().max().item()) / (ref * 4).abs().max().item()
    assert amax_err <= bound, f"amax rel err {amax_err:.3e}"


@pytest.mark.parametrize("d", (64, 128, 256))
def test_the_value_pass_kernel_lays_out_what_torch_does(d):
    # batched (a ragged last group and tile) and packed (empty, one-key and long sequences), uint8-exact
    from epicute.attention.fp8 import value_layout
    from epicute.attention.launch import lay_out_values

    v = torch.randn(3, 301, 2, d, device="cuda").to(E4M3)
    got, want = lay_out_values(v), value_layout(v.cpu())
    assert got.shape == want.shape and got.stride(1) == 1
    assert torch.equal(got.cpu().contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
    lengths = [0, 1, 129, 17, 300]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    v = torch.randn(sum(lengths), 2, d, device="cuda").to(E4M3)
    got, want = lay_out_values(v, cu.cuda(), max(lengths)), value_layout(v.cpu(), cu)
    assert got.shape == want.shape
    assert torch.equal(got.cpu().contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def test_repeat_fp8_calls_skip_validation_and_bind_their_own_descales(monkeypatch):
    """Signature-equal fp8 calls are validated once (a decode step's host path); each binds its own descales, so a
    repeat with other scale values gets its own right answer, and a descale of a wrong shape is still refused."""
    from epicute.attention import api

    calls = []
    checked = api.check_attention_args
    monkeypatch.setattr(api, "check_attention_args", lambda *a, **kw: calls.append(1) or checked(*a, **kw))
    api._VALIDATED.clear()
    for _ in range(3):
        q, qs = quantized((2, 129, 8, 128), per_head=(2, 2))
        k, ks = quantized((2, 333, 2, 128), per_head=(2, 2))
        v, vs = quantized((2, 333, 2, 128))
        check(q, k, v, True, descales=(qs, ks, vs))
    assert len(calls) == 1
    with pytest.raises(epicute.ShapeError, match="q_descale has shape"):
        epicute.attention(q, k, v, causal=True, q_descale=torch.ones(3, 2, device="cuda"), k_descale=ks, v_descale=vs)


def test_fp8_attention_under_torch_compile_runs_the_eager_kernel():
    torch._dynamo.reset()
    q, qs = quantized((2, 300, 8, 128), per_head=(2, 2))
    k, ks = quantized((2, 333, 2, 128))
    v, vs = quantized((2, 333, 2, 128))

    def f(q, k, v, qs, ks, vs):
        return epicute.attention(q, k, v, causal=True, q_descale=qs, k_descale=ks, v_descale=vs)

    compiled = torch.compile(f, fullgraph=True)(q, k, v, qs, ks, vs)
    eager = f(q, k, v, qs, ks, vs)
    assert compiled.dtype == torch.bfloat16 and torch.equal(compiled, eager)  # one kernel, the same launch
