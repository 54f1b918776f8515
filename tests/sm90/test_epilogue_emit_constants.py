"""Trace-time constants in the epilogue emitter: conversions round them as the reference does (the DSL keeps a
constant's Python value when converting it, so ``Float32(-3.19).to(Float8E5M2)`` would stay -3.19)."""

from __future__ import annotations

import pytest

cutlass = pytest.importorskip("cutlass")

#: (value, dtype, the value rounded to nearest even in dtype, saturating for fp8), worked out by hand from each
#: format's spacing around the value.
ROUNDED = [
    (-3.18856, "fp8e5m2", -3.0),  # spacing 0.5 in [2, 4)
    (1000.0, "fp8e5m2", 1024.0),  # spacing 128 in [512, 1024)
    (-60000.0, "fp8e5m2", -57344.0),  # saturates
    (0.1, "fp8e5m2", 0.09375),  # spacing 2^-6 in [2^-4, 2^-3)
    (-3.18856, "fp8e4m3", -3.25),  # spacing 0.25
    (1000.0, "fp8e4m3", 448.0),  # saturates
    (0.1, "fp8e4m3", 0.1015625),  # spacing 2^-7
    (-3.18856, "bf16", -3.1875),  # spacing 2^-6
    (1.0001, "bf16", 1.0),
    (1.0001, "fp16", 1.0),  # spacing 2^-10 in [1, 2)
    (0.75, "fp8e4m3", 0.75),  # exact
]


@pytest.mark.parametrize(("value", "dtype", "rounded"), ROUNDED)
def test_constants_are_rounded_at_trace_time(value, dtype, rounded):
    from epicute.sm90.epilogue_emit import round_scalar, round_to

    assert round_to(cutlass.Float32(value), dtype).value == rounded
    assert float(round_scalar(cutlass.Float32(value), dtype).value) == rounded
