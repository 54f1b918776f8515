"""Device buffers kept between launches (work counters, zero operands, split-K workspaces).

A kept buffer must not come from a CUDA graph's private memory pool: cached process-wide it would outlive the
graph (torch.compile's CUDA-graph trees refuse such a dangling allocation, and a later eager launch would write
into memory the graph owns). Two cases allocate from a graph's pool: a stream capturing a graph, and a call
from a compiled graph that CUDA-graph trees are warming up (its allocations already go to the pool, with no
capture to tell). So buffers are kept only by eager calls: calls through the torch ops (what compiled graphs
run) are wrapped in :func:`per_call_buffers`, and their buffers are allocated per call, recorded with their
initialization where a graph captures them.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Hashable, MutableMapping
from typing import TypeVar

import torch

T = TypeVar("T")
F = TypeVar("F", bound=Callable)

_PER_CALL = contextvars.ContextVar("epicute_per_call_buffers", default=False)


def keeping() -> bool:
    """Whether buffers allocated now may be kept: an eager call, no CUDA graph capturing on this stream."""
    return not _PER_CALL.get() and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def stream_key(device: torch.device) -> tuple:
    """``(device, its current stream's raw handle)``: the key of a buffer kept per stream. The raw handle, not
    ``torch.cuda.current_stream()``, which builds a Stream object (a microsecond per call on the launch path). A
    device without an index (``torch.device("cuda")``) is the current one, as torch reads it."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    return device, torch._C._cuda_getCurrentRawStream(device.index)


def keep(cache: MutableMapping[Hashable, T], key: Hashable, value: T) -> T:
    """``value``, stored in ``cache`` under ``key`` where :func:`keeping`."""
    if keeping():
        cache[key] = value
    return value


def per_call_buffers(fn: F) -> F:
    """``fn``, whose calls keep none of the buffers they allocate (:func:`keep` stores nothing)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        token = _PER_CALL.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _PER_CALL.reset(token)

    return run  # type: ignore[return-value]
