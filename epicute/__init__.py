"""epicute: a Python compiler for fused NVIDIA Hopper (SM90) kernels.

Public surface: :func:`gemm`, :func:`explain`, and the :class:`EpicuteError`
hierarchy. Planning lives in :mod:`epicute.plan`, CuTe-DSL kernels in
:mod:`epicute.kernels`, validation/compile/launch in :mod:`epicute.runtime`.
"""

from epicute.api import explain, gemm
from epicute.errors import (
    AlignmentError,
    CompileError,
    ConfigError,
    DeviceError,
    DtypeError,
    EpicuteError,
    OutputError,
    ShapeError,
)

__version__ = "0.1.0"

__all__ = [
    "gemm", "explain", "EpicuteError", "AlignmentError", "CompileError", "ConfigError",
    "DeviceError", "DtypeError", "OutputError", "ShapeError", "__version__",
]  # fmt: skip
