"""The band walk shared by the GEMM's persistent scheduler, attention's causal (LPT) order and the causal
backward's grid (bands of heads)."""

from __future__ import annotations

import pytest

import epicute  # noqa: F401 - sets the DSL's target arch before cutlass is imported
from epicute.sm90.tile_scheduler import band_coord


@pytest.mark.parametrize(("major", "minor", "group"), [(3, 5, 2), (22, 64, 7), (1, 17, 4), (16, 3, 8), (5, 1, 1)])
def test_band_walk_visits_every_cell_once_band_by_band(major, minor, group):
    cells = [band_coord(i, major, minor, group) for i in range(major * minor)]
    assert sorted(cells) == [(m, n) for m in range(major) for n in range(minor)]
    # Bands of `group` minor indices (the last may be narrower), each walked down the whole major axis.
    bands = [n // group for _, n in cells]
    assert bands == sorted(bands)
    for band in set(bands):
        walk = [m for (m, n), b in zip(cells, bands) if b == band]
        width = min(group, minor - band * group)
        assert walk == [m for m in range(major) for _ in range(width)]


def test_every_scheduler_sizes_its_launch_with_the_planners_function():
    from epicute.sm90.tile_grid import launched
    from epicute.sm90.tile_scheduler import ClusterTileScheduler, PersistentTileScheduler, TileQueue

    # The planner's grid (GemmPlan.grid, AttentionPlan.grid) and each kernel's __call__ call this one function.
    assert ClusterTileScheduler.grid is TileQueue.grid is PersistentTileScheduler.grid is launched
    assert launched(1000, 132, persistent=True) == 132 and launched(1000, 132, persistent=False) == 1000
    assert launched(7, 132, persistent=True) == 7
    for method in ("first", "is_valid", "next", "coord"):
        assert getattr(ClusterTileScheduler, method) is not getattr(PersistentTileScheduler, method)
        assert getattr(TileQueue, method) is not getattr(PersistentTileScheduler, method)
