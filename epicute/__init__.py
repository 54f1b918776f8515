"""epicute: a Python compiler for fused NVIDIA Hopper (SM90) kernels.

Public surface: :func:`gemm`, :func:`explain`, :func:`prepare_gemm` (a GEMM call prepared once, for
serving loops), and the :class:`EpicuteError` hierarchy. Planning lives in :mod:`epicute.gemm`, CuTe-DSL kernels in
:mod:`epicute.sm90`, validation/compile/launch in :mod:`epicute.runtime`.
Fused epilogues: the :func:`epilogue` decorator, :mod:`ops`, ready ones in ``epilogues``
and the operand pins, all from :mod:`epicute.epilogue`.
Grouped GEMMs (mixture-of-experts): :func:`grouped_gemm` and :func:`explain_grouped`.
Attention: :func:`attention` (FlashAttention-3 style forward) with traced
``score_mod`` and ``epilogue`` hooks, and :func:`explain_attention`.
"""

import os

from epicute.runtime.target import DEFAULT_ARCH  # pure Python: neither torch nor the DSL

# The DSL reads its target architecture when ``cutlass`` is first imported; on a
# machine without a GPU it would assume a newer one than we compile for. Every
# epicute module imports ``cutlass`` (lazily) after this line has run.
os.environ.setdefault("CUTE_DSL_ARCH", DEFAULT_ARCH)

from epicute import errors
from epicute.attention.api import attention, explain_attention
from epicute.epilogue import library as epilogues
from epicute.epilogue import ops
from epicute.epilogue.gated import interleave_gate_up
from epicute.epilogue.operands import ColVector, RowVector, Scalar, Tile
from epicute.epilogue.score_mod import score_mod
from epicute.epilogue.tracer import epilogue
from epicute.errors import *  # noqa: F403  (every error class: errors.__all__)
from epicute.gemm.api import explain, gemm, prepare_gemm, tune
from epicute.gemm.prepared import PreparedGemmCall
from epicute.grouped.api import explain_grouped, grouped_gemm
from epicute.quantize.api import quantize
from epicute.runtime import torch_ops as _torch_ops
from epicute.runtime.backend import use_backend

__version__ = "0.1.0"

# torch.ops.epicute.*: every declared family's op (epicute/families.py), defined here and only here.
_torch_ops.define_ops()

__all__ = [
    "ColVector", "PreparedGemmCall", "RowVector", "Scalar", "Tile", "__version__", "attention", "epilogue",
    "epilogues", "explain", "explain_attention", "explain_grouped", "gemm", "grouped_gemm", "interleave_gate_up", "ops",
    "prepare_gemm", "quantize", "score_mod", "tune", "use_backend",
]  # fmt: skip
__all__ += errors.__all__  # every error class: users catch them by name
