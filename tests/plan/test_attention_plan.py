"""The attention planner: default configs, the whole-rows-per-warp check, smem accounting."""

from __future__ import annotations

import pytest

from epicute.errors import ConfigError
from epicute.plan.attention import (
    AttentionConfig,
    AttentionProblem,
    attention_smem_total,
    default_config,
    plan_attention,
    render_attention_plan,
    row_ownership,
)
from epicute.plan.hardware import H100_SXM


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
    assert plan.grid == (8, 8, 2)
    text = render_attention_plan(plan)
    assert "GQA 8:1" in text and "rows 0-15, all 80 columns" in text and "total" in text
    assert problem.flops == 4 * 2 * 8 * 1000 * 4097 * 256 // 2
