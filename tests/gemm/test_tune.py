"""Autotuning without a GPU: candidate configs, choosing the fastest, the winner store, explain."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.gemm import GemmProblem
from epicute.gemm import api as gemm_api
from epicute.gemm.api import _tune_identity, _tuned_overrides
from epicute.gemm.heuristics import choose_config
from epicute.gemm.smem import EpilogueBuffers
from epicute.gemm.tune import (
    TuneResult,
    candidates,
    fitted_swap_pins,
    label,
    pick_fastest,
    store_winner,
    stored_entry,
    wide_swap_pins,
)
from epicute.runtime.target import H100_SXM


@pytest.fixture(autouse=True)
def own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))
    gemm_api._TUNED.clear()


def test_candidates_are_distinct_valid_configs_with_the_planners_first():
    problem = GemmProblem(4096, 4096, 4096)
    options = candidates(problem, H100_SXM)
    assert options[0] == {k: getattr(choose_config(problem, H100_SXM), k)
                          for k in ("schedule", "tile_n", "cluster_m", "cluster_n", "persistent")}  # fmt: skip
    keys = [choose_config(problem, H100_SXM, **o).key() for o in options]
    assert len(set(keys)) == len(keys) >= 6
    assert {o["tile_n"] for o in options} == {128, 192, 256}  # 64 only for narrow N
    assert {o["schedule"] for o in options} == {"cooperative", "pingpong"}
    assert all(o["persistent"] for o in options if o["schedule"] == "pingpong")
    narrow = candidates(GemmProblem(4096, 96, 4096), H100_SXM)
    assert 64 in {o["tile_n"] for o in narrow}


def test_ragged_rows_against_a_wide_n_add_the_swapped_256_row_tile():
    """M = 1000 pads to 1024 in 128-row tiles and 1008 in 144-wide swapped ones (cuBLAS's 256 x 144 there)."""
    problem = GemmProblem(1000, 14336, 4096, b_major="n")
    wide = [o for o in candidates(problem, H100_SXM) if o.get("tile_m") == 256]
    assert wide == [{"schedule": "cooperative", "tile_n": 144, "cluster_m": 1, "cluster_n": 1, "persistent": True,
                     "swap_ab": True, "tile_m": 256}]  # fmt: skip
    cfg = choose_config(problem, H100_SXM, **wide[0])
    assert cfg.swap_ab and (cfg.tile_m, cfg.tile_n, cfg.epi_tile[0]) == (256, 144, 128)
    assert wide_swap_pins(GemmProblem(1024, 14336, 4096))["tile_n"] == 128  # whole tiles: the widest that pads least
    for no_swap in (GemmProblem(4096, 4096, 4096), GemmProblem(100, 14336, 4096), GemmProblem(1000, 14336, 4096, 2)):
        assert wide_swap_pins(no_swap) is None  # N not wider than M; one tile of M; batched (swap-AB plans one)


def test_ragged_rows_add_the_swapped_128_row_tile_that_fits_them():
    """900 rows fit 4 swapped tiles of 240 (the planner, measuring 240-wide tiles slower, keeps 128-row tiles of A;
    the tuner times both), 777 rows 4 of 208 (the planner's own); one swapped tile of M is swap-AB's plan."""
    for m, width in ((900, 240), (777, 208), (300, 160)):
        options = candidates(GemmProblem(m, 14336, 4096, b_major="n"), H100_SXM)
        fitted = [o for o in options if o.get("swap_ab") and o.get("tile_m") == 128]
        assert [o["tile_n"] for o in fitted] == [width], (m, fitted)
    assert fitted_swap_pins(GemmProblem(100, 14336, 4096)) is None
    assert fitted_swap_pins(GemmProblem(1500, 14336, 4096)) is None
    assert fitted_swap_pins(GemmProblem(900, 14336, 4096, 2)) is None  # batched


def test_candidates_respect_the_epilogue_budget():
    epi = EpilogueBuffers(tile_inputs=("fp32", "fp32"), aux_outputs=("fp32",), vectors=("row",))
    for overrides in candidates(GemmProblem(8192, 8192, 8192), H100_SXM, epi):
        choose_config(GemmProblem(8192, 8192, 8192), H100_SXM, epi, **overrides).validate()


def test_pick_fastest_takes_the_minimum_and_skips_broken_candidates():
    options = [{"tile_n": 256}, {"tile_n": 128}, {"tile_n": 64}]
    times = {256: 2.0, 128: 1.5}

    def measure(o):
        if o["tile_n"] == 64:
            raise RuntimeError("does not run")
        return times[o["tile_n"]]

    seen = []
    result = pick_fastest(options, measure, seen.append)
    assert result.best == {"tile_n": 128} and result.planner == {"tile_n": 256}
    assert result.speedup_over_planner == pytest.approx(2.0 / 1.5)
    assert seen == [label(o) for o in options] and "tile_n=64" not in result.times_ms
    with pytest.raises(epicute.ConfigError, match="planner's own config"):
        pick_fastest([{"tile_n": 64}], measure)


def test_winner_store_round_trip_feeds_gemm_tune_and_explain(capsys):
    a = torch.randn(1000, 512, dtype=torch.bfloat16)
    b = torch.randn(512, 2048, dtype=torch.bfloat16)
    key = _tune_identity(a, b, None, None, None, {})[0]
    assert stored_entry(key) is None
    best, planner = {"tile_n": 128, "cluster_m": 1, "cluster_n": 1, "persistent": True}, {"tile_n": 256}
    store_winner(key, TuneResult(best, {label(best): 1.0, label(planner): 1.25}, planner))
    assert stored_entry(key)["best"] == best
    assert _tuned_overrides(a, b, None, None, None, {}) == best  # no GPU needed: the stored winner is used
    epicute.explain(a, b)
    assert "tuned (epicute.tune, stored): cluster_m=1, cluster_n=1, persistent=True, tile_n=128 at 1.000 ms" in (
        capsys.readouterr().out
    )
    # Another epilogue is another problem to tune.
    bias = torch.randn(2048, dtype=torch.bfloat16)
    assert _tune_identity(a, b, lambda acc, bias: acc + bias, None, None, {"bias": bias})[0] != key


def test_tune_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(epicute.DeviceError, match="CUDA GPU"):
        epicute.tune(torch.randn(64, 64, dtype=torch.bfloat16), torch.randn(64, 64, dtype=torch.bfloat16))
