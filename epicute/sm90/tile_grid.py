"""The host half of the persistent tile schedulers: how many CTAs a launch starts.

Plain Python over plain operators, so the planner (``explain``'s grid, Python ints)
and each kernel's ``__call__`` (runtime ``Int32`` values, ``minimum=cutlass.min``)
call the same functions and agree by construction. The device half,
:mod:`epicute.sm90.tile_scheduler`, reads the launched count back from the grid,
so no SM count is compiled into a kernel: one binary serves every Hopper part.
"""

from __future__ import annotations


def ceil_div(a, b):
    """``ceil(a / b)`` for non-negative ints or DSL integers."""
    return (a + b - 1) // b


def cluster_counts(tiles_m, tiles_n, batches, cluster_shape_mn: tuple[int, int]):
    """``(clusters_m, clusters_n, clusters)``: one cluster per ``cluster_m x cluster_n`` block of
    output tiles (the last ones may be partial: TMA clips their loads and stores)."""
    clusters_m = ceil_div(tiles_m, cluster_shape_mn[0])
    clusters_n = ceil_div(tiles_n, cluster_shape_mn[1])
    return clusters_m, clusters_n, clusters_m * clusters_n * batches


def grouped_cluster_bound(total_rows, num_groups, block_m: int, clusters_n):
    """An upper bound on the clusters of a grouped problem whose groups' rows add up to ``total_rows``:
    ``sum_g ceil(rows_g / block_m) <= (total_rows + G (block_m - 1)) // block_m`` cluster rows, each
    ``clusters_n`` clusters wide (tight when every group is 1 row past a multiple of ``block_m``)."""
    return (total_rows + num_groups * (block_m - 1)) // block_m * clusters_n


def launched(work_units, max_units, persistent: bool, minimum=min):
    """Units (CTAs or clusters) a launch starts: one per work unit, or (``persistent``) at most
    ``max_units`` -- what the GPU runs at once -- which then walk the rest."""
    return minimum(work_units, max_units) if persistent else work_units


__all__ = ["ceil_div", "cluster_counts", "grouped_cluster_bound", "launched"]
