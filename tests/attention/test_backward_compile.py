"""The attention backward on the CPU: its variants compile for sm_90a (no spills where planned),
its plan and smem fit, and calls it does not cover are refused with the fix, before any launch."""

from __future__ import annotations

import pytest
import torch

from epicute import ops
from epicute.attention.backward import (
    BackwardVariant,
    PostprocessVariant,
    PreprocessVariant,
    compile_backward,
    compile_postprocess,
    compile_preprocess,
    preprocess_reference,
)
from epicute.attention.backward_plan import (
    MAX_GRID_BAND,
    BackwardConfig,
    backward_config,
    backward_grid,
    backward_smem_layout,
    grid_band,
    heads_per_cta,
)
from epicute.attention.prepare import hooks_of, prepare
from epicute.attention.validate import check_attention_args
from epicute.errors import ConfigError

SMEM_LIMIT = 227 * 1024


def meta_call(d=128, hq=4, hkv=4, causal=False, **kwargs):
    q = torch.empty(2, 1000, hq, d, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 777, hkv, d, dtype=torch.bfloat16, device="meta")
    return check_attention_args(q, k, k, causal=causal, softmax_scale=None, require_cuda=False, **kwargs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_variants_compile_without_spills(d, causal, ptxas_report):
    compile_backward(BackwardVariant(backward_config(d), "bf16", causal))
    spills, injected_fences = ptxas_report()
    assert spills == [0] and injected_fences == []


def test_score_mod_backward_and_fp16_compile():
    def softcap(s, b, h, q_idx, kv_idx, slopes, cap):
        return cap * ops.tanh((s + slopes * (kv_idx - q_idx)) / cap)

    call = meta_call()
    score, _ = hooks_of(call, softcap, None, {"slopes": torch.ones(4), "cap": 30.0})
    compile_backward(BackwardVariant(backward_config(128, score_mod=True), "bf16", True, score.fusion))
    compile_backward(BackwardVariant(backward_config(64), "fp16", False))
    compile_backward(BackwardVariant(backward_config(256, score_mod=True), "fp16", True, score.fusion))
    # The per-head vectors' gradients: their partial sums leave the kernel through fp32 tensors.
    compile_backward(
        BackwardVariant(backward_config(128, score_mod=True), "bf16", True, score.fusion, operand_grads=True)
    )


@pytest.mark.parametrize("d,causal,varlen", [(128, True, False), (64, False, True), (256, True, True)])
def test_deterministic_variants_compile_without_spills(d, causal, varlen, ptxas_report):
    compile_backward(BackwardVariant(backward_config(d), "bf16", causal, varlen=varlen, deterministic=True))
    spills, injected_fences = ptxas_report()
    assert spills == [0] and injected_fences == []


@pytest.mark.parametrize("d,varlen", [(64, False), (128, False), (128, True), (256, False), (256, True)])
def test_head_split_variants_and_their_key_postprocess_compile_without_spills(d, varlen, ptxas_report):
    # dK and dV reduce-added in fp32 fragment order; the postprocess un-permutes key blocks (tile_n rows).
    cfg = backward_config(d)
    compile_backward(BackwardVariant(cfg, "bf16", True, varlen=varlen, heads_per_cta=1, head_split=True))
    compile_postprocess(PostprocessVariant("bf16", d, cfg.tile_n, varlen))
    spills, injected_fences = ptxas_report()
    # At head_dim 256 (dK and dV: 128 fp32 registers a thread) ptxas parks prologue values in local memory until
    # the epilogue: one word (packed: two), each stored once before the query loop and loaded after it (the SASS
    # has no local access inside a loop: bench/NOTES.md); a spill inside the loop would show as more.
    parked = {(256, False): 4, (256, True): 8}.get((d, varlen), 0)
    assert spills == [parked, 0] and injected_fences == []


@pytest.mark.parametrize(
    "d,tile_m,varlen,has_dlse,fragments", [(128, 64, False, False, True), (64, 128, True, True, True),
                                           (256, 64, False, True, False)]
)  # fmt: skip
def test_preprocess_variants_compile_without_spills(d, tile_m, varlen, has_dlse, fragments, ptxas_report):
    compile_preprocess(PreprocessVariant("bf16", d, tile_m, varlen, has_dlse, fragments))
    spills, injected_fences = ptxas_report()
    assert spills == [0] and injected_fences == []


@pytest.mark.parametrize(
    "dtype,d,varlen", [("bf16", 128, False), ("fp16", 64, True), ("bf16", 128, True), ("bf16", 64, False)]
)
def test_postprocess_variants_compile_without_spills(dtype, d, varlen, ptxas_report):
    compile_postprocess(PostprocessVariant(dtype, d, backward_config(d).tile_m, varlen))
    spills, injected_fences = ptxas_report()
    assert spills == [0] and injected_fences == []


def test_dq_fragment_order_is_planned_where_it_measured_faster():
    assert backward_config(64).dq_fragment_order and backward_config(128).dq_fragment_order
    assert not backward_config(256).dq_fragment_order


def test_causal_grids_walk_bands_of_heads_that_fit_l2():
    mib = 1 << 20
    cfg = backward_config(128)
    # Without a causal mask every key block does the same work: one (head, batch) pair at a time.
    assert grid_band(cfg, False, 1, 8192, 64, 50 * mib) == 1
    # Causal: each pair streams Q, dO (bf16), dQ's fp32 sum, LSE and D: 8192 x (128 x 8 + 8) B = 8.06 MiB,
    # 6 of which fit 50 MiB of L2; bands are powers of two.
    assert grid_band(cfg, True, 1, 8192, 64, 50 * mib) == 4
    assert grid_band(cfg, True, 1, 4096, 64, 50 * mib) == MAX_GRID_BAND  # 12 fit: capped
    assert grid_band(cfg, True, 4, 8192, 16, 50 * mib) == 1  # a GQA group of 4 heads streams 32 MiB
    assert grid_band(cfg, True, 1, 1000, 3, 50 * mib) == 3  # never wider than the pairs
    assert grid_band(cfg, True, 1, 1 << 20, 8, 50 * mib) == 1  # nothing fits: one pair
    assert grid_band(backward_config(64), True, 1, 16384, 64, 50 * mib) == 4  # 16384 x (64 x 8 + 8) B
    # Up to 4K queries the widest band, whatever L2 holds: the launch's tail outweighs it there.
    assert grid_band(cfg, True, 7, 4096, 8, 50 * mib) == MAX_GRID_BAND  # Qwen2.5-7B's 7 heads: 28 MiB a pair
    assert grid_band(cfg, True, 7, 4097, 8, 50 * mib) == 1
    assert grid_band(cfg, True, 7, 4096, 5, 50 * mib) == 5  # never wider than the pairs


def test_causal_gqa_groups_split_over_ctas_until_two_pairs_fit_l2():
    mib = 1 << 20
    cfg = backward_config(128)
    # Per query head at 8 K: 8.06 MiB streamed. Two pairs of 8 heads (129 MiB) or 4 (64.5) do not fit 50 MiB;
    # of 2 (32.3) they do.
    assert heads_per_cta(cfg, True, False, 8, 8192, 50 * mib) == 2
    assert heads_per_cta(cfg, True, False, 16, 8192, 50 * mib) == 2
    assert heads_per_cta(cfg, True, False, 2, 8192, 50 * mib) == 2  # fits: the whole group
    assert heads_per_cta(cfg, True, False, 8, 32768, 50 * mib) == 1  # at least one head
    assert heads_per_cta(cfg, True, False, 6, 8192, 50 * mib) == 3  # 3 fits twice
    # Odd shares: halved (rounding up: the last share is short) only while one pair's stream exceeds L2.
    assert heads_per_cta(cfg, True, False, 7, 8192, 50 * mib) == 2  # 56.4 MiB alone: 2 + 2 + 2 + 1
    assert heads_per_cta(cfg, True, False, 7, 16384, 50 * mib) == 1
    assert heads_per_cta(cfg, True, False, 7, 4096, 50 * mib) == 7  # 28.2 MiB: fits alone
    assert heads_per_cta(cfg, True, False, 3, 16384, 50 * mib) == 3  # 48.4 MiB: fits alone
    assert heads_per_cta(cfg, True, False, 24, 16384, 50 * mib) == 3  # 24 -> 12 -> 6 -> 3, which fits alone
    # Without a causal mask or deterministic: the whole group.
    assert heads_per_cta(cfg, False, False, 8, 32768, 50 * mib) == 8
    assert heads_per_cta(cfg, True, True, 8, 32768, 50 * mib) == 8
    # head_dim 256 (Qwen3-Next's 8:1 at 8 K): 16.1 MiB a head, so one head a CTA.
    assert heads_per_cta(backward_config(256), True, False, 8, 8192, 50 * mib) == 1
    # The launch (and explain) of Llama-3-70B's 8:1 at 8 K: 2 heads a CTA, 4 CTAs per key/value head and key block,
    # two (head share, batch) pairs at a time.
    q, kv = (torch.empty(1, 8192, h, 128, dtype=torch.bfloat16, device="meta") for h in (64, 8))
    call = check_attention_args(q, kv, kv, causal=True, softmax_scale=None, require_cuda=False)
    variant = prepare(call).backward_variant()
    assert backward_grid(variant, call.problem, 50 * mib) == (2, 32, 2)
    assert backward_grid(prepare(call).backward_variant(deterministic=True), call.problem, 50 * mib) == (8, 8, 1)


def test_head_dim_128_takes_80_query_steps_with_dq_transposed_unless_a_score_mod_would_spill():
    plain, modded = backward_config(128), backward_config(128, score_mod=True)
    assert (plain.tile_m, plain.dq_swap_ab, plain.dq_split_rows) == (80, True, False)
    assert (modded.tile_m, modded.dq_swap_ab) == (64, False)
    assert backward_config(64).dq_split_rows and not backward_config(64).dq_swap_ab


@pytest.mark.parametrize("score_mod", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_smem_fits(d, score_mod):
    cfg = backward_config(d, score_mod)
    layout = backward_smem_layout(cfg)
    assert layout.total_bytes <= SMEM_LIMIT
    # Each ring stage of LSE and of D is a TMA load's destination: 128-byte aligned (80 fp32 are 320 bytes).
    offsets = layout.offsets()
    for name in ("sLSE", "sD"):
        assert offsets[name] % 128 == 0 and cfg.stat_stage_floats * 4 % 128 == 0
        assert cfg.stat_stage_floats >= cfg.tile_m


def test_backward_config_refuses_what_the_kernel_cannot_run():
    with pytest.raises(ConfigError, match="head_dim=96"):
        BackwardConfig(head_dim=96).validate()
    with pytest.raises(ConfigError, match="tile_n=128: at head_dim 256"):
        BackwardConfig(head_dim=256).validate()
    with pytest.raises(ConfigError, match="tile_n=64"):
        BackwardConfig(head_dim=128, tile_n=64).validate()
    with pytest.raises(ConfigError, match="tile_m"):
        BackwardConfig(tile_m=128).validate()
    with pytest.raises(ConfigError, match="tile_m=80"):
        BackwardConfig(head_dim=64, tile_m=80).validate()
    with pytest.raises(ConfigError, match="stages"):
        BackwardConfig(stages=3).validate()


def test_prepare_plans_the_backward_or_says_why_not():
    variant = prepare(meta_call(hq=8, hkv=2, causal=True)).backward_variant()
    assert variant.causal and variant.config.head_dim == 128
    assert variant.key() != prepare(meta_call(hq=8, hkv=2)).backward_variant().key()
    deterministic = prepare(meta_call(hq=8, hkv=2, causal=True)).backward_variant(deterministic=True)
    assert deterministic.deterministic and deterministic.key() != variant.key()

    def alibi(s, b, h, q_idx, kv_idx, slopes):
        return s + slopes * (kv_idx - q_idx)

    learned = prepare(meta_call(), alibi, operands={"slopes": torch.ones(4)}).backward_variant(operand_grads=True)
    assert learned.operand_grads and "+operand grads" in learned.key().label
    assert not prepare(meta_call()).backward_variant(operand_grads=True).operand_grads  # no score_mod: none
    wide = prepare(meta_call(d=256)).backward_variant().config
    assert wide.split_head_dim and (wide.tile_n, wide.tile_m, wide.stages) == (64, 64, 1)
    with pytest.raises(ConfigError, match="epilogue"):
        prepare(meta_call(), epilogue=lambda o: {"D": o * 2.0}).backward_variant()


def test_preprocess_pads_lse_and_hides_rows_without_keys():
    o, do = torch.randn(2, 70, 3, 64), torch.randn(2, 70, 3, 64)
    lse = torch.randn(2, 3, 70)
    lse[0, 1, 5] = float("-inf")
    lse_log2, dsum = preprocess_reference(o, do, lse, 64)
    assert lse_log2.shape == dsum.shape == (2, 3, 128)
    assert torch.isposinf(lse_log2[..., 70:]).all() and (dsum[..., 70:] == 0).all()
    assert torch.isposinf(lse_log2[0, 1, 5])
    finite = torch.isfinite(lse)
    rel = (lse_log2[..., :70][finite] - lse[finite] * 1.4426950408889634).abs().max() / lse.abs().max()
    assert rel < 1e-6
    want = (do.double() * o.double()).sum(-1).transpose(1, 2)
    assert ((dsum[..., :70].double() - want).norm() / want.norm()).item() < 1e-6
