"""Trace-time constants in the epilogue emitter: conversions round them as the reference does (the DSL keeps a
constant's Python value when converting it, so ``Float32(-3.19).to(Float8E5M2)`` would stay -3.19)."""

from __future__ import annotations

import pytest
import torch

from epicute.epilogue.dtypes import round_to as reference_round

cutlass = pytest.importorskip("cutlass")


@pytest.mark.parametrize("dtype", ["fp8e5m2", "fp8e4m3", "bf16", "fp16", "fp32"])
@pytest.mark.parametrize("value", [-3.18856, 0.1, 1000.0, -60000.0, 1.0001, 3e-6])
def test_constants_round_like_the_reference(dtype, value):
    from epicute.sm90.epilogue_emit import round_scalar, round_to

    want = float(reference_round(torch.tensor(value, dtype=torch.float32), dtype).float())
    assert round_to(cutlass.Float32(value), dtype).value == want
    assert float(round_scalar(cutlass.Float32(value), dtype).value) == want
