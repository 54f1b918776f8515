"""The attention planner: default configs, the whole-rows-per-warp check, smem accounting."""

from __future__ import annotations

from dataclasses import replace

import pytest

from epicute.attention.plan import (
    AttentionConfig,
    AttentionProblem,
    attention_smem_layout,
    attention_smem_total,
    default_config,
    lpt_heads_per_band,
    plan_attention,
    render_attention_plan,
    row_ownership,
)
from epicute.errors import ConfigError
from epicute.runtime.target import H100_SXM


@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True))
def test_default_configs_are_valid_and_fit(d, causal):
    cfg = default_config(d, causal)
    cfg.validate(H100_SXM)
    assert attention_smem_total(cfg) <= H100_SXM.smem_per_cta_bytes
    own = row_ownership(cfg)
    assert own.whole_rows
    # Every warp holds 16 consecutive rows; together they cover the tile once.
    rows = sorted(r for _, _, lo, hi in own.warps for r in range(lo, hi + 1))
    assert rows == list(range(cfg.tile_m))
    assert all(hi - lo == 15 for _, _, lo, hi in own.warps)


def test_layout_splitting_rows_across_warps_is_refused():
    cfg = AttentionConfig(tile_m=128, tile_n=128, mma_atoms_mn=(1, 2))
    own = row_ownership(cfg)
    assert not own.whole_rows and "spread over warps" in own.problem
    with pytest.raises(ConfigError, match="reduces a score row inside one warp"):
        cfg.validate(H100_SXM)


def test_config_errors():
    with pytest.raises(ConfigError, match="shared memory"):
        default_config(256, False, tile_n=128, stages=2).validate(H100_SXM)
    with pytest.raises(ConfigError, match="tile_n"):
        AttentionConfig(tile_n=72).validate(H100_SXM)
    with pytest.raises(ConfigError, match="pingpong"):
        AttentionConfig(tile_m=64, mma_atoms_mn=(1, 1)).validate(H100_SXM)
    with pytest.raises(ConfigError, match="head_dim"):
        default_config(96, False)


def test_plan_and_render():
    problem = AttentionProblem(batch=2, seqlen_q=1000, seqlen_k=4097, heads_q=8, heads_kv=1, head_dim=256, causal=True)
    plan = plan_attention(problem, H100_SXM)
    # 128 tiles <= 132 SMs: one persistent CTA each, claiming further tiles from the counter.
    assert plan.num_tiles == 8 * 8 * 2 and plan.grid == (8 * 8 * 2, 1, 1)
    text = render_attention_plan(plan)
    assert "GQA 8:1" in text and "rows 0-15, all 80 columns" in text and "total" in text
    # 32 MiB of K+V at 4097 keys x 256 x 2 B x 2 tensors: 7 heads per band.
    assert lpt_heads_per_band(256, 4097) == 7 and "bands of 7 heads" in text
    assert "persistent over 128 tiles (each CTA claims its next from an atomic counter)" in text
    assert "one CTA per tile" in render_attention_plan(plan_attention(problem, H100_SXM, persistent=False))
    assert "m-block fastest" in render_attention_plan(plan_attention(problem, H100_SXM, lpt_order=False))
    # Persistent: one CTA per SM (132 on H100) walks the 128 tiles, or fewer CTAs when there are fewer tiles.
    persistent = plan_attention(replace(problem, batch=4), H100_SXM, dynamic_tiles=False)
    assert persistent.grid == (132, 1, 1) and "persistent over 256 tiles (strided)" in render_attention_plan(persistent)
    assert plan_attention(problem, H100_SXM, persistent=True).grid == (128, 1, 1)
    assert problem.flops == 4 * 2 * 8 * 1000 * 4097 * 256 // 2


def test_register_split_follows_the_warpgroup_count():
    # d64 runs three consumer warpgroups (192 rows): 3 x 160 + 32 registers per thread slot fill an SM.
    cfg = default_config(64, False)
    assert (cfg.tile_m, cfg.num_mma_warpgroups, cfg.producer_regs, cfg.consumer_regs) == (192, 3, 32, 160)
    # Pinning two warpgroups brings their own budget unless the budget is pinned too.
    two = default_config(64, False, tile_m=128)
    assert (two.mma_atoms_mn, two.producer_regs, two.consumer_regs) == ((2, 1), 24, 240)
    assert default_config(64, False, tile_m=128, consumer_regs=200).consumer_regs == 200
    for cfg in (default_config(d, causal) for d in (64, 128, 256) for causal in (False, True)):
        cfg.validate_registers()
    with pytest.raises(ConfigError, match="an SM has 65536"):
        default_config(64, False, consumer_regs=176).validate(H100_SXM)


def test_lpt_heads_per_band_is_at_least_one():
    assert lpt_heads_per_band(128, 10**7) == 1
    assert lpt_heads_per_band(64, 1) == 32 * 1024 * 1024 // 256


def test_k_release_point_is_a_planner_choice():
    # Late K release keeps the PV wait below the softmax (measured faster with causal masking:
    # bench/NOTES.md, 'The K release, by mask');
    # without it the rings are the bottleneck and stages go back to the producer as S lands.
    for d in (64, 128, 256):
        assert default_config(d, True).release_k_late
        assert not default_config(d, False).release_k_late
        # Persistent CTAs everywhere, claiming their tiles from a counter.
        assert default_config(d, False).persistent and default_config(d, True).persistent
        assert default_config(d, True).dynamic_tiles and default_config(d, False).dynamic_tiles
    assert default_config(128, False, release_k_late=True).release_k_late  # still overridable
    problem = AttentionProblem(batch=1, seqlen_q=512, seqlen_k=512, heads_q=2, heads_kv=2, head_dim=256)
    assert "K stages released when S lands" in render_attention_plan(plan_attention(problem, H100_SXM))
    causal = AttentionProblem(batch=1, seqlen_q=512, seqlen_k=512, heads_q=2, heads_kv=2, head_dim=128, causal=True)
    assert "K stages released after the softmax" in render_attention_plan(plan_attention(causal, H100_SXM))
    assert default_config(256, False).key() != default_config(256, False, release_k_late=True).key()


def test_lazy_rescale_is_a_planner_choice():
    # Skipping O's rescale pays for its vote and branch where O is large (d128, d256), not at d64.
    for causal in (False, True):
        assert default_config(128, causal).lazy_rescale and default_config(256, causal).lazy_rescale
        assert not default_config(64, causal).lazy_rescale
    assert default_config(64, False, lazy_rescale=True).lazy_rescale  # still overridable
    assert default_config(128, False).key() != default_config(128, False, lazy_rescale=False).key()
    lazy = AttentionProblem(batch=1, seqlen_q=512, seqlen_k=512, heads_q=2, heads_kv=2, head_dim=128)
    eager = AttentionProblem(batch=1, seqlen_q=512, seqlen_k=512, heads_q=2, heads_kv=2, head_dim=64)
    assert "rescale         lazy" in render_attention_plan(plan_attention(lazy, H100_SXM))
    assert "rescale         every block" in render_attention_plan(plan_attention(eager, H100_SXM))


def test_outputs_get_their_own_buffer_where_smem_allows():
    """A persistent prefill launch stages O in a buffer of its own, so Q's goes back after the last QK^T, wherever
    the smem holds both (bf16 d256's two 80-key stages leave no room); decode tiles and one CTA per tile keep
    staging in Q's buffer. fp8 Q's buffer then holds fp8 Q alone."""
    for d in (64, 128, 256):
        for causal in (False, True):
            for dtype in ("bf16", "fp8e4m3"):
                cfg = default_config(d, causal, dtype=dtype, target=H100_SXM)
                assert cfg.o_buffer == (dtype != "bf16" or d != 256), (d, causal, dtype)
                cfg.validate(H100_SXM, dtype)
                table = {item.name: item.bytes for item in attention_smem_layout(cfg, dtype).table()}
                staged = 2 * cfg.tile_m * d  # bf16 O
                assert table.get("outputs") == (staged if cfg.o_buffer else None)
                q_bytes = table["Q"] if cfg.o_buffer else table["Q (then outputs)"]
                assert q_bytes == (staged // 2 if cfg.o_buffer and dtype != "bf16" else staged)
    assert not default_config(128, False, persistent=False).o_buffer
    assert not default_config(128, False, o_buffer=False).o_buffer  # still overridable
    assert default_config(128, False).key() != default_config(128, False, o_buffer=False).key()
    with pytest.raises(ConfigError, match=r"shared memory: .* o_buffer=False \(stage O in Q's buffer\)"):
        default_config(256, False, o_buffer=True).validate(H100_SXM)
    assert not plan_attention(_decode(), H100_SXM).config.o_buffer  # split-KV: partials, no staging
    assert not plan_attention(_decode(batch=64, seqlen_k=8192), H100_SXM).config.o_buffer
    text = render_attention_plan(plan_attention(AttentionProblem(2, 2048, 2048, 16, 16, 128), H100_SXM))
    assert "outputs staged in their own 128x128 buffer" in text and "handed back after the tile's last QK^T" in text


def test_dynamic_tiles_need_persistent_ctas():
    with pytest.raises(ConfigError, match="dynamic_tiles=True needs persistent=True"):
        default_config(128, True, persistent=False, dynamic_tiles=True).validate(H100_SXM)
    assert not default_config(128, True, persistent=False).dynamic_tiles  # one CTA per tile, as asked
    assert default_config(128, True).key() != default_config(128, True, dynamic_tiles=False).key()


def _decode(batch=1, seqlen_q=1, seqlen_k=131072, heads_q=32, heads_kv=8, head_dim=128, **kw):
    return AttentionProblem(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, **kw)


def test_decode_plans_pack_gqa_and_split_while_sms_idle():
    plan = plan_attention(_decode(), H100_SXM)
    c = plan.config
    # 8 KV heads x 1 sequence leave 124 SMs idle: 16 splits of 64 128-key blocks fill 128 of them (each runs
    # them as 64-key blocks in a CTA sized so that two fit an SM).
    assert (c.tile_m, c.tile_n, c.pack_gqa, c.split_kv, c.num_splits) == (64, 64, 4, True, 16)
    assert plan.num_tiles == 128 and plan.rows == 4
    # 64 sequences x 8 KV heads already fill the GPU: no split.
    c = plan_attention(_decode(batch=64, seqlen_k=8192), H100_SXM).config
    assert c.pack_gqa == 4 and not c.split_kv and c.num_splits == 1
    # Too few key blocks to split: at least MIN_BLOCKS_PER_SPLIT each.
    assert not plan_attention(_decode(seqlen_k=500), H100_SXM).config.split_kv
    # Prefill shapes keep the FA3 tiles.
    c = plan_attention(_decode(seqlen_q=4096, seqlen_k=4096), H100_SXM).config
    assert (c.tile_m, c.pack_gqa, c.split_kv) == (128, 1, False)
    # An output epilogue keeps the prefill plan; pinning a decode field with one is refused.
    assert plan_attention(_decode(), H100_SXM, plain_output=False).config.pack_gqa == 1
    with pytest.raises(ConfigError, match="no output epilogue"):
        plan_attention(_decode(), H100_SXM, plain_output=False, num_splits=4)


def test_decode_tiles_that_fill_the_sms_run_two_ctas_per_sm():
    from epicute.attention.plan import attention_smem_layout

    plan = plan_attention(_decode(batch=64, seqlen_k=8192, page_size=128, seqused_k=True), H100_SXM)
    c = plan.config
    assert (c.tile_n, c.stages, c.persistent, c.dynamic_tiles, c.num_splits) == (64, 2, False, False, 1)
    assert plan.grid[0] == plan.num_tiles == 512
    # Two CTAs fit an SM: their shared memory (the 1 KB each reserves besides) and 128 threads of each role.
    assert 2 * (attention_smem_layout(c).total_bytes + 1024) <= 233472
    assert 128 * (c.producer_regs + c.consumer_regs) <= 65536 // 2
    assert "two fit an SM" in c.reasons[0]
    # Split tiles too: 8 K/V heads x 16 splits of 64-key blocks, one CTA each.
    plan = plan_attention(_decode(), H100_SXM)
    c = plan.config
    assert (c.tile_n, c.num_splits, c.persistent) == (64, 16, False) and plan.grid[0] == 128
    assert "one CTA per tile split, sized so that two fit an SM" in c.reasons[0]
    # Too few CTAs for half the SMs (short keys: no split), and other head dims: one persistent CTA per SM.
    for problem in (_decode(seqlen_k=500), _decode(batch=64, seqlen_k=8192, head_dim=64)):
        c = plan_attention(problem, H100_SXM).config
        assert c.persistent and "two fit an SM" not in c.reasons[0]


@pytest.mark.parametrize("page_size", (0, 256))
@pytest.mark.parametrize("seqlen_q", (1, 4, 17))
def test_every_gqa_ratio_plans(seqlen_q, page_size):
    """Every ratio from 1 (MHA) to 64 (MQA over 64 heads): decode tiles pack the whole group, padded to
    a power of two rows a query when it does not divide the tile, and longer queries take the prefill
    tiles; every plan validates."""
    for group in range(1, 65):
        for heads_kv in (1, 2, 8):
            problem = _decode(seqlen_q=seqlen_q, seqlen_k=4097, heads_q=group * heads_kv, heads_kv=heads_kv,
                              page_size=page_size)  # fmt: skip
            for target in ("h100-sxm", "h200", "h20"):
                plan = plan_attention(problem, target)
                c = plan.config
                c.validate(target)
                rows = (1 << (group - 1).bit_length()) * seqlen_q
                if group > 1 and rows <= 64:
                    assert (c.pack_gqa, c.pack_rows, plan.rows, c.tile_m) == (group, rows // seqlen_q, rows, 64)
                    assert plan.num_tiles == problem.batch * heads_kv * c.num_splits
                else:
                    assert c.pack_gqa == 1 and plan.rows == seqlen_q


def test_padded_gqa_groups_are_explained():
    text = render_attention_plan(plan_attention(_decode(heads_q=24, heads_kv=8), H100_SXM))
    assert "the 3 query heads of a K/V head share a tile: row r is query r // 4 of head r % 4" in text
    assert "pad the group to a power of two" in text and "padded to 4 rows a query" in text


def test_decode_config_errors():
    with pytest.raises(ConfigError, match="pack_gqa=3"):
        plan_attention(_decode(), H100_SXM, pack_gqa=3)
    with pytest.raises(ConfigError, match="pack_gqa=65: packs 1 to 64"):
        AttentionConfig(tile_m=64, pingpong=False, mma_atoms_mn=(1, 1), pack_gqa=65).validate(H100_SXM)
    with pytest.raises(ConfigError, match="pack_gqa=4: .*tile_m=128"):
        AttentionConfig(tile_m=128, pack_gqa=4).validate(H100_SXM)
    with pytest.raises(ConfigError, match="all 4 query heads"):
        plan_attention(_decode(), H100_SXM, pack_gqa=2)
    with pytest.raises(ConfigError, match="num_splits=65"):
        plan_attention(_decode(), H100_SXM, num_splits=65)
    with pytest.raises(ConfigError, match="needs split_kv"):
        AttentionConfig(tile_m=64, pingpong=False, mma_atoms_mn=(1, 1), num_splits=2).validate(H100_SXM)
    with pytest.raises(ConfigError, match="does not divide page_size=64"):
        plan_attention(_decode(page_size=64, seqlen_k=4096), H100_SXM, tile_n=128)


@pytest.mark.parametrize("page_size", (16, 48, 64, 128, 192, 256))
def test_paged_blocks_tile_the_pages(page_size):
    for problem in (_decode(page_size=page_size, seqlen_k=page_size * 100),
                    _decode(seqlen_q=2000, page_size=page_size, seqlen_k=page_size * 100, head_dim=256)):  # fmt: skip
        cfg = plan_attention(problem, H100_SXM).config
        assert page_size % cfg.tile_n == 0 and cfg.tile_n >= 16
    text = render_attention_plan(plan_attention(_decode(page_size=128, seqused_k=True), H100_SXM))
    for line in ("GQA packing", "split-KV", "paged KV", "seqused_k", "combine"):
        assert line in text
