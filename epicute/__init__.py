"""epicute: a Python compiler for fused NVIDIA Hopper (SM90) kernels.

Public surface: :func:`gemm`, :func:`explain`, and the :class:`EpicuteError`
hierarchy. Planning lives in :mod:`epicute.plan`, CuTe-DSL kernels in
:mod:`epicute.kernels`, validation/compile/launch in :mod:`epicute.runtime`.
Fused epilogues: the :func:`epilogue` decorator, :mod:`ops`, ready ones in ``epilogues``
and the operand pins, all from :mod:`epicute.epilogue`.
Attention: :func:`attention` (FlashAttention-3 style forward) with traced
``score_mod`` and ``epilogue`` hooks, and :func:`explain_attention`.
"""

import os

# The DSL reads its target architecture when ``cutlass`` is first imported; on a
# machine without a GPU it would assume a newer one than we compile for. Every
# epicute module imports ``cutlass`` (lazily) after this line has run.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from epicute.api import explain, gemm, tune
from epicute.attention_api import attention, explain_attention
from epicute.epilogue import library as epilogues
from epicute.epilogue import ops
from epicute.epilogue.operands import ColVector, RowVector, Scalar, Tile
from epicute.epilogue.score_mod import score_mod
from epicute.epilogue.tracer import epilogue
from epicute.errors import (
    AlignmentError,
    CompileError,
    ConfigError,
    DeviceError,
    DtypeError,
    EpicuteError,
    EpilogueError,
    OutputError,
    ShapeError,
)

__version__ = "0.1.0"

__all__ = [
    "gemm", "explain", "tune", "EpicuteError", "AlignmentError", "CompileError", "ConfigError",
    "DeviceError", "DtypeError", "OutputError", "ShapeError", "__version__",
]  # fmt: skip
__all__ += ["epilogue", "ops", "epilogues", "RowVector", "ColVector", "Scalar", "Tile", "EpilogueError"]
__all__ += ["attention", "explain_attention", "score_mod"]
