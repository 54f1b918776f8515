"""The GEMM problem and the kernel configuration that solves it.

A :class:`GemmProblem` is what the user asked for (sizes, dtypes, majors). A
:class:`GemmConfig` is every compile-time choice of the kernel (tiles, cluster,
warp roles, stages, epilogue tile, rasterization). Both are plain, hashable
Python: the planner makes them without a GPU and the compile cache keys on the
config, never on a problem's sizes (those stay dynamic in the kernel).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from epicute.epilogue.dtypes import DTYPE_BYTES
from epicute.epilogue.scales import BLOCK_K
from epicute.errors import ConfigError
from epicute.sm90.warp_roles import THREADS_PER_WARPGROUP, WarpRoles

AB_DTYPES = ("bf16", "fp16", "fp8e4m3", "fp8e5m2")
FP8_AB_DTYPES = ("fp8e4m3", "fp8e5m2")
#: A k-tile is one 128-byte swizzle row of A and of B: 64 16-bit or 128 8-bit elements.
K_TILE_BYTES = 128
D_DTYPES = ("bf16", "fp16", "fp32", "fp8e4m3", "fp8e5m2")

SCHEDULES = ("cooperative", "pingpong")
TILE_N = (64, 128, 192, 224, 256)
#: Tile N of a swap-AB kernel, whose N is the problem's M: WGMMA N in steps of 16 (one stmatrix atom of the
#: transposed D store).
SWAP_AB_TILE_N = tuple(range(16, 257, 16))
#: Tile M by schedule: a cooperative tile gives each of its two warpgroups one or two 64-row WGMMA blocks, a
#: ping-pong tile its one warpgroup one or two.
SCHEDULE_TILE_M = {"cooperative": (128, 256), "pingpong": (64, 128)}
#: Accumulator registers a consumer thread may hold (of its 232): the rest is the epilogue's.
MAX_ACC_REGS = 192
#: Most CTAs one output tile's K is split across.
MAX_SPLIT_K = 8
#: Tile N of a blockwise-scaled fp8 GEMM. A 64- or 128-wide tile lies in one block of N; a 192-wide one starts on
#: a multiple of 64, so each of its 64-column chunks does; a 256-wide one spans two blocks (:func:`b_scale_chunks`).
BLOCK_SCALED_TILE_N = (64, 128, 192, 256)
#: fp32 values per ring stage for B's blockwise scales: a 16-byte slot, the size and alignment of one bulk copy.
#: A bulk copy brings the k-tile's block of K with the others of its aligned group of four (a consumer reads the
#: one at ``k_tile % B_SCALE_SLOT``); cp.async fills the first ``b_scale_chunks`` values instead.
B_SCALE_SLOT = 4


def epi_tile_m(schedule: str) -> int:
    """An epilogue subtile's rows: one 64-row WGMMA block of each warpgroup of the team (so a 256-row cooperative
    tile is two subtiles tall)."""
    return 64 if schedule == "pingpong" else 128


def b_scale_chunks(tile_n: int) -> int:
    """B scales a blockwise-scaled tile needs per k-tile: one per chunk of columns that lies in one block of N."""
    return tile_n // BLOCK_K if tile_n % BLOCK_K == 0 else tile_n // 64


def promote_chunks(cfg: GemmConfig) -> int:
    """Column chunks a blockwise-scaled consumer computes each k-tile's partial in: 1, the whole tile, where a
    partial as wide as the tile fits beside the fp32 sum in ``MAX_ACC_REGS``; 2 for a 256-wide tile where only a
    half does (the sum's 128 registers and a 128-column partial's 64: each half is one block of N, whose WGMMAs
    retire and are promoted before the other half's are issued); 0 where neither fits."""
    if 2 * cfg.acc_regs <= MAX_ACC_REGS:
        return 1
    return 2 if cfg.tile_n == 256 and cfg.acc_regs + cfg.acc_regs // 2 <= MAX_ACC_REGS else 0


def promote_partials(cfg: GemmConfig) -> int:
    """k-tile partial sums a blockwise-scaled consumer keeps beside its fp32 sum: two where three accumulators fit
    ``MAX_ACC_REGS`` (k-tile j's WGMMAs run while j - 1's partial is promoted), else one (the warpgroup waits for
    its k-tile, or each half of it (:func:`promote_chunks`), and promotes while the other warpgroup's WGMMAs hold
    the tensor cores); 0 where not even one fits."""
    if 3 * cfg.acc_regs <= MAX_ACC_REGS:
        return 2
    return 1 if promote_chunks(cfg) else 0


def validate_block_scaled(cfg: GemmConfig) -> None:
    """Raise :class:`ConfigError` for a tile the promoting mainloop cannot run (planner and kernel both ask)."""
    if cfg.tile_k != BLOCK_K or cfg.tile_n not in BLOCK_SCALED_TILE_N or not promote_partials(cfg):
        raise ConfigError(
            f"tile {cfg.tile_m}x{cfg.tile_n}x{cfg.tile_k} ({cfg.schedule}) with blockwise scales: a k-tile is one "
            f"{BLOCK_K}-wide scale block (tile_k={BLOCK_K}), tile_n must be one of {BLOCK_SCALED_TILE_N}, and "
            f"promotion holds the sum and at least one k-tile's partial ({cfg.acc_regs} registers per thread each, "
            f"a 256-wide tile's partial half of them) within {MAX_ACC_REGS}; use the cooperative schedule with "
            "tile_n 128, 192 or 256, or ping-pong with tile_m 64"
        )


@dataclass(frozen=True)
class GemmProblem:
    """``D[l] = A[l] @ B[l]`` with A ``(L, M, K)``, B ``(L, K, N)``, D ``(L, M, N)``.

    ``a_major`` is ``"k"`` when A is row-major (K contiguous) and ``"m"`` when it
    is column-major; ``b_major`` is ``"n"`` when B is row-major and ``"k"`` when it
    is column-major (i.e. ``w.t()`` of a row-major ``w``). D is always row-major.
    ``ab_dtype`` is A's dtype and B's, unless ``b_dtype`` names B's: fp8 inputs may
    mix e4m3 and e5m2 (gradients), and must both be K-major (WGMMA reads 8-bit
    operands K-major only). ``block_scaled``: fp8 inputs dequantized per block of
    K in the mainloop (A per 1x128, B per 128x128 block; :mod:`epicute.epilogue.scales`).
    """

    m: int
    n: int
    k: int
    l: int = 1
    ab_dtype: str = "bf16"
    d_dtype: str = "bf16"
    a_major: str = "k"
    b_major: str = "n"
    b_dtype: str = ""
    block_scaled: bool = False
    #: blockwise A scales the kernel TMA-loads (``BlockScales.a_tma``); else a word per row by ``cp.async``
    a_scales_tma: bool = False
    #: blockwise B scales the kernel fetches by bulk copy (``BlockScales.b_bulk``) where a tile lies in one block
    #: of N; else a word per chunk by ``cp.async``
    b_scales_bulk: bool = False

    def __post_init__(self) -> None:
        if self.ab_dtype not in AB_DTYPES:
            raise ConfigError(f"ab_dtype={self.ab_dtype!r}: supported are {AB_DTYPES}")
        if self.b_dtype and (self.b_dtype != self.ab_dtype) and not (self.fp8 and self.b_dtype in FP8_AB_DTYPES):
            raise ConfigError(
                f"b_dtype={self.b_dtype!r} with ab_dtype={self.ab_dtype!r}: only fp8 inputs may mix (e4m3 and e5m2)"
            )
        if self.fp8 and (self.a_major, self.b_major) != ("k", "k"):
            raise ConfigError(
                f"fp8 inputs with a_major={self.a_major!r}, b_major={self.b_major!r}: WGMMA reads 8-bit operands "
                "K-major only (a_major='k', b_major='k')"
            )
        if self.block_scaled and not self.fp8:
            raise ConfigError(f"block_scaled with ab_dtype={self.ab_dtype!r}: blockwise scales dequantize fp8 inputs")
        if (self.a_scales_tma or self.b_scales_bulk) and not self.block_scaled:
            raise ConfigError("a_scales_tma/b_scales_bulk without block_scaled: only blockwise scales have them")
        if self.d_dtype not in D_DTYPES:
            raise ConfigError(f"d_dtype={self.d_dtype!r}: supported are {D_DTYPES}")
        if self.a_major not in ("k", "m"):
            raise ConfigError(f"a_major={self.a_major!r}: must be 'k' (row-major) or 'm'")
        if self.b_major not in ("k", "n"):
            raise ConfigError(f"b_major={self.b_major!r}: must be 'n' (row-major) or 'k'")
        for name in ("m", "n", "k", "l"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")

    @property
    def b_elem(self) -> str:
        """B's dtype."""
        return self.b_dtype or self.ab_dtype

    @property
    def fp8(self) -> bool:
        return self.ab_dtype in FP8_AB_DTYPES

    @property
    def tile_k(self) -> int:
        """The k-tile the inputs' dtype takes: one 128-byte swizzle row."""
        return K_TILE_BYTES // DTYPE_BYTES[self.ab_dtype]

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.l

    def swapped(self) -> GemmProblem:
        """``D^T = B^T A^T`` as a problem: what a swap-AB kernel computes. Its A is B^T (K-major where B is
        column-major), its B is A^T (K-major where A is row-major); its D is D^T, column-major."""
        return replace(
            self, m=self.n, n=self.m, ab_dtype=self.b_elem, b_dtype=self.ab_dtype if self.b_dtype else "",
            a_major="k" if self.b_major == "k" else "m", b_major="k" if self.a_major == "k" else "n",
        )  # fmt: skip

    @property
    def min_bytes(self) -> int:
        """Each input read once and the output written once."""
        ab = DTYPE_BYTES[self.ab_dtype] * (self.m * self.k + self.k * self.n)
        return self.l * (ab + DTYPE_BYTES[self.d_dtype] * self.m * self.n)


@dataclass(frozen=True)
class GemmConfig(WarpRoles):
    """Every compile-time choice of the warp-specialized SM90 GEMM kernel.

    Warp roles: warpgroup 0 is the producer (its first warp issues the TMA loads
    of A and B); warpgroups 1 and 2 are consumers that run WGMMA and then the
    epilogue. The ``schedule`` says how they share the work:

    - ``"cooperative"``: both split one ``tile_m x tile_n`` tile along M (64 rows
      each); the epilogue runs while no WGMMA is in flight.
    - ``"pingpong"``: each warpgroup owns whole tiles (alternate tiles of the CTA's
      schedule); named barriers give the tensor cores to one warpgroup's mainloop
      at a time, so one warpgroup's epilogue runs under the other's mainloop.
    """

    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 64
    cluster_m: int = 1
    cluster_n: int = 1
    schedule: str = "cooperative"
    persistent: bool = True
    ab_stages: int = 4
    epi_tile: tuple[int, int] = (128, 32)
    num_epi_stages: int = 4
    #: Depth of the ring through which full-tile epilogue operands arrive (TMA, one subtile per stage).
    num_c_stages: int = 2
    #: Non-persistent only: D's staging buffers alias the A ring after the mainloop.
    epi_reuses_ab_smem: bool = False
    #: Each epilogue subtile's TMA store issued one subtile later, after the next subtile's math (CUTLASS's
    #: ``DelayTmaStore``; ``epicute.epilogue.schedule.delay_stores``): the chain ``explain`` prints.
    delay_tma_store: bool = False
    #: D staged in the first operand tile's ring slot, where that subtile's operand arrived (CUTLASS's
    #: ``ReuseSmemC``: C and D of one dtype): D needs no staging buffers of its own, and the slot is released to
    #: the operand loads once the TMA store has read it (``num_epi_stages - 1`` stores in flight, so the ring
    #: needs more stages than that). Cooperative, D the only stored tile.
    reuse_smem_c: bool = False
    raster_along_m: bool = True
    #: Tiles are visited in groups of this many clusters along the raster's minor
    #: axis, so concurrently running CTAs share A/B panels in L2.
    swizzle: int = 8
    #: K split across this many CTAs per output tile (serial split-K for problems with fewer tiles than
    #: SMs: each split stores its fp32 partial tile, and the last to finish sums them in split order and
    #: runs the epilogue; see ``GemmSm90._reduce_splits``).
    split_k: int = 1
    #: The kernel computes D^T = B^T A^T (swap-AB, for decode GEMMs of few rows): B^T's rows (the problem's N) fill
    #: the tile's M and A's rows (the small M) its N, and D's tile is stored transposed (column-major). Row and
    #: column vectors of the epilogue trade places with it (``EpilogueFusion.transposed``).
    swap_ab: bool = False
    #: The kernel operand ("a" or "b") whose k-tiles one CTA reads alone -- D is a single tile wide (for A) or
    #: tall (for B), so no other tile reads them -- loaded with an L2 evict-first hint
    #: (:mod:`epicute.sm90.l2_hints`); "" where both are shared between tiles.
    evict_first: str = ""
    #: Grouped GEMMs: the two CTAs of a 2x1 cluster pair their tiles per group, along M (sharing B, multicast) while
    #: the group has two row tiles left, else along N (sharing A), so a group is never padded to a pair of row
    #: tiles (``GroupedTileScheduler``). The dense planner does not choose it; ``plan_grouped`` does.
    pair_tiles: bool = field(default=False, metadata={"planned": False})
    producer_regs: int = field(default=40, metadata={"planned": False})
    consumer_regs: int = field(default=232, metadata={"planned": False})
    #: Why the planner chose this; printed by ``explain``.
    reasons: tuple[str, ...] = field(default=(), compare=False, hash=False)

    @property
    def num_mma_warpgroups(self) -> int:
        return 2

    @property
    def tile_warpgroups(self) -> int:
        """Consumer warpgroups working on one tile (a *team*): 2 cooperative, 1 ping-pong."""
        return 2 if self.schedule == "cooperative" else 1

    @property
    def num_teams(self) -> int:
        """Tiles a CTA has in flight at once."""
        return self.num_mma_warpgroups // self.tile_warpgroups

    @property
    def tile_threads(self) -> int:
        return self.tile_warpgroups * THREADS_PER_WARPGROUP

    @property
    def acc_regs(self) -> int:
        """fp32 accumulator registers per consumer thread."""
        return self.tile_m * self.tile_n // self.tile_threads

    @property
    def epi_tile_m(self) -> int:
        return epi_tile_m(self.schedule)

    @property
    def cluster_size(self) -> int:
        return self.cluster_m * self.cluster_n

    @property
    def num_epi_subtiles(self) -> int:
        return (self.tile_m // self.epi_tile[0]) * (self.tile_n // self.epi_tile[1])

    @classmethod
    def planned_fields(cls) -> frozenset[str]:
        """The fields :func:`~epicute.gemm.heuristics.choose_config` decides (a pin of one is kept and
        planned around); the others (the register split) pass through as given."""
        return frozenset(f.name for f in fields(cls) if f.compare and f.metadata.get("planned", True))

    def validate(self) -> None:
        """Raise :class:`ConfigError` for a configuration the kernel cannot run."""
        if self.swap_ab and (self.tile_n not in SWAP_AB_TILE_N or self.cluster_size != 1):
            raise ConfigError(
                f"swap_ab with a {self.schedule} {self.tile_m}x{self.tile_n} tile in a {self.cluster_m}x"
                f"{self.cluster_n} cluster: a swapped tile is a multiple of 16 rows of A wide (16 to 256), with no "
                "cluster peer"
            )
        if self.evict_first not in ("", "a", "b"):
            raise ConfigError(f"evict_first={self.evict_first!r}: must be 'a', 'b' or '' (no L2 hint)")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule={self.schedule!r}: must be one of {SCHEDULES}")
        if self.schedule == "cooperative" and self.tile_m not in SCHEDULE_TILE_M["cooperative"]:
            raise ConfigError(
                f"tile_m={self.tile_m}: the cooperative schedule splits a 128- or 256-row tile "
                "between its two consumer warpgroups (64 or 128 rows each); use tile_m=128"
            )
        if self.schedule == "pingpong":
            if self.tile_m not in SCHEDULE_TILE_M["pingpong"]:
                raise ConfigError(f"tile_m={self.tile_m}: a ping-pong warpgroup owns a 64- or 128-row tile")
            if not self.persistent:
                raise ConfigError(
                    "schedule='pingpong' needs persistent=True: its two warpgroups take alternate tiles of a CTA"
                )
        if self.acc_regs > MAX_ACC_REGS:
            raise ConfigError(
                f"tile {self.tile_m}x{self.tile_n} with schedule={self.schedule!r} needs {self.acc_regs} "
                f"accumulator registers per thread (at most {MAX_ACC_REGS} leave room for the epilogue); use a "
                + ("smaller tile or the cooperative schedule" if self.schedule == "pingpong" else "smaller tile")
            )
        if not self.swap_ab and self.tile_n not in TILE_N:
            raise ConfigError(f"tile_n={self.tile_n}: must be one of {TILE_N} (WGMMA N)")
        if self.tile_k not in (64, 128):
            raise ConfigError(f"tile_k={self.tile_k}: must be 64 (16-bit inputs) or 128 (fp8): one 128-byte row")
        for name in ("cluster_m", "cluster_n"):
            if getattr(self, name) not in (1, 2):
                raise ConfigError(f"{name}={getattr(self, name)}: must be 1 or 2")
        if self.cluster_size > 2:
            raise ConfigError("cluster 2x2 is not supported; use 1x1, 2x1 or 1x2")
        if self.pair_tiles and (self.cluster_m, self.cluster_n, self.split_k, self.swap_ab) != (2, 1, 1, False):
            raise ConfigError(
                f"pair_tiles=True with cluster {self.cluster_m}x{self.cluster_n}, split_k={self.split_k}, "
                f"swap_ab={self.swap_ab}: paired tiles take a 2x1 cluster, no split-K and no swap-AB"
            )
        if self.ab_stages < 2:
            raise ConfigError(f"ab_stages={self.ab_stages}: need at least 2 to overlap TMA and MMA")
        if self.num_epi_stages < 1:
            raise ConfigError(f"num_epi_stages={self.num_epi_stages}: need at least 1")
        if self.num_c_stages < 1:
            raise ConfigError(f"num_c_stages={self.num_c_stages}: need at least 1")
        epi_m, epi_n = self.epi_tile
        if epi_m != self.epi_tile_m:
            raise ConfigError(
                f"epi_tile={self.epi_tile}: its M must be {self.epi_tile_m} with schedule={self.schedule!r} "
                "(one 64-row WGMMA block per warpgroup, so subtiles follow the accumulators' order)"
            )
        if epi_n % 16 or self.tile_n % epi_n:
            raise ConfigError(
                f"epi_tile={self.epi_tile}: its N must be a multiple of 16 (one stmatrix "
                f"atom) that divides tile_n={self.tile_n}"
            )
        if self.reuse_smem_c:
            blockers = (
                (self.delay_tma_store, "the delayed store (CUTLASS forbids the two together)"),
                (self.schedule != "cooperative", "the ping-pong schedule (its teams interleave the ring's subtiles)"),
                (self.split_k > 1, "split-K"),
                (self.swap_ab, "swap-AB"),
                (self.epi_reuses_ab_smem, "epi_reuses_ab_smem (D already aliases the A ring)"),
                (self.num_c_stages <= self.num_epi_stages, (f"num_c_stages={self.num_c_stages} (the ring needs more "
                                                            f"stages than num_epi_stages={self.num_epi_stages})")),
            )  # fmt: skip
            why = next((reason for blocked, reason in blockers if blocked), "")
            if why:
                raise ConfigError(f"reuse_smem_c=True with {why}: D cannot be staged in the operand ring; use "
                                  "reuse_smem_c=False")  # fmt: skip
        if self.epi_reuses_ab_smem and self.persistent:
            raise ConfigError(
                "epi_reuses_ab_smem=True needs persistent=False: a persistent CTA's "
                "next mainloop refills the A/B ring while this tile's epilogue runs"
            )
        self.validate_registers()
        if self.split_k < 1 or self.split_k > MAX_SPLIT_K:
            raise ConfigError(f"split_k={self.split_k}: must be 1 to {MAX_SPLIT_K}")
        if self.split_k > 1 and self.schedule != "cooperative":
            raise ConfigError(
                f"split_k={self.split_k} with schedule={self.schedule!r}: a split tile's epilogue is run by the team "
                "that finishes last, which the cooperative schedule's single team per CTA makes simple; use "
                "schedule='cooperative'"
            )
        if self.swizzle < 1:
            raise ConfigError(f"swizzle={self.swizzle}: must be >= 1")
