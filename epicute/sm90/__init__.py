"""The Hopper (SM90) toolkit the kernel families share, written in the CuTe DSL.

- :mod:`~epicute.sm90.pipeline`: TMA load rings, ring state, the TMA-store epilogue, named barriers;
- :mod:`~epicute.sm90.tile_scheduler`: persistent tile schedulers;
- :mod:`~epicute.sm90.fragments`: accumulator fragment helpers;
- :mod:`~epicute.sm90.epilogue_emit`: the fused epilogue's device half (each node as DSL code).

Each family's kernel lives in its package (``epicute/gemm/kernel_sm90.py``,
``epicute/attention/kernel_sm90.py``). The target architecture (``CUTE_DSL_ARCH``)
is defaulted in ``epicute/__init__.py``, which runs before anything imports ``cutlass``.
"""

import warnings

#: The modules that hold CuTe-DSL kernel code (the filter below is theirs alone).
KERNEL_MODULES = r"epicute\.(sm90\.|gemm\.kernel_sm90|attention\.kernel_sm90)"

# The DSL suggests cutlass.range(..., unroll_full=True) for every range_constexpr loop of 64+ iterations
# (DSLOptimizationWarning). Ours unroll in Python on purpose: the emitted code is what the tuned kernels
# were measured with. Filtered by message and by our module only, so the DSL's other advice still shows.
warnings.filterwarnings("ignore", message=r"This static loop has \d+ iterations", module=KERNEL_MODULES)
