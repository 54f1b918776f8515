"""The GEMM kernel's shared memory: one :class:`~epicute.sm90.smem_layout.SmemLayout`.

:func:`gemm_smem_layout` lists the kernel's storage in struct order: the mbarrier
arrays first, then each data buffer 1024-aligned -- the A and B rings, D's staging
buffers (aliasing the idle A ring when ``epi_reuses_ab_smem``), and the fused
epilogue's buffers (:class:`EpilogueBuffers` says what it needs): a ring per
full-tile operand that the producer's epilogue-load warp fills by TMA one subtile
ahead, a staging ring per auxiliary tile output, and the row/column vector slices of
the current tile (fp32). The kernel allocates ``gemm_smem_layout(...).struct()``
and ``explain`` prints ``.table()``: the same object, so the table sums to the
kernel's real total by construction, and the planner fits stages into the budget
with it.
"""

from __future__ import annotations

from epicute.epilogue.dtypes import DTYPE_BYTES
from epicute.epilogue.schedule import NO_EPILOGUE, EpilogueBuffers
from epicute.gemm.config import B_SCALE_SLOT, GemmConfig, b_scale_chunks
from epicute.sm90.smem_layout import BUFFER_ALIGN, MBARRIER_BYTES, SmemBuffer, SmemItem, SmemLayout


def gemm_smem_layout(
    cfg: GemmConfig,
    ab_dtype: str,
    d_dtype: str,
    epi: EpilogueBuffers = NO_EPILOGUE,
    b_dtype: str = "",
    block_scaled: bool = False,
) -> SmemLayout:
    """The kernel's shared storage for ``cfg`` (fields ``ab_barriers``, ``epi_barriers``, ``sA``,
    ``sB``, ``sD``, the blockwise scales' ``sScaleA``, ``sScaleB`` and the epilogue's ``epi_tile_<i>``,
    ``epi_aux_<i>``, ``epi_vec_<i>``); ``b_dtype``: B's dtype where it is not A's (fp8 e4m3 x e5m2: the
    same size)."""
    b_dtype = b_dtype or ab_dtype
    epi_elems = cfg.epi_tile[0] * cfg.epi_tile[1]
    subtile = f"{cfg.epi_tile[0]}x{cfg.epi_tile[1]}"
    barrier = MBARRIER_BYTES
    buffers = [SmemBuffer("ab_barriers", "mainloop barriers", "int64", 2 * cfg.ab_stages,
                          f"{cfg.ab_stages} full + {cfg.ab_stages} empty mbarriers", align=barrier)]  # fmt: skip
    if epi.loads_tiles:
        c = cfg.num_c_stages
        buffers.append(SmemBuffer("epi_barriers", "epilogue-load barriers", "int64", 2 * c,
                                  f"{c} full + {c} empty mbarriers", align=barrier))  # fmt: skip
    d_stages = cfg.num_c_stages if cfg.reuse_smem_c else cfg.num_epi_stages
    d_shape = f"{d_stages} x {subtile} {d_dtype}"
    d_count = epi_elems * d_stages
    d_what, d_alias = d_shape, ""
    if cfg.epi_reuses_ab_smem:
        d_what, d_alias = f"{d_shape}, aliases the A ring ({d_count * DTYPE_BYTES[d_dtype]} B)", "sA"
    elif cfg.reuse_smem_c:
        d_what, d_alias = f"{d_shape}, in operand tile 0's ring (ReuseSmemC)", "epi_tile_0"
    buffers += [
        SmemBuffer("sA", "A ring", ab_dtype, cfg.tile_m * cfg.tile_k * cfg.ab_stages,
                   f"{cfg.ab_stages} x {cfg.tile_m}x{cfg.tile_k} {ab_dtype}"),
        SmemBuffer("sB", "B ring", b_dtype, cfg.tile_n * cfg.tile_k * cfg.ab_stages,
                   f"{cfg.ab_stages} x {cfg.tile_n}x{cfg.tile_k} {b_dtype}"),
        SmemBuffer("sD", "D staging", d_dtype, d_count, d_what, alias_of=d_alias),
    ]  # fmt: skip
    if block_scaled:  # each A/B stage's k-tile of scales rides in the same ring (GemmSm90._copy_block_scales)
        s, chunks = cfg.ab_stages, b_scale_chunks(cfg.tile_n)
        buffers += [
            SmemBuffer("sScaleA", "A block scales", "fp32", cfg.tile_m * s,
                       f"{s} x {cfg.tile_m} fp32, a scale per row per stage", align=128),  # a TMA destination
            SmemBuffer("sScaleB", "B block scales", "fp32", s * B_SCALE_SLOT,
                       f"{s} x 16-byte slots, the tile's block of N per stage" if chunks == 1
                       else f"{s} x 16-byte slots, a block per {cfg.tile_n // chunks} columns per stage",
                       align=16),  # a bulk copy's destination
        ]  # fmt: skip
    if cfg.split_k > 1:
        buffers.append(SmemBuffer("split_arrival", "split-K arrival", "int32", 1,
                                  "the tile's splits finished before this one", align=16))  # fmt: skip
    for i, dtype in enumerate(epi.tile_inputs):
        buffers.append(SmemBuffer(f"epi_tile_{i}", f"operand tile {i}", dtype, epi_elems * cfg.num_c_stages,
                                  f"{cfg.num_c_stages} x {subtile} {dtype}, TMA-loaded"))  # fmt: skip
    for i, dtype in enumerate(epi.aux_outputs):
        buffers.append(SmemBuffer(f"epi_aux_{i}", f"aux output {i}", dtype, epi_elems * cfg.num_epi_stages,
                                  f"{cfg.num_epi_stages} x {subtile} {dtype}, TMA-stored"))  # fmt: skip
    for i, kind in enumerate(epi.vectors):
        length = epi.out_tile_n(cfg.tile_n) if kind == "row" else cfg.tile_m
        buffers.append(SmemBuffer(f"epi_vec_{i}", f"{kind} vector {i}", "fp32", length,
                                  f"{length} fp32, this tile's slice"))  # fmt: skip
    return SmemLayout(tuple(buffers))


def smem_table(
    cfg: GemmConfig, ab_dtype: str, d_dtype: str, epi: EpilogueBuffers = NO_EPILOGUE, block_scaled: bool = False
) -> list[SmemItem]:
    """Every region of the kernel's shared storage, padding included, in order."""
    return gemm_smem_layout(cfg, ab_dtype, d_dtype, epi, block_scaled=block_scaled).table()


def smem_total(
    cfg: GemmConfig, ab_dtype: str, d_dtype: str, epi: EpilogueBuffers = NO_EPILOGUE, block_scaled: bool = False
) -> int:
    return gemm_smem_layout(cfg, ab_dtype, d_dtype, epi, block_scaled=block_scaled).total_bytes


def epilogue_smem_bytes(
    cfg: GemmConfig, ab_dtype: str, d_dtype: str, epi: EpilogueBuffers, block_scaled: bool = False
) -> int:
    """What the fused epilogue adds to the kernel's shared memory (its buffers and barriers)."""
    return smem_total(cfg, ab_dtype, d_dtype, epi, block_scaled) - smem_total(cfg, ab_dtype, d_dtype, NO_EPILOGUE,
                                                                              block_scaled)  # fmt: skip


def ab_stage_bytes(cfg: GemmConfig, ab_dtype: str) -> int:
    return (cfg.tile_m + cfg.tile_n) * cfg.tile_k * DTYPE_BYTES[ab_dtype]


def epi_stage_bytes(cfg: GemmConfig, d_dtype: str) -> int:
    return cfg.epi_tile[0] * cfg.epi_tile[1] * DTYPE_BYTES[d_dtype]


def epi_fits_in_a_ring(cfg: GemmConfig, ab_dtype: str, d_dtype: str) -> bool:
    a_ring = cfg.tile_m * cfg.tile_k * DTYPE_BYTES[ab_dtype] * cfg.ab_stages
    return epi_stage_bytes(cfg, d_dtype) * cfg.num_epi_stages <= a_ring


__all__ = [
    "BUFFER_ALIGN", "NO_EPILOGUE", "EpilogueBuffers", "SmemItem", "ab_stage_bytes", "epi_fits_in_a_ring",
    "epi_stage_bytes", "epilogue_smem_bytes", "gemm_smem_layout", "smem_table", "smem_total",
]  # fmt: skip
