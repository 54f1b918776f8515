"""Persistent tile schedulers: one protocol, three schedulers.

Every role of a persistent kernel walks its work the same way::

    work = scheduler.first()
    while scheduler.is_valid(work):
        coords = scheduler.coord(work)
        ...
        work = scheduler.next(work)

and the launch is sized by :func:`epicute.sm90.tile_grid.launched`, called with the
same arguments by the planner (the grid ``explain`` prints) and by the kernel's
``__call__``; the schedulers read the launched count back from the grid, so the
compiled code holds no SM count.

- :class:`ClusterTileScheduler` (the GEMM): static. Cluster ``z`` of a
  ``(cluster_m, cluster_n, launched)`` grid takes linear cluster ids ``z, z + grid_z,
  ...``; an id maps to (tile_m, tile_n, batch) through *bands* of ``group`` clusters
  across the raster's minor axis (:func:`band_coord`), so clusters that run at the
  same moment cover a compact block of the output and share A and B panels in L2.
  Each role builds its own instance and, the schedule being static, they visit the
  same tiles in the same order without talking to each other.
- :class:`GroupedTileScheduler` (grouped GEMM): static like the GEMM's, over groups of
  rows of variable length read from an offsets tensor on the device: every role finds a
  work id's group with a warp-wide prefix sum over 32 groups at a time, so the host never
  reads the offsets (no sync; CUDA-graph safe).
- :class:`TileQueue` (attention): a linear tile order walked with a static stride,
  or claimed from a global counter (tiles of unequal length stay balanced, and the
  tiles in flight a contiguous window of the order). Claims are the producer's; it
  announces each tile to the consumers through shared memory, and consumers follow
  the announcements (:meth:`TileQueue.follow`).

:func:`band_coord` is the band walk on its own; attention's causal order (longest
query blocks first, a band of heads at a time) uses it too.
"""

from __future__ import annotations

import cutlass
from cutlass import Int32, cute
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values

from epicute.sm90.pipeline import NamedBarriers, meet_unaligned, wait_full
from epicute.sm90.tile_grid import launched


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


class PersistentTileScheduler:
    """The protocol of epicute's tile schedulers (see the module docstring).

    ``work`` is a linear ``Int32`` id; :meth:`next` steps a role past ``steps`` units of
    its walk (a ping-pong GEMM team skips the other team's tiles); :attr:`grid` sizes the
    launch, host and device alike.
    """

    #: Units (CTAs or clusters) a launch starts: :func:`epicute.sm90.tile_grid.launched`.
    grid = staticmethod(launched)

    def first(self):
        raise NotImplementedError

    def is_valid(self, work):
        raise NotImplementedError

    def next(self, work, steps=1):
        raise NotImplementedError

    def coord(self, work):
        raise NotImplementedError


class StaticClusterWalk(PersistentTileScheduler):
    """The static persistent walk of the GEMM schedulers: cluster ``z`` of a ``(cluster_m, cluster_n,
    launched)`` grid takes work ids ``z, z + launched, ...``."""

    def first(self):
        """This cluster's first linear work id."""
        return Int32(cute.arch.block_idx()[2])

    def stride(self):
        """Launched clusters (``gridDim.z``): the static walk's step."""
        return Int32(cute.arch.grid_dim()[2])

    def next(self, work, steps=1):
        if cutlass.const_expr(isinstance(steps, int) and steps == 1):
            return work + self.stride()
        return work + steps * self.stride()

    def cta_tile(self, r, clusters_m, clusters_n):
        """This CTA's (tile_m, tile_n) in the ``r``-th cluster of a ``clusters_m x clusters_n`` grid walked in
        bands of ``self.group`` clusters (:func:`band_coord`) along the raster's minor axis."""
        if cutlass.const_expr(self.raster_along_m):
            major, minor = clusters_m, clusters_n
        else:
            major, minor = clusters_n, clusters_m
        major_idx, minor_idx = band_coord(r, major, minor, Int32(self.group))
        if cutlass.const_expr(self.raster_along_m):
            cm, cn = major_idx, minor_idx
        else:
            cm, cn = minor_idx, major_idx
        cta_m, cta_n, _ = cute.arch.block_idx()
        return cm * self.cluster_shape_mn[0] + Int32(cta_m), cn * self.cluster_shape_mn[1] + Int32(cta_n)


class ClusterTileScheduler(StaticClusterWalk):
    """The GEMM's static schedule over clusters of output tiles (see the module docstring)."""

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
        m, n, l = (
            new_from_mlir_values(x, [v]) for x, v in zip((self.clusters_m, self.clusters_n, self.num_batches), values)
        )
        return ClusterTileScheduler(m, n, l, self.cluster_shape_mn, self.group, self.raster_along_m)

    @property
    def total_clusters(self):
        return self.clusters_m * self.clusters_n * self.num_batches

    def is_valid(self, work):
        return work < self.total_clusters

    def coord(self, work):
        """(tile_m, tile_n, batch) of this CTA for the linear cluster id."""
        per_batch = self.clusters_m * self.clusters_n
        batch = work // per_batch
        r = work - batch * per_batch
        tile_m, tile_n = self.cta_tile(r, self.clusters_m, self.clusters_n)
        return tile_m, tile_n, batch


class SplitKTileScheduler(ClusterTileScheduler):
    """The GEMM's static schedule with each output tile's K split ``splits`` ways: work id ``w`` is split
    ``w % splits`` of cluster ``w // splits``, so a tile's splits are consecutive ids and run side by side.
    ``coord`` is ``(tile_m, tile_n, batch, split)``; :meth:`tile_slot` numbers the CTA's output tile
    (its cluster's, then its rank in the cluster) for the split reduction's workspace."""

    def __init__(self, clusters_m, clusters_n, num_batches, cluster_shape_mn, group: int, raster_along_m: bool,
                 splits: int):  # fmt: skip
        super().__init__(clusters_m, clusters_n, num_batches, cluster_shape_mn, group, raster_along_m)
        self.splits = splits

    def __new_from_mlir_values__(self, values):
        base = ClusterTileScheduler.__new_from_mlir_values__(self, values)
        return SplitKTileScheduler(base.clusters_m, base.clusters_n, base.num_batches, self.cluster_shape_mn,
                                   self.group, self.raster_along_m, self.splits)  # fmt: skip

    def is_valid(self, work):
        return work < self.total_clusters * self.splits

    def coord(self, work):
        cluster = work // self.splits
        return (*ClusterTileScheduler.coord(self, cluster), work - cluster * self.splits)

    def tile_slot(self, work):
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        return (work // self.splits) * (self.cluster_shape_mn[0] * self.cluster_shape_mn[1]) + rank


class RaggedKTileScheduler(ClusterTileScheduler):
    """The GEMM's static schedule with one batch per group of a reduction split into groups (the grouped
    GEMM's variable-K mode): group ``g`` reduces over K rows ``[offsets[g - 1], offsets[g])`` (bounds
    clamped to ``[0, total_k]`` as :class:`GroupedTileScheduler` clamps rows). ``coord`` is ``(tile_m,
    tile_n, g, first K row, end K row)``. Read-only inside loops, like the grouped scheduler."""

    def __init__(self, offsets, total_k, clusters_m, clusters_n, num_groups, cluster_shape_mn, group: int,
                 raster_along_m: bool):  # fmt: skip
        super().__init__(clusters_m, clusters_n, num_groups, cluster_shape_mn, group, raster_along_m)
        self.offsets, self.total_k = offsets, total_k

    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    @cute.jit
    def coord(self, work):
        tile_m, tile_n, g = ClusterTileScheduler.coord(self, work)
        end = cutlass.min(cutlass.max(self.offsets[g], Int32(0)), self.total_k)
        start = Int32(0)
        if g > 0:
            start = cutlass.min(cutlass.max(self.offsets[g - 1], Int32(0)), end)
        return tile_m, tile_n, g, start, end


WARP = 32


def warp_inclusive_sum(value):
    """Lane ``l``'s sum of lanes ``0..l``'s ``value`` (the whole warp calls it)."""
    lane = cute.arch.lane_idx()
    for i in range(5):  # trace-time Python: unrolled
        below = cute.arch.shuffle_sync_up(value, offset=1 << i, mask_and_clamp=0)
        value = value + cutlass.select_(lane >= (1 << i), below, Int32(0))
    return value


class GroupedTileScheduler(StaticClusterWalk):
    """Clusters of output tiles over groups of rows (see the module docstring).

    Group ``g`` owns rows ``[offsets[g - 1], offsets[g])`` (``offsets[-1]`` read as 0; each bound
    clamped to ``[0, total_rows]`` and a start to its end, so malformed offsets can only make groups
    empty or overlap, never reach past the output). Clusters are numbered group-major: group ``g``
    has ``ceil(rows_g / block_m) * clusters_n`` of them (``block_m = tile_m * cluster_m``: a cluster
    never straddles groups) and walks them in bands like :class:`ClusterTileScheduler`. ``coord``
    is ``(tile_m within the group, tile_n, g, first row, end row, tile rows of the groups before g)``:
    the last numbers every tile row of the schedule once (a grouped epilogue's reduction slots).

    ``paired`` (a 2x1 cluster, :attr:`~epicute.gemm.config.GemmConfig.pair_tiles`): a group of ``tm`` row
    tiles and ``tn`` column tiles has ``(tm // 2) tn`` clusters of two row tiles (one column; B shared), then,
    when ``tm`` is odd, ``ceil(tn / 2)`` clusters of its last row tile and two columns (A shared; the second
    CTA of the last one past N when ``tn`` is odd: its loads read zeros, its stores are dropped). So no group
    is padded to a pair of row tiles. ``coord`` then ends with 1 where the cluster pairs along N, else 0.

    Read-only inside loops: every value is computed before the role's tile loop, so the DSL needs
    to carry nothing. Each role counts the clusters once (:attr:`total`) and decodes each of its
    work ids with a scan from the first group: ``ceil(G / 32)`` warp steps of a few shuffles.
    """

    def __init__(self, offsets, num_groups, total_rows, clusters_n, cluster_shape_mn, group: int,
                 raster_along_m: bool, tile_m: int, paired: bool = False):  # fmt: skip
        self.offsets, self.num_groups, self.total_rows, self.clusters_n = offsets, num_groups, total_rows, clusters_n
        self.cluster_shape_mn, self.group, self.raster_along_m = cluster_shape_mn, group, raster_along_m
        self.paired = paired
        self.tile_m = tile_m
        self.block_m = tile_m if paired else tile_m * cluster_shape_mn[0]
        self.total = self._count()

    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    @cute.jit
    def _window(self, first_group):
        """Lane ``l``'s group ``first_group + l``: its first row, end row and cluster count (an empty
        group past the last one)."""
        g = first_group + cute.arch.lane_idx()
        start = Int32(0)
        end = Int32(0)
        if g < self.num_groups:
            end = cutlass.min(cutlass.max(self.offsets[g], Int32(0)), self.total_rows)
            if g > 0:
                start = cutlass.min(cutlass.max(self.offsets[g - 1], Int32(0)), end)
        row_tiles = (end - start + self.block_m - 1) // self.block_m
        clusters = row_tiles * self.clusters_n
        if cutlass.const_expr(self.paired):
            clusters = row_tiles // 2 * self.clusters_n + row_tiles % 2 * ((self.clusters_n + 1) // 2)
        return start, end, clusters

    @cute.jit
    def _count(self):
        total = Int32(0)
        for first in range(0, self.num_groups, WARP):
            _, _, clusters = self._window(first)
            total += cute.arch.shuffle_sync(warp_inclusive_sum(clusters), WARP - 1)
        return total

    def is_valid(self, work):
        return work < self.total

    @cute.jit
    def coord(self, work):
        """``(tile_m, tile_n, group, first row, end row, tile rows before the group)`` of this CTA for a valid
        cluster id."""
        first = Int32(0)
        before = Int32(0)  # clusters of the groups before the window
        start, end, clusters = self._window(first)
        inclusive = warp_inclusive_sum(clusters)
        window = cute.arch.shuffle_sync(inclusive, WARP - 1)
        while before + window <= work:
            before += window
            first += WARP
            start, end, clusters = self._window(first)
            inclusive = warp_inclusive_sum(clusters)
            window = cute.arch.shuffle_sync(inclusive, WARP - 1)
        # The groups wholly before `work` are the lanes whose inclusive count does not pass it.
        lane = cute.arch.popc(cute.arch.vote_ballot_sync(before + inclusive <= work))
        group_start = cute.arch.shuffle_sync(start, lane)
        group_end = cute.arch.shuffle_sync(end, lane)
        clusters_before = before + cute.arch.shuffle_sync(inclusive - clusters, lane)
        within = work - clusters_before
        clusters_m = (group_end - group_start + self.block_m - 1) // self.block_m
        if cutlass.const_expr(self.paired):
            tile_m, tile_n, along_n = self._paired_tile(within, clusters_m)
            return tile_m, tile_n, first + lane, group_start, group_end, self._row_tiles_before(first + lane), along_n
        tile_m, tile_n = self.cta_tile(within, clusters_m, self.clusters_n)
        rows_before = clusters_before // self.clusters_n * self.cluster_shape_mn[0]
        return tile_m, tile_n, first + lane, group_start, group_end, rows_before

    @cute.jit
    def _paired_tile(self, within, row_tiles):
        """This CTA's (tile_m, tile_n) in its group's ``within``-th paired cluster, and 1 where that cluster pairs
        along N, else 0 (see the class docstring)."""
        along_m = row_tiles // 2 * self.clusters_n
        # The pairs along M walk the group's (row tiles / 2) x tn clusters in bands, as the unpaired schedule does.
        # (Clamped, so a group with no pair along M decodes a valid cluster before the branch below replaces it.)
        pair = cutlass.max(cutlass.min(within, along_m - 1), 0)
        tile_m, tile_n = self.cta_tile(pair, cutlass.max(row_tiles // 2, 1), self.clusters_n)
        if within >= along_m:
            tile_m = row_tiles - 1
            tile_n = (within - along_m) * 2 + Int32(cute.arch.block_idx()[0])
        return tile_m, tile_n, cutlass.select_(within >= along_m, Int32(1), Int32(0))

    @cute.jit
    def _row_tiles_before(self, group):
        """Row tiles of the groups before ``group`` (a second scan: paired clusters do not count them)."""
        before = Int32(0)
        for first in range(0, group, WARP):
            start, end, _ = self._window(first)
            tiles = (end - start + self.tile_m - 1) // self.tile_m
            tiles = cutlass.select_(first + cute.arch.lane_idx() < group, tiles, Int32(0))
            before += cute.arch.shuffle_sync(warp_inclusive_sum(tiles), WARP - 1)
        return before


class TileQueue(PersistentTileScheduler):
    """Work tiles of a persistent CTA, in a linear order: a static stride, or claimed from a
    global counter.

    ``order(tile)`` maps a linear tile to its coordinates (attention: m-block fastest, or
    longest-first bands). A CTA starts on tile ``blockIdx.x``. Its next tile is either
    static (``tile + gridDim.x``: every role of the CTA computes it alone) or, with
    ``counter`` (a global int32 that is 0 at launch), claimed dynamically: ``gridDim.x +
    atomicAdd(counter, 1)``, so CTAs that drew short tiles come back for more and a
    longest-first order keeps its balance. The launch's last claim returns ``num_tiles -
    1`` (every tile past the first wave is claimed once, and every CTA makes one last,
    failing claim); its claimer stores 0 back, so the next launch on the stream finds
    the counter at 0 without a memset.

    Dynamic tiles are claimed by the producer warp alone (:meth:`next`), which
    announces each one to the consumers (:meth:`announce`): its lane 0 writes the tile's
    index and coordinates to ``slot`` (shared memory, int32 ``(values, 2)``: one half per
    phase of the one-stage ring that carries the tile's first load, attention's Q), then
    the warp meets the consumers at a named barrier (:meth:`meet`) once it has issued that
    load, and the consumers read the slot past the same barrier (:meth:`follow`,
    :meth:`followed_coord`); an index ``>= num_tiles`` ends their walk. The barrier orders
    the write before the reads; the halves keep a consumer's read of one tile apart from
    the producer's write of the next, which follows the next meeting. (The ring's
    mbarriers order them as well, but compute-sanitizer's racecheck does not follow an
    mbarrier's release and acquire for plain shared-memory accesses, and reported every
    hand-off; a named barrier it does follow. Meeting costs the producer little: it waits
    for the ring's stage to be freed by the previous tile's epilogue anyway.)
    """

    def __init__(
        self, slot: cute.Tensor, num_tiles, order, counter: cute.Tensor | None = None, meeting_threads: int = 0
    ):
        self.slot = slot
        self.num_tiles = num_tiles
        self.order = order
        self.counter = counter
        self.dynamic = counter is not None
        #: Threads at each meeting of a dynamic tile's announcement: the producer warp and the consumers.
        self.meeting_threads = meeting_threads

    # Read-only inside loops: the DSL may carry it as-is.
    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    def ordered_by(self, order) -> TileQueue:
        """This queue with its tile order set (each role builds it from the extents it has)."""
        return TileQueue(self.slot, self.num_tiles, order, self.counter, self.meeting_threads)

    def first(self):
        return Int32(cute.arch.block_idx()[0])

    def is_valid(self, tile):
        return tile < self.num_tiles

    def coord(self, tile):
        return self.order(tile)

    @cute.jit
    def next(self, tile, steps=1):
        """The producer warp's next tile after ``tile`` (call with the whole warp)."""
        grid = Int32(cute.arch.grid_dim()[0])
        if cutlass.const_expr(not self.dynamic):
            return tile + grid
        claimed = Int32(0)
        if cute.arch.lane_idx() == 0:
            claimed = cute.arch.atomic_add(self.counter.iterator, Int32(1))
            if claimed == self.num_tiles - 1:  # the launch's last claim: leave 0 for the next one
                self.counter[0] = Int32(0)
        return grid + cute.arch.shuffle_sync(claimed, 0)

    @cute.jit
    def announce(self, ring, state, tile, coords: tuple):
        """``ring.producer_acquire(state)`` for the tile's first load; dynamic tiles also get
        their index and coordinates written to the slot (then :meth:`meet`, once the load is issued)."""
        ring.sync_object_empty.wait(state.index, state.phase)
        if cutlass.const_expr(self.dynamic):  # noqa: SIM102 - a compile-time branch around a runtime one
            if cute.arch.lane_idx() == 0:
                for i, value in enumerate((tile, *coords)):
                    self.slot[i, 1 - state.phase] = value  # the consumers' phase: producers run one ahead
        ring.sync_object_full.arrive(state.index, ring.producer_mask)

    @cute.jit
    def announce_end(self, ring, state):
        """Dynamic tiles: the consumers' stop, an out-of-range index on a stage no load fills."""
        if cutlass.const_expr(self.dynamic):
            ring.sync_object_empty.wait(state.index, state.phase)
            if cute.arch.lane_idx() == 0:
                self.slot[0, 1 - state.phase] = self.num_tiles
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive(ring.sync_object_full.get_barrier(state.index))
            self.meet()

    def meet(self):
        """Dynamic tiles: the producer warp (after writing a tile) and the consumers (before reading it) meet."""
        if cutlass.const_expr(self.dynamic):
            # The producer and the consumers meet from different code: an unaligned barrier.
            meet_unaligned(NamedBarriers.TILE_ANNOUNCED, self.meeting_threads)

    @cute.jit
    def follow(self, tile, ring, state):
        """The consumers' tile after ``tile`` (``None``: their first): static, computed here;
        dynamic, announced (waits for ``ring``'s stage ``state`` to be full)."""
        if cutlass.const_expr(self.dynamic):
            self.meet()
            wait_full(ring, state)
            return self.slot[0, state.phase]
        if cutlass.const_expr(tile is None):
            return self.first()
        return tile + Int32(cute.arch.grid_dim()[0])

    def followed_coord(self, tile, count: int, state) -> tuple:
        """The consumers' coordinates of ``tile``: announced with it (dynamic; ``state``: the ring's
        stage :meth:`follow` waited on), else computed."""
        if cutlass.const_expr(self.dynamic):
            return tuple(self.slot[1 + i, state.phase] for i in range(count))
        return self.coord(tile)
