"""The planner: problem -> kernel configuration, shared-memory budget, roofline.

Pure Python, no GPU needed. See :func:`plan_gemm` and :func:`render_plan`; plans are made
for a :class:`epicute.runtime.target.Target` (the visible GPU, or a named part).
"""

from epicute.plan.config import GemmConfig, GemmProblem
from epicute.plan.plan import GemmPlan, plan_gemm
from epicute.plan.report import render_plan
from epicute.plan.smem import EpilogueBuffers

__all__ = [
    "EpilogueBuffers",
    "GemmConfig",
    "GemmPlan",
    "GemmProblem",
    "plan_gemm",
    "render_plan",
]  # fmt: skip
