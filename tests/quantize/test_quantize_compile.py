"""Compile the group and tile quantizers for sm_90a with fake tensors (no GPU needed): every input and fp8 dtype, both
scale formats; no spills."""

from __future__ import annotations

import pytest

from epicute.quantize.launch import QuantizeVariant, TileQuantizeVariant, compile_quantize, compile_tile_quantize

pytestmark = pytest.mark.compile


@pytest.mark.parametrize("in_dtype", ["bf16", "fp16"])
@pytest.mark.parametrize(("out_dtype", "ue8m0"), [("fp8e4m3", False), ("fp8e4m3", True), ("fp8e5m2", False)])
def test_variants_compile(in_dtype, out_dtype, ue8m0, ptxas_report):
    assert callable(compile_quantize(QuantizeVariant(in_dtype, out_dtype, ue8m0)))
    spills, _ = ptxas_report()
    assert spills == [0]


@pytest.mark.parametrize("k", (256, 512, 1024))
def test_rowwise_variants_compile(k, ptxas_report):
    # whole rows of up to a warp's lanes (16 or 32 values each): a decode step's query heads, one scale a row
    variant = QuantizeVariant.rowwise("bf16", "fp8e4m3", False, k)
    assert variant.group_n == k and variant.values_per_lane * 32 >= k
    assert callable(compile_quantize(variant))
    spills, _ = ptxas_report()
    assert spills == [0]


@pytest.mark.parametrize(("rows", "columns"), [("groups", "blocks"), ("blocks", "blocks"), ("groups", "groups"),
                                               (None, "groups"), ("blocks", None), ("groups", None)])  # fmt: skip
@pytest.mark.parametrize(("in_dtype", "out_dtype", "ue8m0"), [("bf16", "fp8e4m3", False), ("fp16", "fp8e5m2", True)])
def test_tile_variants_compile(in_dtype, out_dtype, ue8m0, rows, columns, ptxas_report):
    assert callable(compile_tile_quantize(TileQuantizeVariant(in_dtype, out_dtype, ue8m0, rows, columns)))
    spills, _ = ptxas_report()
    assert spills == [0]
