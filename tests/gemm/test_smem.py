"""Shared-memory accounting: the table mirrors the kernel's storage struct byte for byte."""

from __future__ import annotations

import pytest

from epicute.gemm import GemmConfig
from epicute.gemm.smem import (
    BUFFER_ALIGN,
    ab_stage_bytes,
    epi_fits_in_a_ring,
    epi_stage_bytes,
    smem_table,
    smem_total,
)

CONFIGS = [
    (GemmConfig(), "bf16", "bf16"),
    (GemmConfig(tile_n=128, ab_stages=6, epi_tile=(128, 64)), "fp16", "fp32"),
    (GemmConfig(tile_n=64, ab_stages=8, persistent=False, epi_reuses_ab_smem=True), "bf16", "fp32"),
    (GemmConfig(tile_n=256, ab_stages=2, epi_tile=(128, 16), num_epi_stages=1), "fp16", "fp16"),
    (GemmConfig(tile_n=128, ab_stages=3, epi_tile=(128, 128), num_epi_stages=2), "bf16", "bf16"),
]
CONFIG_IDS = [f"n{c.tile_n}-s{c.ab_stages}-epi{c.epi_tile[1]}x{c.num_epi_stages}-{ab}{d}" for c, ab, d in CONFIGS]


@pytest.mark.parametrize(("cfg", "ab", "d"), CONFIGS, ids=CONFIG_IDS)
def test_table_sums_to_total(cfg, ab, d):
    assert sum(item.bytes for item in smem_table(cfg, ab, d)) == smem_total(cfg, ab, d)


@pytest.mark.parametrize(("cfg", "ab", "d"), CONFIGS, ids=CONFIG_IDS)
def test_every_buffer_starts_1024_aligned(cfg, ab, d):
    table = smem_table(cfg, ab, d)
    assert [item.name for item in table] == [
        "mainloop barriers", "alignment padding", "A ring", "B ring", "D staging",
    ]  # fmt: skip
    offset = 0
    for item in table:
        if item.name in ("A ring", "B ring", "D staging"):
            assert offset % BUFFER_ALIGN == 0, f"{item.name} starts at byte {offset}"
        offset += item.bytes


@pytest.mark.parametrize("ab_stages", range(2, 9))
def test_barrier_padding_aligns_the_a_ring(ab_stages):
    barriers, padding = smem_table(GemmConfig(ab_stages=ab_stages), "bf16", "bf16")[:2]
    assert barriers.bytes == 2 * ab_stages * 8
    assert barriers.bytes + padding.bytes == BUFFER_ALIGN


def test_d_staging_is_free_when_it_reuses_the_a_ring():
    cfg = GemmConfig(persistent=False, epi_reuses_ab_smem=True)
    own = GemmConfig(persistent=False)
    d_staging = smem_table(cfg, "bf16", "bf16")[-1]
    assert d_staging.name == "D staging"
    assert d_staging.bytes == 0
    assert "aliases the A ring (32768 B)" in d_staging.what
    assert smem_total(own, "bf16", "bf16") - smem_total(cfg, "bf16", "bf16") == 32768


def test_hand_computed_128x256x64_bf16():
    cfg = GemmConfig(tile_n=256, ab_stages=4, epi_tile=(128, 32), num_epi_stages=4)
    table = {item.name: item.bytes for item in smem_table(cfg, "bf16", "bf16")}
    assert table == {
        "mainloop barriers": 64,  # 4 full + 4 empty mbarriers x 8 B
        "alignment padding": 960,
        "A ring": 65536,  # 4 x 128x64 x 2 B
        "B ring": 131072,  # 4 x 256x64 x 2 B
        "D staging": 32768,  # 4 x 128x32 x 2 B
    }
    assert smem_total(cfg, "bf16", "bf16") == 230400


def test_stage_bytes_by_hand():
    cfg = GemmConfig(tile_n=128, epi_tile=(128, 64))
    assert ab_stage_bytes(cfg, "fp16") == (128 + 128) * 64 * 2
    assert epi_stage_bytes(cfg, "fp32") == 128 * 64 * 4
    assert epi_stage_bytes(cfg, "bf16") == 128 * 64 * 2


def test_epi_fits_in_a_ring():
    # A ring of 2 stages: 2 x 128x64 bf16 = 32768 B.
    cfg = GemmConfig(ab_stages=2, epi_tile=(128, 32), num_epi_stages=4, persistent=False, epi_reuses_ab_smem=True)
    assert epi_fits_in_a_ring(cfg, "bf16", "bf16")  # 4 x 128x32 x 2 B = 32768
    assert not epi_fits_in_a_ring(cfg, "bf16", "fp32")  # 4 x 128x32 x 4 B = 65536


def test_epilogue_buffers_are_in_the_table_and_the_total():
    from epicute.gemm.smem import EpilogueBuffers, gemm_smem_layout

    cfg = GemmConfig(tile_n=256, ab_stages=3, num_epi_stages=2, num_c_stages=2)
    epi = EpilogueBuffers(tile_inputs=("bf16", "fp32"), aux_outputs=("fp8e4m3",), vectors=("row", "col"))
    layout = gemm_smem_layout(cfg, "bf16", "bf16", epi)
    fields = ["epi_tile_0", "epi_tile_1", "epi_aux_0", "epi_vec_0", "epi_vec_1"]
    assert [layout.buffer(f).name for f in fields] == [
        "operand tile 0", "operand tile 1", "aux output 0", "row vector 0", "col vector 1"
    ]  # fmt: skip
    assert [layout.buffer(f).bytes for f in fields] == [2 * 128 * 32 * 2, 2 * 128 * 32 * 4, 2 * 128 * 32, 1024, 512]
    offsets = layout.offsets()
    assert all(offsets[f] % BUFFER_ALIGN == 0 for f in fields)
    plain = smem_total(cfg, "bf16", "bf16")
    table = smem_table(cfg, "bf16", "bf16", epi)
    assert "epilogue-load barriers" in [item.name for item in table]
    # The buffers, each rounded up to 1024 B, are all that is added: their barriers (2 x 2 mbarriers)
    # fit in the padding before the A ring.
    added = sum(-(-layout.buffer(f).bytes // BUFFER_ALIGN) * BUFFER_ALIGN for f in fields)
    assert smem_total(cfg, "bf16", "bf16", epi) == plain + added == sum(item.bytes for item in table)


@pytest.mark.compile
@pytest.mark.parametrize(("cfg", "ab", "d"), CONFIGS, ids=CONFIG_IDS)
def test_the_kernels_struct_is_the_table(cfg, ab, d):
    """The kernel allocates layout.struct(): its size and every field offset are the table's."""
    from epicute.gemm.smem import EpilogueBuffers, gemm_smem_layout

    epi = EpilogueBuffers(tile_inputs=("fp16",), aux_outputs=("fp32",), vectors=("col",))
    for buffers in (EpilogueBuffers(), epi):
        layout = gemm_smem_layout(cfg, ab, d, buffers)
        struct = layout.struct()
        assert struct.size_in_bytes() == layout.total_bytes == sum(item.bytes for item in layout.table())
        owned = {f: o for f, o in layout.offsets().items() if not layout.buffer(f).alias_of}
        assert struct._offsets == owned
