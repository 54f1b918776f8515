"""The GEMM kernel family: from a call to its planned, compiled, launched kernel.

- :mod:`~epicute.gemm.api`: the public ``gemm``, ``explain`` and ``tune``;
- :mod:`~epicute.gemm.validate`: the call's tensors checked and viewed as ``(L, ., .)``;
- :mod:`~epicute.gemm.prepare`: the one path every entry point takes (request -> plan, fusion);
- :mod:`~epicute.gemm.config`, :mod:`~epicute.gemm.heuristics`, :mod:`~epicute.gemm.smem`,
  :mod:`~epicute.gemm.roofline`, :mod:`~epicute.gemm.plan`, :mod:`~epicute.gemm.report`: planning;
- :mod:`~epicute.gemm.compile`, :mod:`~epicute.gemm.launch`, :mod:`~epicute.gemm.epilogue_args`,
  :mod:`~epicute.gemm.tune`: variants, launch and autotuning;
- :mod:`~epicute.gemm.kernel_sm90`: the CuTe-DSL kernel for Hopper.

The public function ``epicute.gemm`` shares this package's name: import from the modules
(``from epicute.gemm.prepare import prepare``), never ``import epicute.gemm.x as y``.
The planner's types are re-exported here (pure Python, no GPU needed).
"""

from epicute.gemm.config import GemmConfig, GemmProblem
from epicute.gemm.plan import GemmPlan, plan_gemm
from epicute.gemm.report import render_plan
from epicute.gemm.smem import EpilogueBuffers

__all__ = ["EpilogueBuffers", "GemmConfig", "GemmPlan", "GemmProblem", "plan_gemm", "render_plan"]
