"""The planner: problem -> kernel configuration, shared-memory budget, roofline.

Pure Python, no GPU needed. See :func:`plan_gemm` and :func:`render_plan`.
"""

from epicute.plan.config import GemmConfig, GemmProblem
from epicute.plan.hardware import H100_SXM, Hardware, current_hardware
from epicute.plan.plan import GemmPlan, plan_gemm
from epicute.plan.report import render_plan
from epicute.plan.smem import EpilogueBuffers

__all__ = [
    "EpilogueBuffers", "GemmConfig", "GemmProblem", "GemmPlan", "Hardware", "H100_SXM",
    "current_hardware", "plan_gemm", "render_plan",
]  # fmt: skip
