"""Kernels written in the CuTe DSL and the pipeline pieces they share.

The target architecture (``CUTE_DSL_ARCH``, sm_90a unless set) is defaulted in
``epicute/__init__.py``, which runs before anything here imports ``cutlass``.
"""
