"""Grouped GEMMs (mixture-of-experts): many ``(rows_g, K) @ (K, N)`` products over one sorted ``A`` in one
persistent kernel, with the dense GEMM's fused epilogues.

- :func:`grouped_gemm` / :func:`explain_grouped`: the API (:mod:`epicute.grouped.api`);
- :mod:`~epicute.grouped.validate`, :mod:`~epicute.grouped.plan`, :mod:`~epicute.grouped.prepare`,
  :mod:`~epicute.grouped.launch`: the path every call takes;
- :mod:`~epicute.grouped.kernel_sm90`: the dense kernel with a grouped schedule, per-group A offsets and
  ragged stores.
"""

from epicute.grouped.api import explain_grouped, grouped_gemm, reference_grouped
from epicute.grouped.plan import GroupedPlan, GroupedProblem, plan_grouped

__all__ = ["GroupedPlan", "GroupedProblem", "explain_grouped", "grouped_gemm", "plan_grouped", "reference_grouped"]
