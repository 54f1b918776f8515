"""Shared-memory accounting: the byte table the kernel's storage struct will have.

The kernel lays its shared storage out as a struct: the mbarrier array first,
then each data buffer aligned to 1024 bytes (the 128-byte swizzle pattern
repeats every 1024 bytes, and TMA/WGMMA descriptors assume that alignment).
This module mirrors that layout exactly so that the planner can fit stages into
the budget and ``explain`` can print a table that sums to the real total.
"""

from __future__ import annotations

from dataclasses import dataclass

from epicute.plan.config import DTYPE_BYTES, GemmConfig

BUFFER_ALIGN = 1024
MBARRIER_BYTES = 8


def _round_up(x: int, align: int) -> int:
    return (x + align - 1) // align * align


@dataclass(frozen=True)
class SmemItem:
    name: str
    bytes: int
    what: str


def ab_stage_bytes(cfg: GemmConfig, ab_dtype: str) -> int:
    return (cfg.tile_m + cfg.tile_n) * cfg.tile_k * DTYPE_BYTES[ab_dtype]


def epi_stage_bytes(cfg: GemmConfig, d_dtype: str) -> int:
    return cfg.epi_tile[0] * cfg.epi_tile[1] * DTYPE_BYTES[d_dtype]


def smem_table(cfg: GemmConfig, ab_dtype: str, d_dtype: str) -> list[SmemItem]:
    """Every region of the kernel's shared storage, padding included, in order."""
    esize = DTYPE_BYTES[ab_dtype]
    barriers = 2 * cfg.ab_stages * MBARRIER_BYTES  # full + empty per A/B stage
    items = [
        SmemItem("mainloop barriers", barriers, f"{cfg.ab_stages} full + {cfg.ab_stages} empty mbarriers"),
        SmemItem("alignment padding", _round_up(barriers, BUFFER_ALIGN) - barriers, "buffers start 1024-aligned"),
        SmemItem("A ring", cfg.tile_m * cfg.tile_k * esize * cfg.ab_stages,
                 f"{cfg.ab_stages} x {cfg.tile_m}x{cfg.tile_k} {ab_dtype}"),
        SmemItem("B ring", cfg.tile_n * cfg.tile_k * esize * cfg.ab_stages,
                 f"{cfg.ab_stages} x {cfg.tile_n}x{cfg.tile_k} {ab_dtype}"),
    ]  # fmt: skip
    epi = epi_stage_bytes(cfg, d_dtype) * cfg.num_epi_stages
    shape = f"{cfg.num_epi_stages} x {cfg.epi_tile[0]}x{cfg.epi_tile[1]} {d_dtype}"
    if cfg.epi_reuses_ab_smem:
        items.append(SmemItem("D staging", 0, f"{shape}, aliases the A ring ({epi} B)"))
    else:
        items.append(SmemItem("D staging", _round_up(epi, BUFFER_ALIGN), shape))
    return items


def smem_total(cfg: GemmConfig, ab_dtype: str, d_dtype: str) -> int:
    return sum(item.bytes for item in smem_table(cfg, ab_dtype, d_dtype))


def epi_fits_in_a_ring(cfg: GemmConfig, ab_dtype: str, d_dtype: str) -> bool:
    a_ring = cfg.tile_m * cfg.tile_k * DTYPE_BYTES[ab_dtype] * cfg.ab_stages
    return epi_stage_bytes(cfg, d_dtype) * cfg.num_epi_stages <= a_ring
