"""A fused epilogue's tensors, checked and arranged for the kernel.

The kernel takes its epilogue tensors as one tuple in
``EpilogueFusion.tensor_args`` order: operand tiles (read by TMA, so they obey
D's rules: row-major, 16-byte aligned base and strides), row and column
vectors (read element by element: any strides), aux outputs (written by TMA)
and fp32 reduction workspaces. Everything here runs before the launch, so a bad
operand fails with an error naming it.

One documented copy: a 2-D tile operand in a batched GEMM is broadcast over L
(a zero batch stride), which TMA cannot describe; it is materialized once per
call.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from epicute.epilogue.dtypes import IR_TO_TORCH
from epicute.epilogue.graph import UP_OUTPUT
from epicute.epilogue.operands import OperandSpec
from epicute.errors import DeviceError, OutputError
from epicute.gemm.validate import _check_tma_strides


def _on_device(t: torch.Tensor, name: str, device: torch.device) -> None:
    if t.device != device:
        raise DeviceError(f"{name} is on {t.device}; move it to {device} (where a and b are)")


def kernel_inputs(fusion, specs: Mapping[str, OperandSpec], device: torch.device) -> tuple[tuple, tuple]:
    """The kernel's operand tensors (tile, row, col; fusion order) and fp32 scalars."""
    tensors = []
    for role, name, _ in fusion.tensor_args:
        if role not in ("tile", "row", "col"):
            continue
        value = specs[name].value
        _on_device(value, f"operand {name!r}", device)
        if role == "tile":
            if value.shape[0] > 1 and value.stride(0) == 0:
                value = value.contiguous()  # the documented broadcast copy (see module docstring)
            value = _check_tma_strides(value, f"operand {name!r}", contiguous_dim=2, dims="LMN")
        tensors.append(value)
    scalars = tuple(float(specs[name].value) for name in fusion.scalar_inputs)
    return tuple(tensors), scalars


def check_outs_names(outs: Mapping[str, torch.Tensor], aux_names: tuple[str, ...]) -> None:
    """``outs`` may only name the epilogue's aux tile outputs."""
    unknown = set(outs) - set(aux_names)
    if unknown:
        raise OutputError(
            f"outs names {sorted(unknown)}, which the epilogue does not return as aux tiles "
            f"(it returns {list(aux_names)}; pass D as out=)"
        )


def check_outs(fusion, outs: Mapping[str, torch.Tensor], lmn: tuple[int, int, int], batched: bool) -> dict:
    """``outs`` as the kernel takes them (names, shapes, dtypes, TMA-storable layouts; not their device): each
    as an ``(L, M, N)`` tensor by name."""
    check_outs_names(outs, fusion.aux_outputs)
    if fusion.paired and UP_OUTPUT in outs:
        raise OutputError(f"outs[{UP_OUTPUT!r}]: D_up is stored interleaved with D, in D's tensor; leave it out")
    dtypes = fusion.output_dtypes
    checked = {}
    for name, t in outs.items():
        dtype = IR_TO_TORCH[dtypes[name]]
        label = f"outs[{name!r}]"
        expected = lmn if batched else lmn[1:]
        if tuple(t.shape) != expected:
            raise OutputError(f"{label} has shape {tuple(t.shape)}; the epilogue writes {expected}")
        if t.dtype != dtype:
            raise OutputError(f"{label} has dtype {t.dtype} but the output is {dtype}; set out_dtypes[{name!r}]")
        if t.numel() and t.size(-1) > 1 and t.stride(-1) != 1:
            raise OutputError(f"{label} has strides {tuple(t.stride())}; it must be row-major (last stride 1), as "
                              "TMA stores it")  # fmt: skip
        t3 = t if batched else t.unsqueeze(0)
        checked[name] = _check_tma_strides(t3, label, contiguous_dim=2, dims="LMN")
    return checked


def aux_outputs(
    fusion, outs: Mapping[str, torch.Tensor], lmn: tuple[int, int, int], batched: bool, device: torch.device
) -> dict[str, torch.Tensor]:
    """Every aux output as an ``(L, M, N)`` tensor: the caller's from ``outs`` (checked), else new."""
    checked = check_outs(fusion, outs, lmn, batched)
    dtypes = fusion.output_dtypes
    result = {}
    for name in fusion.aux_outputs:
        if fusion.paired and name == UP_OUTPUT:  # D's own tensor (bind_gemm), which the caller cannot pass
            continue
        t = checked.get(name)
        if t is None:  # prepare() checked that TMA can store its rows
            result[name] = torch.empty(lmn, dtype=IR_TO_TORCH[dtypes[name]], device=device)
            continue
        _on_device(t, f"outs[{name!r}]", device)
        result[name] = t
    return result
