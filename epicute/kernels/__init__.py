"""Kernels written in the CuTe DSL and the pipeline pieces they share.

The target architecture (``CUTE_DSL_ARCH``, sm_90a unless set) is defaulted in
``epicute/__init__.py``, which runs before anything here imports ``cutlass``.
"""

import warnings

# The DSL suggests cutlass.range(..., unroll_full=True) for every range_constexpr loop of 64+ iterations
# (DSLOptimizationWarning). Ours unroll in Python on purpose: the emitted code is what the tuned kernels
# were measured with. Filtered by message and by our module only, so the DSL's other advice still shows.
warnings.filterwarnings("ignore", message=r"This static loop has \d+ iterations", module=r"epicute\.kernels\.")
