"""epicute.attention on the CPU: the reference against torch SDPA in float64, the hooks, the errors.

The reference (``backend="reference"``) is the oracle GPU results are checked
against, so it is itself checked here against ``scaled_dot_product_attention``
in float64, with bottom-right causal masks, GQA/MQA and seqlen_q != seqlen_k.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import epicute
from epicute import ops
from epicute.attention.api import reference_attention
from epicute.attention.backward_plan import backward_smem_layout
from epicute.attention.prepare import hooks_of, prepare
from epicute.attention.validate import check_attention_args
from tests.conftest import rel_err


def qkv(b, sq, sk, hq, hkv, d, dtype=torch.bfloat16):
    return (torch.randn(b, sq, hq, d, dtype=dtype), torch.randn(b, sk, hkv, d, dtype=dtype),
            torch.randn(b, sk, hkv, d, dtype=dtype))  # fmt: skip


def sdpa64(q, k, v, causal, scale=None):
    """SDPA in float64 on (b, s, h, d) tensors, GQA by repetition, causal aligned bottom-right."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    sq, sk = q.shape[2], k.shape[2]
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq) if causal else None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return out.transpose(1, 2), torch.logsumexp(scores, dim=-1)


def float64_reference(q, k, v, causal, score_mod=None, epilogue=None, **operands):
    call = check_attention_args(q, k, v, causal=causal, softmax_scale=None, require_cuda=False)
    score, epi = hooks_of(call, score_mod, epilogue, operands)
    return reference_attention(call, score, epi, compute_dtype=torch.float64, out_dtype=torch.float64)[0]["D"]


CASES = [(2, 17, 17, 4, 4), (1, 129, 40, 4, 1), (2, 33, 100, 6, 2), (1, 1, 1, 2, 2), (1, 70, 70, 8, 2)]


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("d", (64, 128, 256))
def test_reference_matches_sdpa_float64(case, causal, d):
    q, k, v = qkv(*case, d)
    call = check_attention_args(q, k, v, causal=causal, softmax_scale=None, require_cuda=False)
    outputs, lse = reference_attention(call, compute_dtype=torch.float64, out_dtype=torch.float64)
    out = outputs["D"]
    ref, ref_lse = sdpa64(q, k, v, causal)
    seen = ~torch.isneginf(ref_lse)  # rows that see at least one key (SDPA gives NaN for the others)
    assert rel_err(out.transpose(1, 2)[seen], ref.transpose(1, 2)[seen]) < 1e-12
    assert rel_err(lse.double()[seen], ref_lse[seen]) < 1e-6  # LSE is returned in fp32
    assert torch.equal(torch.isneginf(lse), ~seen)
    assert (out.transpose(1, 2)[~seen] == 0).all()


def test_public_reference_backend_rounds_to_input_dtype():
    q, k, v = qkv(2, 77, 100, 4, 2, 128)
    out, lse = epicute.attention(q, k, v, causal=True, softmax_scale=0.2, return_lse=True, backend="reference")
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 77)
    ref, ref_lse = sdpa64(q, k, v, True, scale=0.2)
    assert rel_err(out, ref) < 1e-2
    assert rel_err(lse, ref_lse) < 1e-5
    target = torch.empty_like(q)
    assert epicute.attention(q, k, v, causal=True, softmax_scale=0.2, out=target, backend="reference") is target
    assert torch.equal(target, out)


def test_score_mods_in_the_reference():
    q, k, v = qkv(2, 40, 50, 4, 2, 64)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])

    def softcap_alibi(s, b, h, q_idx, kv_idx, slopes, cap):
        return cap * ops.tanh(s / cap) + slopes * (kv_idx - q_idx) + 0.5 * b - 0.25 * h

    out = float64_reference(q, k, v, False, score_mod=softcap_alibi, slopes=slopes, cap=3.0)
    assert rel_err(epicute.attention(q, k, v, score_mod=softcap_alibi, slopes=slopes, cap=3.0, backend="reference"),
                   out) < 1e-2  # fmt: skip
    qh, kh, vh = (t.double().transpose(1, 2).repeat_interleave(4 // t.shape[2], dim=1) for t in (q, k, v))
    s = qh @ kh.transpose(-1, -2) / 8.0
    rel = torch.arange(50).view(1, -1) - torch.arange(40).view(-1, 1)
    s = 3.0 * torch.tanh(s / 3.0) + slopes.double().view(1, 4, 1, 1) * rel
    s = s + 0.5 * torch.arange(2).view(2, 1, 1, 1) - 0.25 * torch.arange(4).view(1, 4, 1, 1)
    ref = (torch.softmax(s, dim=-1) @ vh).transpose(1, 2)
    assert rel_err(out, ref) < 1e-6  # the modified scores are rounded to fp32, as the kernel holds them


def test_epilogue_in_the_reference():
    q, k, v = qkv(2, 30, 30, 4, 4, 64)
    gate, bias = torch.randn_like(q.float()), torch.randn(64)
    out = float64_reference(
        q, k, v, True, epilogue=lambda o, gate, bias, alpha: alpha * o * ops.sigmoid(gate) + bias,
        gate=gate, bias=bias, alpha=2.0,
    )  # fmt: skip
    ref, _ = sdpa64(q, k, v, True)
    # The epilogue's output is rounded to O's dtype (bf16): compare with the rounded truth.
    expected = (2.0 * ref * torch.sigmoid(gate.double()) + bias.double()).to(torch.bfloat16).double()
    assert rel_err(out, expected) < 1e-3


def test_explain_shows_whole_rows_and_smem(capsys):
    q = torch.empty(4, 8192, 16, 128, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(4, 8192, 4, 128, dtype=torch.bfloat16, device="meta")
    plan = epicute.explain_attention(q, kv, kv, causal=True)
    text = capsys.readouterr().out
    assert "every warp holds whole rows" in text and "GQA 4:1" in text and "ping-pong" in text
    # Causal: one CTA per SM claiming the 64 m-blocks x 16 heads x 4 batches, longest-first.
    assert plan.grid == (132, 1, 1) and plan.num_tiles == 64 * 16 * 4
    assert "claims its next from an atomic counter" in text and "longest-first in bands of 8 heads" in text


def test_explain_shows_the_backward_kernel_autograd_runs(capsys):
    q = torch.empty(2, 1000, 16, 64, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(2, 1000, 4, 64, dtype=torch.bfloat16, device="meta")
    epicute.explain_attention(q, kv, kv, causal=True)
    backward = capsys.readouterr().out.split("backward (training")[1]
    # 8 key blocks x 4 key/value heads x 2 batches; d64 takes 128-query steps and splits dQ by rows.
    assert "grid            (8, 4, 2)" in backward and "4 query head(s)" in backward
    assert "128 queries per step" in backward and "half of dQ's rows" in backward
    variant = prepare(
        check_attention_args(q, kv, kv, causal=True, softmax_scale=None, require_cuda=False)
    ).backward_variant()
    total = backward_smem_layout(variant.config, "bf16").total_bytes
    assert f"total               {total} B" in backward and "warp 1 reduce-adds dQ" in backward
    assert "dQ order        as the reduce-adds land" in backward
    assert "grid order      key block by key block over 8 (head, batch) pairs at a time" in backward
    epicute.explain_attention(q, kv, kv)
    assert "every key block of one (head, batch) pair, then the next: without a causal mask" in capsys.readouterr().out
    epicute.explain_attention(q, kv, kv, causal=True, deterministic=True)
    backward = capsys.readouterr().out.split("backward (training")[1]
    assert "deterministic: the key blocks take turns adding into each query block, first to last" in backward
    # Llama-3-70B's GQA 8:1 at 8 K, causal: a whole group's CTAs would stream 64 MiB of queries, so 4 CTAs per
    # key block each walk 2 query heads (what two pairs stream fits the H100's 50 MB L2) and reduce-add dK, dV.
    q70, kv70 = (torch.empty(1, 8192, h, 128, dtype=torch.bfloat16, device="meta") for h in (64, 8))
    epicute.explain_attention(q70, kv70, kv70, causal=True)
    backward = capsys.readouterr().out.split("backward (training")[1]
    assert "grid            (64, 32, 1)" in backward and "walking 2 of its 8 query heads" in backward
    assert "dK, dV          split: the group's 8 query heads over 4 CTAs per key block" in backward
    assert "stream 64 MiB of queries, more than L2" in backward
    # head_dim 256: 64 keys per CTA, the warpgroups split the step's queries and head_dim.
    q256 = torch.empty(1, 1000, 2, 256, dtype=torch.bfloat16, device="meta")
    epicute.explain_attention(q256, q256, q256)
    backward = capsys.readouterr().out.split("backward (training")[1]
    assert "grid            (16, 2, 1): a CTA per 64 keys" in backward
    assert "S^T, dP^T of queries 32-63; dV, dK, dQ of dims 128-255" in backward and "1-stage TMA ring" in backward


def bad(exc, match, *args, **kwargs):
    with pytest.raises(exc, match=match):
        epicute.attention(*args, backend="reference", **kwargs)


def test_validation_errors():
    q, k, v = qkv(2, 16, 16, 4, 2, 64)
    bad(epicute.ShapeError, "4-D", q[0], k, v)
    bad(epicute.DtypeError, "torch.bfloat16, torch.float16 and torch.float8_e4m3fn", q.float(), k.float(), v.float())
    bad(epicute.DtypeError, "k has dtype", q, k.half(), v)
    bad(epicute.ShapeError, "head_dim=96", *qkv(1, 8, 8, 2, 2, 96))
    bad(epicute.ShapeError, "multiple of heads_kv", *qkv(1, 8, 8, 3, 2, 64))
    bad(epicute.ShapeError, r"they differ in seqlen \(16 != 8\)", q, k, v[:, :8])
    bad(epicute.ShapeError, "batch", q, k[:1], v[:1])
    bad(epicute.ShapeError, "seqlen 0", q, k[:, :0], v[:, :0])
    bad(epicute.AlignmentError, "contiguous", q, k.transpose(2, 3).contiguous().transpose(2, 3), v)
    misaligned = torch.empty(2 * 16 * 4 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 16, 4, 64)
    bad(epicute.AlignmentError, "16-byte", misaligned, k, v)
    bad(epicute.ConfigError, "softmax_scale", q, k, v, softmax_scale=-1.0)
    for scale in (0.0, 1e-40, float("inf"), float("nan")):  # float32 would hold 0, a subnormal, inf, NaN
        bad(epicute.ConfigError, "float32 holds", q, k, v, softmax_scale=scale)
    with pytest.raises(epicute.ConfigError, match="backend"):
        epicute.attention(q, k, v, backend="triton")
    with pytest.raises(epicute.DeviceError, match="cuda"):
        epicute.attention(q, k, v)
    bad(epicute.OutputError, "must be O.s", q, k, v, out=torch.empty(2, 16, 4, 32, dtype=torch.bfloat16))
    bad(epicute.OutputError, "shares memory", q, k, v, out=q)


def test_hook_operand_errors():
    q, k, v = qkv(2, 16, 16, 4, 2, 64)
    alibi = lambda s, b, h, qi, ki, slopes: s + slopes * (ki - qi)
    bad(epicute.EpilogueError, "needs operands", q, k, v, score_mod=alibi)
    bad(epicute.EpilogueError, r"per-head vector \(4,\)", q, k, v, score_mod=alibi, slopes=torch.rand(3))
    bad(epicute.EpilogueError, "not parameters", q, k, v, score_mod=alibi, slopes=torch.rand(4), typo=1.0)
    bad(epicute.EpilogueError, "tile", q, k, v, epilogue=lambda o, g: o * g, g=torch.rand(2, 16, 4))
    bad(epicute.EpilogueError, "positional indices", q, k, v, score_mod=lambda s, b: s)
    # flash-attn's keywords epicute spells otherwise: the fix, not "not parameters"
    bad(epicute.ConfigError, r"dropout_p= \(flash-attn's keyword\): epicute.attention has no attention dropout", q, k,
        v, dropout_p=0.1)  # fmt: skip
    bad(epicute.ConfigError, r"window_size= .*a sliding window is a score_mod", q, k, v, window_size=(8, 0))
    bad(epicute.ConfigError, r"alibi_slopes= .*slopes=alibi_slopes", q, k, v, alibi_slopes=torch.rand(4))
    # ... unless a hook declares it: then it is that hook's operand
    capped = lambda s, b, h, qi, ki, softcap: softcap * ops.tanh(s / softcap)
    assert math.isfinite(float(epicute.attention(q, k, v, score_mod=capped, softcap=30.0, backend="reference").sum()))
    assert math.isfinite(
        float(epicute.attention(q, k, v, score_mod=alibi, slopes=torch.rand(4), backend="reference").float().sum())
    )


def test_attention_outputs_are_the_gemms_and_fit_qs_buffer():
    """The epilogue's outputs (aux tiles, reductions, fp8 O) on the reference backend, shaped as the
    kernel returns them; outputs wider than q's elements are refused on both backends (the kernel
    stages each in Q's buffer), with the fix in the message."""
    q, k, v = qkv(2, 17, 9, 4, 2, 64)
    bias = torch.randn(64, dtype=torch.bfloat16)

    def outputs(o, bias):
        return {"D": ops.quantize(o + bias, 8.0), "pre": o, "rs": ops.row_sum(o), "cm": ops.col_max(o),
                "am": ops.amax(o)}  # fmt: skip

    got, lse = epicute.attention(q, k, v, causal=True, epilogue=outputs, bias=bias, backend="reference",
                                 return_lse=True, out_dtypes={"pre": torch.float16})  # fmt: skip
    assert got["D"].dtype == torch.float8_e4m3fn and got["pre"].dtype == torch.float16
    assert got["D"].shape == got["pre"].shape == q.shape
    assert got["rs"].shape == lse.shape == (2, 4, 17) and got["cm"].shape == (2, 4, 64) and got["am"].shape == ()
    o = epicute.attention(q, k, v, causal=True, backend="reference").double()
    assert rel_err(got["rs"], o.sum(dim=-1).transpose(1, 2)) < 1e-2
    assert rel_err(got["cm"], o.amax(dim=1)) < 1e-2 and rel_err(got["am"], o.abs().amax()) < 1e-2
    with pytest.raises(epicute.EpilogueError, match=r"'pre' is fp32.*Q's bf16 buffer.*out_dtypes"):
        epicute.attention(q, k, v, epilogue=lambda o: {"D": o, "pre": o}, out_dtypes={"pre": torch.float32},
                          backend="reference")  # fmt: skip
    with pytest.raises(epicute.EpilogueError, match="without an epilogue"):
        epicute.attention(q, k, v, out_dtypes={"pre": torch.float16}, backend="reference")
    with pytest.raises(epicute.OutputError, match="float8_e4m3fn"):  # out must take O's stored dtype
        epicute.attention(q, k, v, epilogue=outputs, bias=bias, out=torch.empty_like(q), backend="reference")


def test_explain_prints_the_chain_the_kernel_runs(monkeypatch):
    """explain_attention and the call go through one prepare(): the chain explain prints is the
    launched fusion's, and the plan is the launched variant's."""
    import io

    from epicute.attention import api as attention_api
    from epicute.attention import launch as rt_attention

    q = torch.empty(2, 1000, 8, 128, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(2, 1000, 2, 128, dtype=torch.bfloat16, device="meta")
    text = io.StringIO()
    plan = epicute.explain_attention(q, kv, kv, causal=True, epilogue=epicute.epilogues.tensor_quant, scale=2.0,
                                     file=text)  # fmt: skip
    printed = text.getvalue()
    for needle in ("output epilogue chain", "%2 quantize", "D: fp32 -> fp8e4m3 (saturating)", "the smem staging tile",
                   "amax = amax(%3)", "finalize_reductions"):  # fmt: skip
        assert needle in printed, needle
    seen = {}
    monkeypatch.setattr(attention_api, "check_attention_args",
                        lambda *a, **kw: check_attention_args(*a, **{**kw, "require_cuda": False}))  # fmt: skip
    monkeypatch.setattr(rt_attention, "launch_attention",
                        lambda call, variant, *rest: seen.update(v=variant) or ({"D": None}, None))  # fmt: skip
    qc, kc = torch.randn(2, 1000, 8, 128, dtype=torch.bfloat16), torch.randn(2, 1000, 2, 128, dtype=torch.bfloat16)
    epicute.attention(qc, kc, kc, causal=True, epilogue=epicute.epilogues.tensor_quant, scale=2.0)
    assert seen["v"].config == plan.config
    assert "\n".join(f"  {stage}" for stage in seen["v"].epilogue.stages) in printed


def test_paged_and_seqused_validation_errors():
    q = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16)
    cache = torch.randn(6, 16, 2, 64, dtype=torch.bfloat16)
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    bad(epicute.DtypeError, "torch.int32", q, cache, cache, page_table=table.long())
    bad(epicute.ShapeError, r"must be \(2, 3\)", q, cache, cache, page_table=table[:1])
    bad(epicute.ShapeError, "batch, pages per sequence", q, cache, cache, page_table=table.view(-1))
    bad(epicute.ShapeError, "0 pages per sequence", q, cache, cache, page_table=table[:, :0])
    odd = torch.randn(6, 8, 2, 64, dtype=torch.bfloat16)
    bad(epicute.ShapeError, "multiples of 16", q, odd, odd, page_table=table)
    bad(epicute.DtypeError, "seqused_k has dtype", q, cache, cache, page_table=table, seqused_k=torch.ones(2))
    bad(epicute.ShapeError, r"seqused_k has shape \(3,\)", q, cache, cache, page_table=table,
        seqused_k=torch.ones(3, dtype=torch.int32))  # fmt: skip
    bad(epicute.ConfigError, "no output epilogue", q, cache, cache, page_table=table, epilogue=lambda o: o * 2,
        config={"num_splits": 2})  # fmt: skip


def test_reference_of_a_paged_cache_is_the_gathered_dense_one():
    """The reference gathers pages in table order and masks keys past seqused_k: the same as the
    dense call over each sequence's used keys (float64, so the paths agree to rounding)."""
    torch.manual_seed(0)
    q = torch.randn(3, 2, 8, 64, dtype=torch.float64)
    cache_k, cache_v = torch.randn(17, 16, 2, 64, dtype=torch.float64), torch.randn(17, 16, 2, 64, dtype=torch.float64)
    table = torch.randperm(17, dtype=torch.int32)[:15].view(3, 5)
    used = torch.tensor([0, 37, 80], dtype=torch.int32)
    call = check_attention_args(
        q.bfloat16(), cache_k.bfloat16(), cache_v.bfloat16(), causal=True, softmax_scale=None, require_cuda=False,
        page_table=table, seqused_k=used,
    )  # fmt: skip
    call.q, call.k, call.v = q, cache_k, cache_v
    got, lse = reference_attention(call, compute_dtype=torch.float64, out_dtype=torch.float64)
    assert torch.equal(got["D"][0], torch.zeros_like(got["D"][0])) and torch.isneginf(lse[0]).all()
    for b in (1, 2):
        k, v = (t[table[b].long()].reshape(-1, 2, 64)[: used[b]][None] for t in (cache_k, cache_v))
        sub = check_attention_args(
            q[b : b + 1].bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, softmax_scale=None, require_cuda=False
        )
        sub.q, sub.k, sub.v = q[b : b + 1], k, v
        want, want_lse = reference_attention(sub, compute_dtype=torch.float64, out_dtype=torch.float64)
        assert rel_err(got["D"][b : b + 1], want["D"]) < 1e-12 and rel_err(lse[b : b + 1], want_lse) < 1e-12


# --- issue 56, item 6: typed errors naming the argument ----------------------------------------------------------


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize(
    ("v_shape", "match"),
    [
        ((2, 8, 2, 64), r"they differ in seqlen \(16 != 8\); every key needs its value"),
        ((2, 16, 1, 64), r"they differ in heads \(2 != 1\)"),
        ((2, 16, 2, 128), r"they differ in head_dim \(64 != 128\); v's head_dim must equal k's"),
        ((1, 16, 2, 64), r"they differ in batch \(2 != 1\)"),
    ],
)
def test_k_and_v_mismatch_names_the_dimension(v_shape, match):
    q, k, _ = qkv(2, 16, 16, 4, 2, 64)
    bad(epicute.ShapeError, r"k is \(2, 16, 2, 64\) and v is .*" + match, q, k, torch.randn(v_shape).bfloat16())


def test_packed_k_and_v_mismatch_names_the_rows():
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    q = torch.randn(10, 2, 64).bfloat16()
    bad(epicute.ShapeError, r"they differ in total \(10 != 9\)", q, q, q[:9], cu_seqlens_q=cu, cu_seqlens_k=cu)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ("tile_n=64", r"config='tile_n=64' \(str\): pass a dict of AttentionConfig fields"),
        ([("tile_n", 64)], r"\(list\): pass a dict of AttentionConfig fields"),
        ({"bogus": 1}, r"unknown field 'bogus'; AttentionConfig fields are"),
        ({"tile_k": 64}, r"unknown field 'tile_k'; did you mean"),
        ({"tile_n": "64"}, r"config\['tile_n'\]='64' \(str\): AttentionConfig.tile_n takes a positive int"),
        ({"mma_atoms_mn": (0, 0)}, r"config\['mma_atoms_mn'\]=\(0, 0\)"),
        ({"pingpong": "no"}, r"AttentionConfig.pingpong takes True or False"),
        ({"head_dim": 128}, r"config\['head_dim'\]=128: head_dim is q's \(64\)"),
    ],
)
def test_malformed_configs_are_config_errors(config, match):
    q, k, v = qkv(1, 8, 8, 2, 2, 64)
    bad(epicute.ConfigError, match, q, k, v, config=config)
    with pytest.raises(epicute.ConfigError, match=match):
        epicute.explain_attention(meta(1, 8, 2, 64), meta(1, 8, 2, 64), meta(1, 8, 2, 64), config=config, file=None)


@pytest.mark.parametrize(("entry", "match"), [(7, r"page_table\[0, 1\] = 7"), (-1, r"page_table\[0, 1\] = -1")])
def test_reference_checks_page_table_entries(entry, match):
    """The kernel never reads the table on the host; the reference does, so it names an entry past the cache
    (an IndexError there before) or a negative one (which torch would have wrapped to the last page)."""
    q = torch.randn(1, 1, 2, 64).bfloat16()
    cache = torch.randn(4, 16, 2, 64).bfloat16()
    table = torch.tensor([[0, entry]], dtype=torch.int32)
    bad(epicute.ShapeError, match + r" is not a page of the cache: k and v hold 4 pages.*\[0, 4\)", q, cache, cache,
        page_table=table)  # fmt: skip


def test_reference_checks_packed_offsets_given_with_max_seqlens():
    q = torch.randn(10, 2, 64).bfloat16()
    cu, bad_cu = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 4, 12], dtype=torch.int32)
    bad(epicute.ShapeError, r"cu_seqlens_q runs from 0 to 12; it must run from 0 to the packed tensor's 10 rows", q,
        q, q, cu_seqlens_q=bad_cu, cu_seqlens_k=cu, max_seqlen_q=8, max_seqlen_k=6)  # fmt: skip


def test_reference_refuses_meta_operands_beside_cpu_inputs():
    q, k, v = qkv(1, 8, 8, 2, 2, 64)
    scaled = lambda s, b, h, qi, ki, w: s * w
    for w in (meta(2, dtype=torch.float32), meta(1, dtype=torch.float32)):
        bad(epicute.DeviceError, r"^operand 'w' is a meta tensor: backend='reference'", q, k, v, score_mod=scaled, w=w)
    bad(epicute.DeviceError, r"^operand 'w' is a meta tensor", q, k, v, epilogue=lambda o, w: o * w,
        w=meta(64, dtype=torch.float32))  # fmt: skip
    # explain plans with meta operands, one-element ones included (their value is not read)
    plan = epicute.explain_attention(meta(1, 8, 2, 64), meta(1, 8, 2, 64), meta(1, 8, 2, 64), score_mod=scaled,
                                     w=meta(1, dtype=torch.float32), file=None)  # fmt: skip
    assert plan.problem.head_dim == 64


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_hook_operands_may_be_named_like_the_inputs(name):
    q, k, v = qkv(1, 8, 8, 2, 2, 64)
    slopes = torch.rand(2)
    mod = eval(f"lambda s, b, h, qi, ki, {name}: s + {name} * (ki - qi)")
    got = epicute.attention(q, k, v, score_mod=mod, backend="reference", **{name: slopes})
    want = epicute.attention(q, k, v, score_mod=lambda s, b, h, qi, ki, w: s + w * (ki - qi), w=slopes,
                             backend="reference")  # fmt: skip
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["causal", "out", "config", "softmax_scale", "page_table", "return_lse", "file"])
def test_hook_operand_named_like_an_attention_parameter_is_refused(name):
    q, k, v = qkv(1, 8, 8, 2, 2, 64)
    match = rf"takes an operand named '{name}', which is epicute.attention's own parameter {name}=.*Rename"
    mod = eval(f"lambda s, b, h, qi, ki, {name}: s * {name}")
    bad(epicute.EpilogueError, "score_mod '<lambda>' " + match, q, k, v, score_mod=mod)
    bad(epicute.EpilogueError, "epilogue '<lambda>' " + match, q, k, v, epilogue=eval(f"lambda o, {name}: o * {name}"))
    if name == "causal":  # passed, it binds to causal= (a tensor there failed inside bool() before)
        bad(epicute.EpilogueError, match, q, k, v, score_mod=mod, causal=torch.rand(2))


def test_malformed_flags_out_dtypes_and_file():
    q, k, v = qkv(1, 8, 8, 2, 2, 64)
    bad(epicute.ConfigError, r"causal='yes': pass True or False", q, k, v, causal="yes")
    bad(epicute.ConfigError, r"return_lse=2: pass True or False", q, k, v, return_lse=2)
    bad(epicute.OutputError, r"out_dtypes is a list; pass a dict by output name", q, k, v, epilogue=lambda o: o,
        out_dtypes=[torch.float16])  # fmt: skip
    with pytest.raises(epicute.ConfigError, match=r"file='out.txt': pass 'stdout'"):
        epicute.explain_attention(meta(1, 8, 2, 64), meta(1, 8, 2, 64), meta(1, 8, 2, 64), file="out.txt")


@pytest.mark.parametrize(
    ("mod", "match"),
    [
        (lambda s, b, h, qi, ki: s**2, r"\*\* on a traced score_mod value is not supported.*x \* x"),
        (lambda s, b, h, qi, ki: s + ki % 2, r"% on a traced score_mod value"),
        (lambda s, b, h, qi, ki: s.exp(), r"a traced score_mod value has no attribute 'exp'.*ops.exp\(x\)"),
        (lambda s, b, h, qi, ki: {"new": s},
         r"score_mod '<lambda>' returned a dict \('new',\); a score_mod returns one value, the new score"),
        (lambda s, b, h, qi, ki: None,
         r"score_mod '<lambda>' returned NoneType, not a value computed from s, the indices and the operands"),
        (lambda s, b, h, qi, ki: qi * 1.0,
         r"returns a value per query row .*; it must return one score per \(query, key\): a function of s"),
        (lambda s, b, h, qi, ki: ki * 1.0, r"returns a value per key"),
        (lambda s, b, h, qi, ki: ops.row_sum(s), r"returns ops.row_sum\(...\), a reduction"),
        (lambda score: score, r"score_mod '<lambda>': takes the score first, then the positional indices"),
        (3, r"score_mod must be a function f\(score, b, h, q_idx, kv_idx, \*operands\); got int"),
    ],
)  # fmt: skip
def test_score_mod_errors_speak_of_the_score_mod(mod, match):
    """score_mod errors name the score_mod and its own parameters, never an epilogue's acc or D."""
    q, k, v = qkv(1, 8, 8, 2, 2, 64)
    with pytest.raises(epicute.EpilogueError, match=match) as info:
        epicute.attention(q, k, v, score_mod=mod, backend="reference")
    text = str(info.value)
    assert "acc" not in text.replace("accumulator", "") and "'D'" not in text and "epilogue value" not in text


# --- second pass of typed errors (issue 56) ---------------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda q: q[:1, :1, :1].expand(q.shape),
                                  lambda q: torch.empty(q.numel() // 2, dtype=q.dtype).as_strided(q.shape,
                                                                                                    (0, 64, 0, 1))])
def test_out_with_elements_sharing_memory_is_refused(make):
    # Before: torch's RuntimeError from the reference's copy_ (and stores racing each other in the kernel).
    q, k, v = qkv(2, 16, 16, 4, 2, 64)
    bad(epicute.OutputError, r"^out has shape \(2, 16, 4, 64\) and strides .*: some of its elements share memory",
        q, k, v, out=make(q))  # fmt: skip


@pytest.mark.parametrize(("used", "paged"), [([16, 17], False), ([-1, 4], False), ([0, 33], True)])
def test_reference_checks_seqused_k_values(used, paged):
    # Before: clamped to [0, keys] without a word; the kernel never reads them on the host.
    q, k, v = qkv(2, 1, 16, 4, 2, 64)
    kwargs = {}
    if paged:
        k, v = torch.randn(4, 16, 2, 64, dtype=torch.bfloat16), torch.randn(4, 16, 2, 64, dtype=torch.bfloat16)
        kwargs["page_table"] = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    b = next(i for i, n in enumerate(used) if not 0 <= n <= (32 if paged else 16))
    bad(epicute.ShapeError, rf"^seqused_k\[{b}\] = {used[b]}, but a sequence holds 0 to {32 if paged else 16} keys",
        q, k, v, seqused_k=torch.tensor(used, dtype=torch.int32), **kwargs)  # fmt: skip


def test_packed_max_seqlens_must_bound_the_sequences():
    # Before: a max_seqlen_q shorter than a sequence passed (the kernel leaves its rows past it unwritten, the
    # reference computed them all); one longer than the packed tensor would size the kernel's grid from it.
    q, k = torch.randn(40, 4, 64, dtype=torch.bfloat16), torch.randn(50, 2, 64, dtype=torch.bfloat16)
    cu = {"cu_seqlens_q": torch.tensor([0, 15, 40], dtype=torch.int32),
          "cu_seqlens_k": torch.tensor([0, 20, 50], dtype=torch.int32)}  # fmt: skip
    bad(epicute.ShapeError, r"^max_seqlen_q=10, but sequence 1 of cu_seqlens_q has 25 rows", q, k, k,
        max_seqlen_q=10, max_seqlen_k=30, **cu)  # fmt: skip
    bad(epicute.ShapeError, r"^max_seqlen_k=29, but sequence 1 of cu_seqlens_k has 30 rows", q, k, k,
        max_seqlen_q=25, max_seqlen_k=29, **cu)  # fmt: skip
    bad(epicute.ConfigError, r"^max_seqlen_q=1000000000000, but the packed q has 40 rows", q, k, k,
        max_seqlen_q=10**12, max_seqlen_k=30, **cu)  # fmt: skip
    assert epicute.attention(q, k, k, max_seqlen_q=25, max_seqlen_k=30, backend="reference", **cu).shape == q.shape


def test_softmax_scale_is_a_real_number_not_a_flag():
    q, k, v = qkv(1, 16, 16, 2, 2, 64)
    bad(epicute.ConfigError, r"^softmax_scale=True: must be a positive number", q, k, v, softmax_scale=True)
