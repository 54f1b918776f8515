"""Compile the attention kernel for sm_90a with fake tensors (no GPU needed).

Covers every head_dim x causal with the planner's configs (GQA needs no variant
of its own: the head ratio is a runtime value, checked on the device), fp16, a
non-default config, and one variant each with a fused score_mod and epilogue.
"""

from __future__ import annotations

import pytest
import torch

from epicute import ops
from epicute.attention.api import hooks_of
from epicute.attention.launch import AttentionVariant, compile_attention
from epicute.attention.plan import default_config
from epicute.attention.validate import check_attention_args

pytestmark = pytest.mark.compile


def fusions(score_mod=None, epilogue=None, **operands):
    from epicute.attention.kernel_sm90 import AttentionFusion

    q = torch.empty(2, 100, 8, 128, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(2, 100, 2, 128, dtype=torch.bfloat16, device="meta")
    call = check_attention_args(q, kv, kv, causal=True, softmax_scale=None, require_cuda=False)
    score, epi = hooks_of(call, score_mod, epilogue, operands)
    return (
        None if score is None else AttentionFusion(score.graph, score.signature),
        None if epi is None else AttentionFusion(epi.graph, epi.signature),
    )


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("d", (64, 128, 256))
def test_planned_variants_compile(d, causal, ptxas_report):
    assert callable(compile_attention(AttentionVariant(default_config(d, causal), "bf16", causal)))
    # The planner's variants fit their registers (d64: 3 warpgroups x 160) with no spills, and
    # no WGMMA operand is written after its fence (ptxas would inject another: warning C7519).
    spills, injected_fences = ptxas_report()
    assert spills == [0] and injected_fences == []


def test_fp16_and_custom_config_compile():
    cfg = default_config(128, False, tile_n=64, stages=3, pingpong=False, rescale_o_early=True)
    assert callable(compile_attention(AttentionVariant(cfg, "fp16", False)))


def test_score_mod_compiles():
    def alibi_softcap(s, b, h, q_idx, kv_idx, slopes, cap):
        return cap * ops.tanh((s + slopes * (kv_idx - q_idx)) / cap)

    score, _ = fusions(alibi_softcap, slopes=torch.rand(8), cap=30.0)
    assert callable(compile_attention(AttentionVariant(default_config(128, True), "bf16", True, score_mod=score)))


def test_epilogue_compiles():
    def gated(o, gate, bias, alpha):
        return alpha * o * ops.sigmoid(gate) + bias

    _, epi = fusions(epilogue=gated, gate=torch.randn(2, 100, 8, 128), bias=torch.randn(128), alpha=2.0)
    assert callable(compile_attention(AttentionVariant(default_config(128, False), "bf16", False, epilogue=epi)))
