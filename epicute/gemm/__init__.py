"""The GEMM kernel family: from a call to its planned, compiled, launched kernel.

:mod:`epicute.gemm.prepare` is the one path every entry point takes. The public
function ``epicute.gemm`` shares this package's name: import from the modules
(``from epicute.gemm.prepare import prepare``), never ``import epicute.gemm.x as y``.
"""
