"""GPU correctness of the attention backward against float32 autograd of the reference math.

Gradients of ``epicute.attention`` (through its custom op's registered autograd) are compared
with torch's autograd through :func:`reference_attention` on float32 copies of the same inputs
(the same math: masks, score_mod, causal alignment), relative error <= 1e-2 per gradient. Odd
lengths (1, 17, 1000, 4097), seqlen_q != seqlen_k both ways, MHA / GQA / MQA, causal, head_dim
64, 128 and 256 (whose kernel splits head_dim over its warpgroups), bf16 and fp16, score_mods
(softcap, ALiBi, a masked softcap), LSE's own gradient,
``torch.compile(fullgraph=True)``, the deterministic mode (bitwise-equal gradients across runs and grid
orders).
dK and dV are NaN-poisoned through the backward's buffer seam, so an element the kernel never
writes fails.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import epicute
from epicute import ops
from epicute.attention import backward as rt_backward
from epicute.attention import backward_plan
from epicute.attention.api import reference_attention
from epicute.attention.backward_plan import backward_config
from epicute.attention.prepare import hooks_of, prepare
from epicute.attention.validate import check_attention_args
from epicute.errors import ConfigError
from tests.conftest import poison_attention_outputs, rel_err

pytestmark = pytest.mark.gpu

TOL = 1e-2


@pytest.fixture(autouse=True)
def _poisoned_grads_and_exact_reference(monkeypatch):
    poison_attention_outputs(monkeypatch, forward=False)


def leaves(b, sq, sk, hq, hkv, d, dtype=torch.bfloat16):
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
    return q, k, v


def reference_grads(q, k, v, do, causal=False, score_mod=None, dlse=None, **operands):
    """float32 autograd of the reference forward at q, k, v (and LSE's gradient ``dlse`` if given)."""
    call = check_attention_args(q, k, v, causal=causal, softmax_scale=None)
    score, _ = hooks_of(call, score_mod, None, operands)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    call32 = dataclasses.replace(call, q=q32, k=k32, v=v32)
    results, lse = reference_attention(call32, score, None, out_dtype=torch.float32, device="cuda")
    outputs, grads = [results["D"]], [do.float()]
    if dlse is not None:
        finite = torch.isfinite(lse)
        outputs.append(lse[finite])
        grads.append(dlse[finite])
    return torch.autograd.grad(outputs, (q32, k32, v32), grads)


def check(q, k, v, causal=False, score_mod=None, compiled=False, with_lse=False, deterministic=False, **operands):
    """Gradients through epicute against the float32 reference; returns them."""

    def forward(q, k, v):
        return epicute.attention(q, k, v, causal=causal, score_mod=score_mod, return_lse=with_lse,
                                 deterministic=deterministic, **operands)  # fmt: skip

    fn = torch.compile(forward, fullgraph=True) if compiled else forward
    result = fn(q, k, v)
    do = torch.randn_like(q)
    outputs, grads, dlse = [result], [do], None
    if with_lse:
        o, lse = result
        dlse = torch.randn_like(lse)
        outputs, grads = [o, lse], [do, dlse]
    got = torch.autograd.grad(outputs, (q, k, v), grads)
    ref = reference_grads(q, k, v, do, causal, score_mod, dlse, **operands)
    what = f"q{tuple(q.shape)} k{tuple(k.shape)} causal={causal}"
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert g.dtype == q.dtype and g.shape == r.shape
        err = rel_err(g, r)
        assert err <= TOL, f"{name} rel err {err:.2e} for {what}"
    return got


LENGTHS = [(1, 17), (17, 17), (1000, 1000), (4097, 4097), (17, 1000), (1000, 17), (129, 4097)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", LENGTHS)
def test_gradients_match_reference(sq, sk, causal):
    check(*leaves(2, sq, sk, 4, 4, 128), causal=causal)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (6, 1), (6, 2), (10, 2), (14, 2), (24, 8)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gqa_and_mqa_sum_dk_dv_over_the_group(d, hq, hkv):
    check(*leaves(2, 1000, 777, hq, hkv, d), causal=True)
    check(*leaves(1, 129, 1000, hq, hkv, d), causal=False)


def test_fp16_and_head_dim_64():
    check(*leaves(2, 513, 1000, 4, 2, 64, torch.float16), causal=True)
    check(*leaves(1, 1000, 1000, 2, 2, 128, torch.float16))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 17), (17, 1000), (1000, 17), (4097, 4097), (129, 1000)])
def test_head_dim_256_gradients_match_reference(sq, sk, causal):
    # 64 keys per CTA, the warpgroups splitting the step's queries (S^T, dP^T) and head_dim (dV, dK, dQ):
    # 1 and 17 keys leave most of a block masked, 4097 crosses a block edge by one.
    check(*leaves(2, sq, sk, 2, 2, 256), causal=causal)
    if sq == 129 and not causal:
        check(*leaves(1, sq, sk, 4, 2, 256, torch.float16), causal=True)


def alibi(s, b, h, q_idx, kv_idx, slopes):
    return s + slopes * (kv_idx - q_idx)


def test_score_mod_gradients_are_derived():
    def softcap(s, b, h, q_idx, kv_idx):
        return 30.0 * ops.tanh(s / 30.0)

    def local_softcap(s, b, h, q_idx, kv_idx, cap):
        # A sliding window as a score_mod: -inf outside it (no gradient there), softcap inside.
        return ops.where(q_idx - kv_idx > 200.0, float("-inf"), cap * ops.tanh(s / cap))

    q, k, v = leaves(2, 1000, 1000, 4, 2, 128)
    check(q, k, v, causal=True, score_mod=softcap)
    slopes = torch.rand(4, device="cuda") * 0.1
    check(q, k, v, causal=False, score_mod=alibi, slopes=slopes)
    check(*leaves(1, 777, 1000, 4, 4, 64), causal=True, score_mod=local_softcap, cap=20.0)
    check(*leaves(1, 300, 1000, 2, 2, 256), causal=True, score_mod=alibi, slopes=torch.rand(2, device="cuda") * 0.1)


def alibi_softcap(s, b, h, q_idx, kv_idx, slopes, cap):
    return cap * ops.tanh((s + slopes * (kv_idx - q_idx)) / cap)


def operand_grads_reference(q, k, v, do, causal, operands, score_fn, o_stored):
    """Attention with ``score_fn(s, per-head operands as (h, 1, 1) tensors, kv_idx - q_idx)`` in float32
    torch: autograd's gradients of q, k and v; and the gradients of ``operands`` by the backward's own
    math, ``sum P (dP - D) d score_mod / d operand`` with ``D = rowsum(dO * O)`` of the O the forward
    stored (``o_stored``, bf16), as every FlashAttention backward takes it. ALiBi slopes' gradient weighs
    each score's residual by ``kv_idx - q_idx``, so the rounding of O in D, which cancels in dS over a
    row, does not cancel there: against fp32 O's D the kernel's dslopes differs by ~2e-2 (1.4e-2 to
    2.1e-2 measured) while dq, dk and dv stay under 1e-2."""
    q, k, v = (t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v))  # (b, h, s, d)
    operands = [t.detach().float().requires_grad_() for t in operands]
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(group, dim=1) for t in (k, v))
    sq, sk = q.shape[2], k.shape[2]
    q_idx = torch.arange(sq, device="cuda").view(-1, 1)
    kv_idx = torch.arange(sk, device="cuda").view(1, -1)
    s = q @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5
    f = score_fn(s, [t.view(-1, 1, 1) for t in operands], kv_idx - q_idx)
    if causal:  # bottom-right aligned, as epicute's (and flash-attn's) causal mask
        f = f.masked_fill(kv_idx > q_idx + sk - sq, float("-inf"))
    p = torch.softmax(f, dim=-1).nan_to_num(0.0)
    do = do.float().transpose(1, 2)
    dq, dk, dv = torch.autograd.grad(p @ vv, (q, k, v), do, retain_graph=True)
    with torch.no_grad():
        dp = do @ vv.transpose(-1, -2)
        dsum = (do * o_stored.float().transpose(1, 2)).sum(-1, keepdim=True)
        upstream = p * (dp - dsum)  # d loss / d score_mod
    return (dq, dk, dv, *torch.autograd.grad(f, operands, upstream))


def softcap_torch(s, h, rel):
    slopes, cap = h
    return cap * torch.tanh((s + slopes * rel) / cap)


@pytest.mark.parametrize("d,causal", [(128, True), (64, False), (256, True)])
def test_score_mod_operands_get_gradients(d, causal):
    # Learnable ALiBi slopes and a per-head softcap: each gradient sums P (dP - D) times the score_mod's
    # derivative by the operand over every score of its head (the kernel's per-warp partial sums).
    q, k, v = leaves(2, 1000, 777, 4, 2, d)
    slopes = (torch.rand(4, device="cuda") * 0.1).requires_grad_()
    cap = (20.0 + 10.0 * torch.rand(4, device="cuda")).requires_grad_()
    o = epicute.attention(q, k, v, causal=causal, score_mod=alibi_softcap, slopes=slopes, cap=cap)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v, slopes, cap), do)
    ref = operand_grads_reference(q, k, v, do, causal, (slopes, cap), softcap_torch, o.detach())
    for name, g, r in zip(("dq", "dk", "dv", "dslopes", "dcap"), got, ref):
        r = r.transpose(1, 2) if r.dim() == 4 else r
        assert g.shape == r.shape and g.dtype == (q.dtype if r.dim() == 4 else torch.float32), name
        err = rel_err(g, r)
        assert err <= TOL, f"{name} rel err {err:.2e} (d{d}, causal={causal})"
    # ALiBi alone: the slopes' derivative reads only the indices, so the kernel makes it with dS^T, after the
    # softmax (not fused into it).
    o = epicute.attention(q, k, v, causal=causal, score_mod=alibi, slopes=slopes)
    got = torch.autograd.grad(o, (q, k, v, slopes), do)
    ref = operand_grads_reference(q, k, v, do, causal, (slopes,), lambda s, h, rel: s + h[0] * rel, o.detach())
    for name, g, r in zip(("dq", "dk", "dv", "dslopes"), got, ref):
        r = r.transpose(1, 2) if r.dim() == 4 else r
        err = rel_err(g, r)
        assert err <= TOL, f"ALiBi {name} rel err {err:.2e} (d{d}, causal={causal})"
    # Only the slopes learn (bf16): the cap gets no gradient; q, k and v none needed either.
    slopes16 = slopes.detach().bfloat16().requires_grad_()
    o = epicute.attention(*(t.detach() for t in (q, k, v)), causal=causal, score_mod=alibi_softcap,
                          slopes=slopes16, cap=cap.detach())  # fmt: skip
    (grad,) = torch.autograd.grad(o.float().square().sum(), slopes16)
    assert grad.dtype == torch.bfloat16 and grad.shape == (4,) and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_eager_training_and_the_custom_op_run_the_same_program():
    # Eager training launches the kernels itself (EagerAttention, with the forward's validated call and plan);
    # the custom op's autograd, which torch.compile calls, rebuilds both from its spec. Deterministic, the two
    # give the same bits, operand gradients (mapped back by name) included.
    from epicute.attention.torch_op import attention_op_call

    q, k, v = leaves(2, 1000, 777, 4, 2, 128)
    slopes = (torch.rand(4, device="cuda") * 0.1).requires_grad_()
    cap = torch.full((4,), 30.0, device="cuda", requires_grad=True)
    do = torch.randn_like(q)
    hooks = {"causal": True, "score_mod": alibi_softcap, "deterministic": True}
    o = epicute.attention(q, k, v, **hooks, slopes=slopes, cap=cap)
    eager = torch.autograd.grad(o, (q, k, v, slopes, cap), do)
    unset = dict.fromkeys(("softmax_scale", "epilogue", "out", "out_dtypes", "config"))
    o_op = attention_op_call(q, k, v, return_lse=False, backend="kernel", operands={"slopes": slopes, "cap": cap},
                             **unset, **hooks)  # fmt: skip
    through_op = torch.autograd.grad(o_op, (q, k, v, slopes, cap), do)
    assert torch.equal(o, o_op)
    for name, a, b in zip(("dq", "dk", "dv", "dslopes", "dcap"), eager, through_op):
        assert torch.isfinite(a).all() and a.abs().sum() > 0, name
        assert torch.equal(a, b), f"{name}: eager and the custom op differ"


def test_operand_gradients_are_reproducible_and_trained_under_torch_compile():
    q, k, v = leaves(1, 1000, 1000, 4, 4, 128)
    slopes = (torch.rand(4, device="cuda") * 0.1).requires_grad_()
    cap = torch.full((4,), 30.0, device="cuda", requires_grad=True)
    do = torch.randn_like(q)

    def grads(fn):
        o = fn(q, k, v, causal=True, score_mod=alibi_softcap, slopes=slopes, cap=cap)
        return torch.autograd.grad(o, (slopes, cap), do)

    first = grads(epicute.attention)
    for name, a, b in zip(("dslopes", "dcap"), first, grads(epicute.attention)):
        assert torch.equal(a, b), f"{name} differs between two runs"  # one writer per partial sum, in step order
    compiled = grads(torch.compile(epicute.attention, fullgraph=True))
    for name, a, b in zip(("dslopes", "dcap"), first, compiled):
        assert rel_err(b, a) <= TOL, f"{name}: torch.compile's differs"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "d,hq,hkv,sq,sk", [(128, 4, 2, 4097, 1000), (64, 2, 2, 1000, 4097), (128, 2, 1, 300, 17), (256, 4, 2, 1000, 777)]
)
def test_deterministic_gradients_are_reproducible_bit_for_bit(d, hq, hkv, sq, sk, causal):
    # Many key blocks add into each query block's dQ: in deterministic mode always in the same order.
    q, k, v = leaves(2, sq, sk, hq, hkv, d)
    do = torch.randn_like(q)

    def grads():
        return torch.autograd.grad(epicute.attention(q, k, v, causal=causal, deterministic=True), (q, k, v), do)

    first = grads()
    for _ in range(3):
        for name, a, b in zip(("dq", "dk", "dv"), first, grads()):
            assert torch.equal(a, b), f"{name} differs between two deterministic runs"
    for name, g, r in zip(("dq", "dk", "dv"), first, reference_grads(q, k, v, do, causal)):
        assert rel_err(g, r) <= TOL, f"{name} rel err {rel_err(g, r):.2e}"


@pytest.mark.parametrize("d", [64, 128])
def test_grid_bands_of_heads_leave_the_gradients_unchanged(d, monkeypatch):
    # 2 batches x 4 key/value heads walked in bands of 3 pairs (the last one 2 wide): each pair's key blocks
    # still launch in order, so deterministic sums are bitwise those of the one-pair order.
    q, k, v = leaves(2, 1000, 1000, 8, 4, d)
    do = torch.randn_like(q)

    def grads(band, deterministic):
        monkeypatch.setattr(backward_plan, "grid_band", lambda *args: band)
        out = epicute.attention(q, k, v, causal=True, deterministic=deterministic)
        return torch.autograd.grad(out, (q, k, v), do)

    ref = reference_grads(q, k, v, do, causal=True)
    for deterministic in (False, True):
        banded = grads(3, deterministic)
        for name, g, r in zip(("dq", "dk", "dv"), banded, ref):
            assert rel_err(g, r) <= TOL, f"{name} rel err {rel_err(g, r):.2e} (deterministic={deterministic})"
    for name, a, b in zip(("dq", "dk", "dv"), banded, grads(1, True)):
        assert torch.equal(a, b), f"{name}: bands of 3 pairs and of 1 sum dQ differently"


@pytest.mark.parametrize("heads", [1, 2, 3])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_a_group_split_over_ctas_sums_dk_dv_in_fp32(d, heads, monkeypatch):
    # The planner splits a causal group only past L2's size (bench shapes); forced here at small ones: each CTA
    # walks `heads` of the group's query heads and reduce-adds its fp32 dK and dV, the postprocess casts them.
    # Where `heads` does not divide the group (4 as 3 + 1, 7 as 2 + 2 + 2 + 1 or 3 + 3 + 1) the last share is short.
    monkeypatch.setattr(backward_plan, "heads_per_cta", lambda *args: heads)
    call = check_attention_args(*leaves(1, 17, 17, 4, 1, d), causal=True, softmax_scale=None)
    variant = prepare(call).backward_variant()
    assert variant.head_split and variant.heads_per_cta == heads
    check(*leaves(2, 1000, 777, 8, 2, d), causal=True)
    check(*leaves(1, 4097, 129, 12, 3, d), causal=True)  # 129 keys: a ragged second key block
    check(*leaves(2, 129, 1000, 8, 2, d), causal=False)
    check(*leaves(2, 1000, 1000, 14, 2, d), causal=True)  # a 7:1 group


def test_deterministic_mode_trains_under_torch_compile():
    check(*leaves(2, 1000, 1000, 4, 2, 128), causal=True, compiled=True, deterministic=True)


@pytest.mark.parametrize("fragments", [True, False], ids=["dq_fragments", "dq_rows"])
@pytest.mark.parametrize("with_dlse", [True, False], ids=["dlse", "no_dlse"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_preprocess_kernel_matches_its_torch_reference(d, packed, fragments, with_dlse):
    # head_dim / 8 lanes share a row (4 rows a warp at 64, 1 at 256); tile_m is the main kernel's.
    heads, tile_m = 3, backward_config(d).tile_m
    if packed:
        lengths = [10, 0, 130, 1, 77]
        cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
        shape, lse_shape = (sum(lengths), heads, d), (heads, sum(lengths))
    else:
        shape, lse_shape = (2, 129, heads, d), (2, heads, 129)
    o, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lse, dlse = (torch.randn(lse_shape, device="cuda") for _ in range(2))
    dlse = dlse if with_dlse else None  # autograd passes None when the loss does not use LSE
    lse.view(-1)[5] = float("-inf")  # a row that saw no key
    packing = (cu, max(lengths)) if packed else ()
    lse_log2, dsum, dq_accum = rt_backward.preprocess(o, do, lse, tile_m, dlse, packing, fragments)  # NaN-poisoned
    ref_lse, ref_d = rt_backward.preprocess_reference(o, do, lse, tile_m, dlse, cu if packed else None)
    assert lse_log2.shape == ref_lse.shape and dsum.shape == ref_d.shape
    assert torch.equal(torch.isposinf(lse_log2), torch.isposinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert rel_err(lse_log2[finite], ref_lse[finite]) <= 1e-6 and rel_err(dsum, ref_d) <= 1e-5
    assert dq_accum.shape == ((*ref_lse.shape, d) if fragments else (1, *shape) if packed else shape)
    assert (dq_accum == 0).all()


def test_lse_gradient_flows():
    check(*leaves(2, 1000, 1000, 4, 4, 128), causal=True, with_lse=True)


def test_a_loss_of_lse_alone():
    # O unused: autograd hands the backward None for its gradient (no zeros materialized), taken as dO = 0.
    q, k, v = leaves(1, 333, 517, 2, 2, 128)
    _, lse = epicute.attention(q, k, v, causal=True, return_lse=True)
    dlse = torch.randn_like(lse)
    dq, dk, dv = torch.autograd.grad(lse, (q, k, v), dlse)
    ref = reference_grads(q, k, v, torch.zeros_like(q), True, None, dlse)
    for name, g, r in zip(("dq", "dk"), (dq, dk), ref):
        assert rel_err(g, r) <= TOL, f"{name} rel err {rel_err(g, r):.2e}"
    assert dv.shape == v.shape and (dv == 0).all()  # dV = P^T dO with dO = 0


def test_torch_compile_fullgraph_trains():
    check(*leaves(2, 1000, 1000, 4, 2, 128), causal=True, compiled=True)


def test_one_key_gives_scores_no_gradient():
    # A softmax over one key is 1 whatever the score: dQ = dK = 0 exactly (a relative error is
    # meaningless there), while dV = the sum of dO over the queries.
    q, k, v = leaves(2, 1000, 1, 4, 2, 128)
    do = torch.randn_like(q)
    dq, dk, dv = torch.autograd.grad(epicute.attention(q, k, v), (q, k, v), do)
    ref_dv = reference_grads(q, k, v, do)[2]
    assert rel_err(dv, ref_dv) <= TOL
    scale = ref_dv.abs().max().item()
    assert dq.abs().max().item() <= 1e-3 * scale and dk.abs().max().item() <= 1e-3 * scale


def test_rows_that_see_no_key_pass_no_gradient():
    # Causal with seqlen_q > seqlen_k: the first rows see no key (O = 0, LSE = -inf).
    q, k, v = leaves(1, 300, 17, 2, 2, 128)
    check(q, k, v, causal=True)


def test_unsupported_backward_is_refused_before_launch():
    q, k, v = leaves(1, 64, 64, 2, 2, 128)
    with pytest.raises(ConfigError, match="epilogue"):
        epicute.attention(q, k, v, epilogue=lambda o: {"D": o * 2.0})
    cap = torch.tensor(30.0, device="cuda", requires_grad=True)  # one element: read as a number
    with pytest.raises(ConfigError, match="'cap' requires grad, but a one-element tensor is read as a number"):
        epicute.attention(q, k, v, score_mod=lambda s, b, h, qi, ki, cap: cap * ops.tanh(s / cap), cap=cap)
    scale = torch.rand(128, device="cuda", requires_grad=True)  # an output epilogue's (head_dim,) vector
    with pytest.raises(ConfigError, match="'scale' requires grad: only the score_mod's"):
        epicute.attention(q, k, v, epilogue=lambda o, scale: {"D": o * scale}, scale=scale)
    # A paged KV cache (one page of 64 keys) is for inference: refused with grad, served without.
    pages = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    q_decode, k_paged, v_paged = leaves(1, 4, 64, 2, 2, 128)
    with pytest.raises(ConfigError, match="page_table"):
        epicute.attention(q_decode, k_paged, v_paged, page_table=pages)
    with torch.no_grad():
        assert epicute.attention(q_decode, k_paged, v_paged, page_table=pages).shape == q_decode.shape
