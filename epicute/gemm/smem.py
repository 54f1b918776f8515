"""Shared-memory accounting: the byte table the kernel's storage struct will have.

The kernel lays its shared storage out as a struct: the mbarrier array first,
then each data buffer aligned to 1024 bytes (the 128-byte swizzle pattern
repeats every 1024 bytes, and TMA/WGMMA descriptors assume that alignment).
This module mirrors that layout exactly so that the planner can fit stages into
the budget and ``explain`` can print a table that sums to the real total.

A fused epilogue adds an *epilogue region* (:class:`EpilogueBuffers` says what it
holds): a ring per full-tile operand that the producer's epilogue-load warp fills
by TMA one subtile ahead, a staging ring per auxiliary tile output, and the
row/column vector slices of the current tile (fp32). The kernel carves that
region with :func:`epilogue_region`, the same offsets this table prints.
"""

from __future__ import annotations

from dataclasses import dataclass

from epicute.gemm.config import DTYPE_BYTES, GemmConfig

BUFFER_ALIGN = 1024
MBARRIER_BYTES = 8


def _round_up(x: int, align: int) -> int:
    return (x + align - 1) // align * align


@dataclass(frozen=True)
class SmemItem:
    name: str
    bytes: int
    what: str


@dataclass(frozen=True)
class EpilogueBuffers:
    """What a fused epilogue needs in shared memory, by dtype (from its schedule)."""

    #: dtypes of the full-tile operands, loaded by TMA one epilogue subtile at a time
    tile_inputs: tuple[str, ...] = ()
    #: dtypes of the full-tile outputs besides D, each staged and TMA-stored like D
    aux_outputs: tuple[str, ...] = ()
    #: kinds ("row" / "col") of the vector operands, staged as fp32 once per tile
    vectors: tuple[str, ...] = ()
    #: the stage chain, as ``explain`` prints it (not part of the layout, but part of the
    #: identity: plans are cached by these buffers, and each epilogue's plan shows its own chain)
    chain: tuple[str, ...] = ()
    #: estimated SASS instructions per output element: sizes the unrolled epilogue's code
    #: (``heuristics.EPILOGUE_CODE_BUDGET``) and its arithmetic time (``roofline``)
    instructions_per_element: int = 0

    @property
    def loads_tiles(self) -> bool:
        return bool(self.tile_inputs)


NO_EPILOGUE = EpilogueBuffers()


@dataclass(frozen=True)
class Region:
    """One buffer of the epilogue region: its byte offset inside the region and size."""

    name: str
    offset: int
    bytes: int
    what: str


def epilogue_region(cfg: GemmConfig, epi: EpilogueBuffers) -> list[Region]:
    """The epilogue region's buffers in kernel order, each 1024-aligned (TMA/swizzle rule)."""
    epi_elems = cfg.epi_tile[0] * cfg.epi_tile[1]
    shape = f"{cfg.epi_tile[0]}x{cfg.epi_tile[1]}"
    wanted = [
        (f"operand tile {i}", epi_elems * DTYPE_BYTES[d] * cfg.num_c_stages,
         f"{cfg.num_c_stages} x {shape} {d}, TMA-loaded")
        for i, d in enumerate(epi.tile_inputs)
    ] + [
        (f"aux output {i}", epi_elems * DTYPE_BYTES[d] * cfg.num_epi_stages,
         f"{cfg.num_epi_stages} x {shape} {d}, TMA-stored")
        for i, d in enumerate(epi.aux_outputs)
    ] + [
        (f"{kind} vector {i}", (cfg.tile_n if kind == "row" else cfg.tile_m) * 4,
         f"{cfg.tile_n if kind == 'row' else cfg.tile_m} fp32, this tile's slice")
        for i, kind in enumerate(epi.vectors)
    ]  # fmt: skip
    regions, offset = [], 0
    for name, size, what in wanted:
        regions.append(Region(name, offset, size, what))
        offset = _round_up(offset + size, BUFFER_ALIGN)
    return regions


def epilogue_region_bytes(cfg: GemmConfig, epi: EpilogueBuffers) -> int:
    regions = epilogue_region(cfg, epi)
    return _round_up(regions[-1].offset + regions[-1].bytes, BUFFER_ALIGN) if regions else 0


def ab_stage_bytes(cfg: GemmConfig, ab_dtype: str) -> int:
    return (cfg.tile_m + cfg.tile_n) * cfg.tile_k * DTYPE_BYTES[ab_dtype]


def epi_stage_bytes(cfg: GemmConfig, d_dtype: str) -> int:
    return cfg.epi_tile[0] * cfg.epi_tile[1] * DTYPE_BYTES[d_dtype]


def smem_table(cfg: GemmConfig, ab_dtype: str, d_dtype: str, epi: EpilogueBuffers = NO_EPILOGUE) -> list[SmemItem]:
    """Every region of the kernel's shared storage, padding included, in order."""
    esize = DTYPE_BYTES[ab_dtype]
    barriers = 2 * cfg.ab_stages * MBARRIER_BYTES  # full + empty per A/B stage
    items = [SmemItem("mainloop barriers", barriers, f"{cfg.ab_stages} full + {cfg.ab_stages} empty mbarriers")]
    if epi.loads_tiles:
        epi_barriers = 2 * cfg.num_c_stages * MBARRIER_BYTES
        items.append(SmemItem("epilogue-load barriers", epi_barriers,
                              f"{cfg.num_c_stages} full + {cfg.num_c_stages} empty mbarriers"))  # fmt: skip
        barriers += epi_barriers
    items += [
        SmemItem("alignment padding", _round_up(barriers, BUFFER_ALIGN) - barriers, "buffers start 1024-aligned"),
        SmemItem("A ring", cfg.tile_m * cfg.tile_k * esize * cfg.ab_stages,
                 f"{cfg.ab_stages} x {cfg.tile_m}x{cfg.tile_k} {ab_dtype}"),
        SmemItem("B ring", cfg.tile_n * cfg.tile_k * esize * cfg.ab_stages,
                 f"{cfg.ab_stages} x {cfg.tile_n}x{cfg.tile_k} {ab_dtype}"),
    ]  # fmt: skip
    d_bytes = epi_stage_bytes(cfg, d_dtype) * cfg.num_epi_stages
    shape = f"{cfg.num_epi_stages} x {cfg.epi_tile[0]}x{cfg.epi_tile[1]} {d_dtype}"
    if cfg.epi_reuses_ab_smem:
        items.append(SmemItem("D staging", 0, f"{shape}, aliases the A ring ({d_bytes} B)"))
    else:
        items.append(SmemItem("D staging", _round_up(d_bytes, BUFFER_ALIGN), shape))
    regions = epilogue_region(cfg, epi)
    for i, region in enumerate(regions):
        end = regions[i + 1].offset if i + 1 < len(regions) else epilogue_region_bytes(cfg, epi)
        items.append(SmemItem(region.name, end - region.offset, region.what))
    return items


def smem_total(cfg: GemmConfig, ab_dtype: str, d_dtype: str, epi: EpilogueBuffers = NO_EPILOGUE) -> int:
    return sum(item.bytes for item in smem_table(cfg, ab_dtype, d_dtype, epi))


def epi_fits_in_a_ring(cfg: GemmConfig, ab_dtype: str, d_dtype: str) -> bool:
    a_ring = cfg.tile_m * cfg.tile_k * DTYPE_BYTES[ab_dtype] * cfg.ab_stages
    return epi_stage_bytes(cfg, d_dtype) * cfg.num_epi_stages <= a_ring
