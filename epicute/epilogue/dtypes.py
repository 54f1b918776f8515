"""Dtype names of the epilogue IR and their torch counterparts.

The graph names dtypes with short strings so that it stays plain, printable
Python; users name them with torch dtypes. Every conversion between the two goes
through here, so an unsupported dtype fails in one place with one message.
"""

from __future__ import annotations

import torch

from epicute.errors import EpilogueError

TORCH_TO_IR: dict[torch.dtype, str] = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8e4m3",
    torch.float8_e5m2: "fp8e5m2",
}
IR_TO_TORCH: dict[str, torch.dtype] = {v: k for k, v in TORCH_TO_IR.items()}
#: Element size in bytes of each IR dtype.
DTYPE_BYTES: dict[str, int] = {name: dtype.itemsize for name, dtype in IR_TO_TORCH.items()}

#: Largest finite value of each fp8 format: conversions to fp8 saturate to it
#: (as the hardware's ``cvt.rn.satfinite`` does) instead of overflowing.
FP8_MAX = {"fp8e4m3": 448.0, "fp8e5m2": 57344.0}


def ir_dtype(dtype: torch.dtype | str, what: str) -> str:
    """The IR name of ``dtype`` (a torch dtype or an IR name); ``what`` names it in errors."""
    if isinstance(dtype, str) and dtype in IR_TO_TORCH:
        return dtype
    if isinstance(dtype, torch.dtype) and dtype in TORCH_TO_IR:
        return TORCH_TO_IR[dtype]
    supported = ", ".join(f"torch.{str(d).removeprefix('torch.')}" for d in TORCH_TO_IR)
    raise EpilogueError(f"{what}: dtype {dtype!r} is not supported; use one of {supported}")


def round_to(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """``x`` converted to the IR ``dtype`` (round to nearest even; fp8 saturates, NaN stays NaN)."""
    if dtype in FP8_MAX:
        x = x.clamp(-FP8_MAX[dtype], FP8_MAX[dtype])
    return x.to(IR_TO_TORCH[dtype])
