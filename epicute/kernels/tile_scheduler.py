"""A static persistent tile scheduler with grouped rasterization.

The grid is ``(cluster_m, cluster_n, num_launched_clusters)``; cluster ``z``
processes linear cluster ids ``z, z + grid_z, z + 2 grid_z, ...`` until the
problem is exhausted. A linear id maps to (cluster_m, cluster_n, batch) through
*bands* of ``group`` clusters across the raster's minor axis; a band is walked
across its width first, then down the raster axis (``raster_along_m``: bands of
N columns swept down M). Clusters that run at the same moment thus cover a
compact block of the output and share A and B panels in L2.

The producer warp and the consumer warpgroups each own a scheduler instance; as
the schedule is static, they visit the same tiles in the same order without
talking to each other.

:func:`band_coord` is the band walk on its own; the attention kernel orders its
causal work with it too (longest query blocks first, a band of heads at a time).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values


def band_coord(linear, major, minor, group):
    """``(major_idx, minor_idx)`` of the ``linear``-th cell of a ``major x minor`` grid walked in
    bands of ``group`` minor indices: across a band's width first, then down the major axis,
    band after band (the last band may be narrower). Cells that run at the same moment share
    their band's few minor indices, so whatever those index stays hot in L2."""
    band_size = group * major
    band = linear // band_size
    first_minor = band * group
    width = cutlass.min(group, minor - first_minor)
    within = linear - band * band_size
    major_idx = within // width
    return major_idx, first_minor + within - major_idx * width


class TileScheduler:
    def __init__(
        self,
        clusters_m: Int32,
        clusters_n: Int32,
        num_batches: Int32,
        cluster_shape_mn: tuple[int, int],
        group: int,
        raster_along_m: bool,
    ):
        self.clusters_m = clusters_m
        self.clusters_n = clusters_n
        self.num_batches = num_batches
        self.cluster_shape_mn = cluster_shape_mn
        self.group = group
        self.raster_along_m = raster_along_m

    # The DSL carries the scheduler through runtime loops as its three dynamic
    # extents; the rest is compile-time configuration.
    def __extract_mlir_values__(self):
        return [v for x in (self.clusters_m, self.clusters_n, self.num_batches) for v in extract_mlir_values(x)]

    def __new_from_mlir_values__(self, values):
        m, n, l = (new_from_mlir_values(x, [v]) for x, v in zip((self.clusters_m, self.clusters_n, self.num_batches), values))
        return TileScheduler(m, n, l, self.cluster_shape_mn, self.group, self.raster_along_m)

    @staticmethod
    def num_clusters(tiles_m, tiles_n, l, cluster_shape_mn):
        clusters_m = (tiles_m + cluster_shape_mn[0] - 1) // cluster_shape_mn[0]
        clusters_n = (tiles_n + cluster_shape_mn[1] - 1) // cluster_shape_mn[1]
        return clusters_m, clusters_n, clusters_m * clusters_n * l

    @property
    def total_clusters(self):
        return self.clusters_m * self.clusters_n * self.num_batches

    def first(self):
        """This cluster's first linear work id."""
        return Int32(cute.arch.block_idx()[2])

    def stride(self):
        return Int32(cute.arch.grid_dim()[2])

    def is_valid(self, linear):
        return linear < self.total_clusters

    def tile_coord(self, linear):
        """(tile_m, tile_n, batch) of this CTA for the linear cluster id."""
        per_batch = self.clusters_m * self.clusters_n
        batch = linear // per_batch
        r = linear - batch * per_batch
        if cutlass.const_expr(self.raster_along_m):
            major, minor = self.clusters_m, self.clusters_n
        else:
            major, minor = self.clusters_n, self.clusters_m
        major_idx, minor_idx = band_coord(r, major, minor, Int32(self.group))
        if cutlass.const_expr(self.raster_along_m):
            cm, cn = major_idx, minor_idx
        else:
            cm, cn = minor_idx, major_idx
        cta_m, cta_n, _ = cute.arch.block_idx()
        return (
            cm * self.cluster_shape_mn[0] + Int32(cta_m),
            cn * self.cluster_shape_mn[1] + Int32(cta_n),
            batch,
        )
