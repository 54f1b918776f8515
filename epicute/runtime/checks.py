"""Checks every kernel family makes before a launch: the device, TMA's alignment rule, aliasing.

Each raises an :class:`~epicute.errors.EpicuteError` subclass naming the argument and the fix.
"""

from __future__ import annotations

import torch

from epicute.errors import DeviceError

#: TMA moves whole 16-byte units: base addresses and every stride but the unit one are multiples of it.
TMA_ALIGN_BYTES = 16


def with_aligned_unit_dims(t: torch.Tensor, contiguous_dim: int) -> torch.Tensor:
    """``t`` with the stride of each size-1 dimension but ``contiguous_dim`` made a multiple of 16 bytes (a view):
    no index steps along such a dimension, but a TMA descriptor encodes every stride, so it gets an aligned value
    instead of rejecting the tensor. Other strides are left as they are."""
    step = TMA_ALIGN_BYTES // t.element_size()
    strides = [
        -(-max(st, 1) // step) * step if size == 1 and d != contiguous_dim and (st % step or st == 0) else st
        for d, (size, st) in enumerate(zip(t.shape, t.stride()))
    ]
    return t if strides == list(t.stride()) else t.as_strided(t.shape, strides)


def check_has_values(*named: tuple[str, torch.Tensor]) -> None:
    """Raise :class:`DeviceError` for a ``meta`` tensor: the reference backend computes values, and it has none."""
    for name, t in named:
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            raise DeviceError(
                f"{name} is a meta tensor: backend='reference' computes values and it has none; pass real tensors "
                "(explain works on meta tensors)"
            )


def check_on_one_hopper_gpu(*named: tuple[str, torch.Tensor]) -> None:
    """Raise :class:`DeviceError` unless every ``(name, tensor)`` lives on one CUDA device, a Hopper GPU."""
    for name, t in named:
        if t.device.type != "cuda":
            raise DeviceError(f"{name} is on {t.device}; epicute kernels run on a CUDA device: pass {name}.cuda()")
    devices = {t.device for _, t in named}
    if len(devices) > 1:
        where = ", ".join(f"{name} on {t.device}" for name, t in named)
        raise DeviceError(f"{where}; move them to one GPU")
    device = named[0][1].device
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        raise DeviceError(
            f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}; epicute's kernels need a Hopper GPU (sm_90)"
        )


def span_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to just past its last (0 when empty)."""
    if t.numel() == 0:
        return 0
    return (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def ranges_meet(x0: int, x_span: int, y0: int, y_span: int) -> bool:
    """Whether byte ranges ``[x0, x0 + x_span)`` and ``[y0, y0 + y_span)`` meet."""
    return x0 < y0 + y_span and y0 < x0 + x_span


def overlaps(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr():
        return False
    return ranges_meet(x.data_ptr(), span_bytes(x), y.data_ptr(), span_bytes(y))


__all__ = ["TMA_ALIGN_BYTES", "check_has_values", "check_on_one_hopper_gpu", "overlaps", "ranges_meet", "span_bytes"]
