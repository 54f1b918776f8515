"""Packed variable-length attention on the CPU: argument checks, explain, the reference's packing, compiles.

The GPU kernels are checked against the reference in ``test_varlen_gpu.py``; here the reference itself
is checked to be the dense attention of each sequence (its own ``b`` index for the score_mod), and
every refusal is a typed error raised before anything runs.
"""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.attention.backward import BackwardVariant, compile_backward, preprocess_reference
from epicute.attention.backward_plan import backward_config, stat_rows_start
from epicute.attention.launch import AttentionVariant, compile_attention
from epicute.attention.plan import default_config
from epicute.errors import ConfigError, DtypeError, EpilogueError, ShapeError
from tests.conftest import rel_err


def cu(*lengths, device="cpu"):
    return torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)


def packed(lengths_q, lengths_k, hq=4, hkv=2, d=64, device="cpu"):
    q = torch.randn(sum(lengths_q), hq, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(sum(lengths_k), hkv, d, device=device, dtype=torch.bfloat16)
    v = torch.randn(sum(lengths_k), hkv, d, device=device, dtype=torch.bfloat16)
    return q, k, v, {"cu_seqlens_q": cu(*lengths_q, device=device), "cu_seqlens_k": cu(*lengths_k, device=device)}


@pytest.mark.parametrize("causal", (False, True))
def test_reference_is_each_sequence_attended_alone(causal):
    def per_sequence(s, b, h, q_idx, kv_idx):
        return s - 0.5 * b + 0.01 * (kv_idx - q_idx)

    lengths_q, lengths_k = (5, 0, 17, 1), (9, 3, 17, 0)
    q, k, v, varlen = packed(lengths_q, lengths_k)
    o, lse = epicute.attention(q, k, v, causal=causal, score_mod=per_sequence, return_lse=True, backend="reference",
                               **varlen)  # fmt: skip
    assert o.shape == q.shape and lse.shape == (4, sum(lengths_q))
    starts_q, starts_k = varlen["cu_seqlens_q"].tolist(), varlen["cu_seqlens_k"].tolist()
    for b in range(len(lengths_q)):
        qs, ks = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        if not lengths_q[b]:
            continue
        if not lengths_k[b]:  # no keys: O = 0 and LSE = -inf, as flash-attn gives
            assert torch.all(o[qs] == 0) and torch.all(torch.isneginf(lse[:, qs]))
            continue

        def shifted(s, bb, h, q_idx, kv_idx, b=b):  # the dense call's b is 0: the sequence's own index in
            return s - 0.5 * b + 0.01 * (kv_idx - q_idx)

        ref, ref_lse = epicute.attention(q[None, qs], k[None, ks], v[None, ks], causal=causal, score_mod=shifted,
                                         return_lse=True, backend="reference")  # fmt: skip
        assert rel_err(o[qs], ref[0]) <= 1e-2
        finite = torch.isfinite(ref_lse[0])
        assert torch.equal(torch.isneginf(lse[:, qs]), ~finite)
        assert rel_err(lse[:, qs][finite], ref_lse[0][finite]) <= 1e-6


def test_explain_on_meta_tensors_needs_the_lengths():
    q = torch.empty(5017, 16, 128, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(5017, 4, 128, dtype=torch.bfloat16, device="meta")
    offsets = torch.empty(4, dtype=torch.int32, device="meta")
    plan = epicute.explain_attention(q, kv, kv, causal=True, cu_seqlens_q=offsets, cu_seqlens_k=offsets,
                                     max_seqlen_q=4000, max_seqlen_k=4000, file=None)  # fmt: skip
    assert plan.problem.varlen and plan.problem.batch == 3 and plan.problem.seqlen_q == 4000
    assert plan.config.pack_gqa == 1 and not plan.config.split_kv  # no decode plan for packed sequences
    with pytest.raises(ConfigError, match="max_seqlen_q"):
        epicute.explain_attention(q, kv, kv, cu_seqlens_q=offsets, cu_seqlens_k=offsets, file=None)


def test_lengths_read_from_the_offsets_are_checked():
    q, k, v, varlen = packed((5, 7), (4, 4))
    plan = epicute.explain_attention(q, k, v, file=None, **varlen)
    assert (plan.problem.seqlen_q, plan.problem.seqlen_k) == (7, 4)
    bad = {**varlen, "cu_seqlens_q": torch.tensor([0, 9, 13], dtype=torch.int32)}
    with pytest.raises(ShapeError, match="cu_seqlens_q runs from 0 to 13"):
        epicute.explain_attention(q, k, v, file=None, **bad)
    bad = {**varlen, "cu_seqlens_k": torch.tensor([0, 9, 8], dtype=torch.int32)}
    with pytest.raises(ShapeError, match="decreases at sequence 1"):
        epicute.explain_attention(q, k, v, file=None, **bad)


def test_bad_arguments_are_typed_errors():
    q, k, v, varlen = packed((5, 7), (4, 4))
    with pytest.raises(ShapeError, match="packed \\(total, heads, head_dim\\)"):
        epicute.attention(q[None], k[None], v[None], backend="reference", **varlen)
    with pytest.raises(ConfigError, match="pass both"):
        epicute.attention(q, k, v, backend="reference", cu_seqlens_q=varlen["cu_seqlens_q"])
    with pytest.raises(DtypeError, match="int32"):
        epicute.attention(q, k, v, backend="reference", **{**varlen, "cu_seqlens_k": cu(4, 4).long()})
    with pytest.raises(ShapeError, match="cu_seqlens_k has shape"):
        epicute.attention(q, k, v, backend="reference", **{**varlen, "cu_seqlens_k": cu(4, 2, 2)})
    with pytest.raises(ConfigError, match="max_seqlen_q"):
        epicute.attention(q, k, v, backend="reference", max_seqlen_q=-1, **varlen)
    with pytest.raises(ConfigError, match="go with cu_seqlens"):
        epicute.attention(q[None], k[None], v[None], backend="reference", max_seqlen_q=7)
    with pytest.raises(ConfigError, match="page_table/seqused_k"):
        epicute.attention(q, k, v, backend="reference", seqused_k=cu(1), **varlen)
    with pytest.raises(ConfigError, match="no output epilogue"):
        epicute.attention(q, k, v, backend="reference", epilogue=lambda o: o * 2, **varlen)
    with pytest.raises(EpilogueError):  # the hooks' own checks still run
        epicute.attention(q, k, v, backend="reference", unknown=1.0, **varlen)


def test_backward_preprocess_starts_each_sequence_on_a_block():
    lengths = [10, 0, 130, 1]
    cu = torch.tensor([0, 10, 10, 140, 141], dtype=torch.int32)
    o, do = torch.randn(141, 3, 64), torch.randn(141, 3, 64)
    lse, dlse = torch.randn(3, 141), torch.randn(3, 141)
    lse[1, 4] = float("-inf")  # a row that saw no key
    lse_log2, dsum = preprocess_reference(o, do, lse, 128, dlse, cu)
    # Sequence b from the block boundary stat_rows_start gives; the last one's block fits.
    starts = [stat_rows_start(int(cu[b]), b, 128) for b in range(4)]
    assert starts == [0, 128, 256, 512] and lse_log2.shape == dsum.shape == (1, 3, 640)
    want_d = torch.einsum("shd,shd->hs", do, o) - dlse
    filled = torch.zeros(640, dtype=torch.bool)
    for b, n in enumerate(lengths):
        rows, src = slice(starts[b], starts[b] + n), slice(int(cu[b]), int(cu[b]) + n)
        filled[rows] = True
        finite = torch.isfinite(lse[:, src])
        assert torch.equal(torch.isposinf(lse_log2[0, :, rows]), ~finite)
        assert rel_err(lse_log2[0, :, rows][finite], lse[:, src][finite] * 1.4426950408889634) <= 1e-6
        assert rel_err(dsum[0, :, rows], want_d[:, src]) <= 1e-6
    assert torch.isposinf(lse_log2[..., ~filled]).all() and (dsum[..., ~filled] == 0).all()


@pytest.mark.compile
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_packed_variants_compile_without_spills(causal, ptxas_report):
    compile_attention(AttentionVariant(default_config(128, causal), "bf16", causal, varlen=True))
    compile_backward(BackwardVariant(backward_config(64 if causal else 128), "bf16", causal, varlen=True))
    spills, injected_fences = ptxas_report()
    assert spills == [0, 0] and injected_fences == []
