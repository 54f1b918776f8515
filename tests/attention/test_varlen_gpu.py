"""GPU correctness of packed variable-length attention (``cu_seqlens_q``/``cu_seqlens_k``), forward and backward.

Each packed call is compared with the float32 reference computed sequence by sequence
(:func:`reference_attention` of the packed call), relative error <= 1e-2 for O (NaN-poisoned, so a row
the kernel never writes fails, and a tile that writes past its sequence's end overwrites its
neighbour's rows and fails there) and <= 1e-4 for LSE. Lengths mix 0, 1, odd, tile-edge and long
sequences, with q and k lengths unequal per sequence; causal is bottom-right aligned per sequence.
Gradients are compared with float32 autograd of the same reference; dK and dV are NaN-poisoned.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import epicute
from epicute import ops
from epicute.attention.api import reference_attention
from epicute.attention.prepare import hooks_of
from epicute.attention.validate import check_attention_args
from tests.conftest import assert_attention_close, poison_attention_outputs, rel_err

pytestmark = pytest.mark.gpu

TOL = 1e-2


@pytest.fixture(autouse=True)
def _poisoned_outputs_and_exact_reference(monkeypatch):
    poison_attention_outputs(monkeypatch)


def packed(lengths_q, lengths_k, hq, hkv, d, dtype=torch.bfloat16, requires_grad=False):
    """Random packed q, k, v and their int32 cu_seqlens."""

    def cu(lengths):
        return torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)

    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = torch.randn(total_q, hq, d, device="cuda", dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(total_k, hkv, d, device="cuda", dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(total_k, hkv, d, device="cuda", dtype=dtype, requires_grad=requires_grad)
    lengths = {"max_seqlen_q": max(lengths_q), "max_seqlen_k": max(lengths_k)}
    return q, k, v, {"cu_seqlens_q": cu(lengths_q), "cu_seqlens_k": cu(lengths_k), **lengths}


def reference(q, k, v, varlen, causal=False, score_mod=None, **operands):
    call = check_attention_args(q, k, v, causal=causal, softmax_scale=None, **varlen)
    score, _ = hooks_of(call, score_mod, None, operands)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    call32 = dataclasses.replace(call, q=q32, k=k32, v=v32)
    results, lse = reference_attention(call32, score, None, out_dtype=torch.float32, device="cuda")
    return results["D"], lse, (q32, k32, v32)


def check_forward(q, k, v, varlen, causal=False, score_mod=None, config=None, **operands):
    o, lse = epicute.attention(q, k, v, causal=causal, score_mod=score_mod, return_lse=True, config=config,
                               **varlen, **operands)  # fmt: skip
    ref, ref_lse, _ = reference(q, k, v, varlen, causal, score_mod, **operands)
    what = f"q{tuple(q.shape)} k{tuple(k.shape)} causal={causal} cu_q={varlen['cu_seqlens_q'].tolist()}"
    assert o.shape == q.shape and lse.shape == (q.size(1), q.size(0))
    assert_attention_close(o, lse, ref, ref_lse, what, TOL)


#: (query lengths, key lengths) per sequence: empty, single, odd, tile edges, long, unequal both ways.
BATCHES = [
    ([17], [17]),
    ([1000, 1, 129, 4097], [1000, 17, 128, 4097]),
    ([0, 300, 5, 128], [64, 300, 1000, 0]),
    ([777, 2049, 64], [1500, 100, 64]),
]


@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("lengths", BATCHES, ids=("one", "mixed", "empty", "unequal"))
def test_forward_matches_reference(lengths, causal, d):
    check_forward(*packed(*lengths, 8, 2, d), causal=causal)


@pytest.mark.parametrize("hq,hkv", [(6, 2), (10, 2), (14, 2), (28, 4)], ids=("gqa3", "gqa5", "gqa7", "gqa7-4"))
def test_gqa_ratios_that_do_not_divide_the_tile(hq, hkv):
    check_forward(*packed(*BATCHES[1], hq, hkv, 128), causal=True)


@pytest.mark.parametrize("dynamic", (False, True), ids=("static", "dynamic"))
def test_persistent_ctas_skip_the_blocks_past_short_sequences(dynamic):
    # Many m-blocks of the longest sequence have no rows in the short ones: skipped by the producer
    # and the consumers alike (statically) or never announced (dynamically claimed tiles).
    config = {"persistent": True, "dynamic_tiles": dynamic}
    for causal in (False, True):
        check_forward(*packed([4097, 3, 1000, 0, 258], [4000, 4097, 17, 5, 258], 16, 4, 128), causal=causal,
                      config=config)  # fmt: skip


def test_score_mod_sees_each_sequence_index_and_positions():
    def per_sequence(s, b, h, q_idx, kv_idx, slopes):
        return s + slopes * (kv_idx - q_idx) - 0.25 * b

    q, k, v, varlen = packed([300, 17, 1000], [400, 17, 999], 8, 8, 128)
    check_forward(q, k, v, varlen, causal=True, score_mod=per_sequence, slopes=torch.rand(8, device="cuda"))


def test_fp16():
    check_forward(*packed([1000, 33], [17, 2000], 4, 4, 128, dtype=torch.float16), causal=True)


def check_backward(q, k, v, varlen, causal=False, score_mod=None, compiled=False, deterministic=False, **operands):
    """Gradients through epicute against the float32 reference; returns them."""

    def forward(q, k, v):
        return epicute.attention(q, k, v, causal=causal, score_mod=score_mod, deterministic=deterministic,
                                 **varlen, **operands)  # fmt: skip

    fn = torch.compile(forward, fullgraph=True) if compiled else forward
    o = fn(q, k, v)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), do)
    ref_o, _, leaves32 = reference(q, k, v, varlen, causal, score_mod, **operands)
    ref = torch.autograd.grad(ref_o, leaves32, do.float())
    what = f"q{tuple(q.shape)} k{tuple(k.shape)} causal={causal} cu_q={varlen['cu_seqlens_q'].tolist()}"
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert g.dtype == q.dtype and g.shape == r.shape
        err = rel_err(g, r)
        assert err <= TOL, f"{name} rel err {err:.2e} for {what}"
    return got


@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("lengths", BATCHES, ids=("one", "mixed", "empty", "unequal"))
def test_backward_matches_reference(lengths, causal, d):
    check_backward(*packed(*lengths, 8, 2, d, requires_grad=True), causal=causal)


@pytest.mark.parametrize("d", (64, 128, 256))
def test_backward_with_the_group_split_over_ctas(d, monkeypatch):
    # Each CTA walks one of the group's query heads and reduce-adds its dK and dV into fp32 key rows laid out
    # per sequence from a key block's boundary (as dQ's rows); the postprocess casts them per sequence.
    from epicute.attention import backward_plan

    monkeypatch.setattr(backward_plan, "heads_per_cta", lambda *args: 1)
    for lengths in BATCHES:
        check_backward(*packed(*lengths, 8, 2, d, requires_grad=True), causal=True)


@pytest.mark.parametrize("hq,hkv", [(6, 2), (10, 2), (14, 2)], ids=("gqa3", "gqa5", "gqa7"))
def test_backward_gqa_ratios_that_do_not_divide_the_tile(hq, hkv):
    check_backward(*packed(*BATCHES[3], hq, hkv, 128, requires_grad=True), causal=True)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_deterministic_backward_is_reproducible_bit_for_bit(causal):
    q, k, v, varlen = packed([1000, 1, 129, 4097], [1000, 17, 128, 4097], 8, 2, 64, requires_grad=True)
    check_backward(q, k, v, varlen, causal=causal, deterministic=True)
    do = torch.randn_like(q)

    def grads():
        o = epicute.attention(q, k, v, causal=causal, deterministic=True, **varlen)
        return torch.autograd.grad(o, (q, k, v), do)

    first = grads()
    for _ in range(3):
        for name, a, b in zip(("dq", "dk", "dv"), first, grads()):
            assert torch.equal(a, b), f"{name} differs between two deterministic runs"


def test_backward_score_mod_and_torch_compile():
    def softcap(s, b, h, q_idx, kv_idx):
        return 30 * ops.tanh(s / 30)

    q, k, v, varlen = packed([1000, 17, 129], [900, 1, 300], 8, 2, 128, requires_grad=True)
    check_backward(q, k, v, varlen, causal=True, score_mod=softcap)
    check_backward(q, k, v, varlen, causal=False, compiled=True)
