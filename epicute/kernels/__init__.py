"""Kernels written in the CuTe DSL and the pipeline pieces they share.

The DSL reads its target architecture when it is first imported; without a GPU it
would otherwise assume a newer one. Every kernel module lives below this package,
so setting the default here, before any of them imports ``cutlass``, is enough.
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
