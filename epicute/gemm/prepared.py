"""The cached path of a GEMM call: :class:`PreparedCall`.

The first call of a given signature (``epicute.gemm.api._fast_key``: every tensor's shape, strides, dtype, device
and 16-byte alignment class; the numbers' types; the epilogue's capture, output dtypes and config
pins) goes the whole way: validation, tracing and planning (:func:`epicute.gemm.prepare.prepare`),
then binding (:func:`epicute.gemm.launch.bind_gemm`). Its launch is then recorded: each tensor the
kernel takes is one of the caller's, a view of one (replayed with ``as_strided``), or an output
or workspace allocated for the call (allocated again). A later call of the same signature replays
the record and launches. Everything validation, tracing and planning decided depends on nothing
but the signature, except whether ``out`` overlaps ``a`` or ``b``, which the caller checks per call.

Not recorded, so always taking the whole path: launches that copied a tensor (a 2-D tile operand
broadcast over a batch, K = 0's zero operands) and calls where distinct tensors share storage
(which of them a view came from would be ambiguous). One tensor passed twice (``a_scale=s,
b_scale=s``) is recorded, and replayed only for calls that pass one tensor twice there too.
"""

from __future__ import annotations

from typing import Any

import torch

from epicute.epilogue.operands import Pin
from epicute.gemm.launch import GemmLaunch
from epicute.runtime.checks import TMA_ALIGN_BYTES

#: Tensor types whose data pointers and views are their own (tensor subclasses such as fake or
#: functional tensors are not, and are never on a hot path).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)

_SAME, _VIEW, _FRESH = 0, 1, 2
#: Stands for a tensor in the recorded launch, which keeps the launch's structure, not its memory.
_VACANT = object()


def unwrap(value: Any) -> Any:
    """An operand's value without its kind pin (``epicute.RowVector(t)`` -> ``t``)."""
    return value.value if isinstance(value, Pin) else value


def source_signature(value: Any) -> object:
    """What validation and planning see of one argument; ``False``: nothing the cached path can key."""
    kind = type(value)
    if kind in _PLAIN_TENSORS:
        return (value.shape, value.stride(), value.dtype, value.device, value.data_ptr() % TMA_ALIGN_BYTES)
    if value is None or kind is float or kind is int:
        return kind
    if isinstance(value, Pin):
        inner = source_signature(value.value)
        return False if inner is False else (type(value), inner)
    return False


class PreparedCall:
    """A recorded launch, repeated for new arguments of the same signature (``epicute.gemm.api._fast_key``).

    ``steps`` rebuild the launch's tensors in :meth:`GemmLaunch.tensors` order from the call's
    sources; ``scalar_sources`` index the sources the kernel's fp32 scalars are read from;
    ``aliases`` are pairs of sources that were one tensor (and must be, for the record to hold).
    """

    __slots__ = ("aliases", "launch", "scalar_sources", "steps")

    def __init__(self, launch: GemmLaunch, steps: tuple, scalar_sources: tuple[int, ...], aliases: tuple = ()):
        self.launch, self.steps, self.scalar_sources, self.aliases = launch, steps, scalar_sources, aliases

    def fits(self, sources: tuple) -> bool:
        """Whether ``sources`` pass one tensor wherever the recorded call did."""
        return all(sources[i] is sources[j] for i, j in self.aliases)

    @classmethod
    def record(cls, launch: GemmLaunch, sources: tuple, scalar_sources: tuple[int, ...]) -> PreparedCall | None:
        """How to rebuild ``launch`` from ``sources`` (the caller's arguments, pins unwrapped); None when
        it cannot be (a tensor copied for the call, or sources sharing storage)."""
        by_storage: dict[int, int] = {}
        aliases = []
        for i, s in enumerate(sources):
            if isinstance(s, torch.Tensor):
                ptr = s.untyped_storage().data_ptr()
                if ptr in by_storage:
                    if sources[by_storage[ptr]] is not s:
                        return None
                    aliases.append((by_storage[ptr], i))
                    continue
                by_storage[ptr] = i
        steps = []
        for t in launch.tensors():
            if id(t) in launch.fresh:
                steps.append((_FRESH, tuple(t.shape), t.dtype, t.device))
                continue
            i = by_storage.get(t.untyped_storage().data_ptr())
            if i is None:
                return None
            s = sources[i]
            if t is s:
                steps.append((_SAME, i))
            else:
                steps.append((_VIEW, i, tuple(t.shape), tuple(t.stride()), t.storage_offset() - s.storage_offset()))
        template = launch.with_tensors([_VACANT] * len(steps), ())
        return cls(template, tuple(steps), scalar_sources, tuple(aliases))

    def __call__(self, sources: tuple) -> torch.Tensor | dict[str, torch.Tensor]:
        """Launch for ``sources`` (the same signature as the recorded call's) and return its results."""
        tensors = []
        for step in self.steps:
            kind = step[0]
            if kind == _SAME:
                tensors.append(sources[step[1]])
            elif kind == _VIEW:
                s = sources[step[1]]
                tensors.append(s.as_strided(step[2], step[3], s.storage_offset() + step[4]))
            else:
                tensors.append(torch.empty(step[1], dtype=step[2], device=step[3]))
        scalars = tuple(_number(sources[i]) for i in self.scalar_sources)
        return self.launch.with_tensors(tensors, scalars).run()


def _number(value: Any) -> float:
    """A scalar operand's value: a Python number, or a 1-element tensor read on the host."""
    return float(value.item() if isinstance(value, torch.Tensor) else value)


__all__ = ["PreparedCall", "source_signature", "unwrap"]
