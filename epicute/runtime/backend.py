"""The backend a call runs on when it names none: ``"kernel"`` (the GPU), unless :func:`use_backend` says otherwise.

``"reference"`` computes the same math with torch in float32 on any device, differentiably: a model patched onto
epicute's layers then runs (and trains) on a CPU, as the examples do (``examples/train_llama.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from epicute.errors import ConfigError

BACKENDS = ("kernel", "reference")
_DEFAULT = ["kernel"]


def resolve_backend(backend: str | None) -> str:
    """``backend``, or the default one when it is None; an unknown name is a :class:`ConfigError`."""
    if backend is None:
        return _DEFAULT[0]
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r}: use 'kernel' or 'reference'")
    return backend


def check_traced_backend(backend: str | None) -> None:
    """A call torch.compile traces runs the kernels (its op): an explicit other backend is a :class:`ConfigError`."""
    if backend not in (None, "kernel"):
        raise ConfigError(f"backend={backend!r} cannot be compiled with torch.compile; use backend='kernel'")


@contextlib.contextmanager
def use_backend(backend: str) -> Iterator[None]:
    """Within the block, calls of :func:`epicute.gemm`, :func:`epicute.grouped_gemm` and :func:`epicute.attention`
    that name no backend (the layers' calls, their backward's) run on ``backend``. Process-wide, not per thread:
    autograd runs a backward on a thread of its own. Under ``torch.compile`` calls always run the kernels.

    Example:
        >>> import torch, epicute
        >>> with epicute.use_backend("reference"):
        ...     y = epicute.gemm(torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(16, 8, dtype=torch.bfloat16))
        >>> y.shape
        torch.Size([3, 8])
    """
    resolve_backend(backend)
    previous = _DEFAULT[0]
    _DEFAULT[0] = backend
    try:
        yield
    finally:
        _DEFAULT[0] = previous


__all__ = ["BACKENDS", "check_traced_backend", "resolve_backend", "use_backend"]
