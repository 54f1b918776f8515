"""A :class:`GemmPlan`: problem + chosen config + everything derived from them.

This is what ``explain`` prints and what the runtime compiles and launches.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from epicute.plan.config import GemmConfig, GemmProblem
from epicute.plan.hardware import Hardware, current_hardware
from epicute.plan.heuristics import choose_config
from epicute.plan.roofline import Roofline, roofline
from epicute.plan.smem import NO_EPILOGUE, EpilogueBuffers, SmemItem, smem_table
from epicute.plan.split_k import choose_split_k, feasible, sliced
from epicute.errors import ConfigError


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GemmPlan:
    problem: GemmProblem
    config: GemmConfig
    hardware: Hardware
    #: shared memory the fused epilogue needs (none without an epilogue)
    epilogue: EpilogueBuffers = NO_EPILOGUE
    #: K-slices run as a batch into an fp32 workspace, then summed (see epicute.plan.split_k)
    split_k: int = 1
    #: why the planner split K (None: it did not, or it was asked to)
    split_reason: str | None = None

    @property
    def kernel_problem(self) -> GemmProblem:
        """What the kernel computes: the problem itself, or its batch of K-slices."""
        return sliced(self.problem, self.split_k) if self.split_k > 1 else self.problem

    @property
    def smem(self) -> list[SmemItem]:
        p = self.kernel_problem
        return smem_table(self.config, p.ab_dtype, p.d_dtype, self.epilogue)

    @property
    def smem_bytes(self) -> int:
        return sum(item.bytes for item in self.smem)

    @property
    def num_tiles(self) -> int:
        p, c = self.kernel_problem, self.config
        return _ceil_div(p.m, c.tile_m) * _ceil_div(p.n, c.tile_n) * p.l

    @property
    def max_active_clusters(self) -> int:
        return self.hardware.num_sms // self.config.cluster_size

    @property
    def grid(self) -> tuple[int, int, int]:
        """Launch grid (cluster_m, cluster_n, clusters), as the kernel computes it."""
        p, c = self.kernel_problem, self.config
        clusters = (
            _ceil_div(_ceil_div(p.m, c.tile_m), c.cluster_m)
            * _ceil_div(_ceil_div(p.n, c.tile_n), c.cluster_n)
            * p.l
        )
        if c.persistent:
            clusters = min(clusters, self.max_active_clusters)
        return (c.cluster_m, c.cluster_n, clusters)

    @property
    def roofline(self) -> Roofline:
        c = self.config
        return roofline(self.kernel_problem, self.hardware, c.tile_m, c.tile_n, c.tile_k, self.epilogue, c.schedule)


def plan_gemm(
    problem: GemmProblem, hardware: Hardware | None = None, epilogue: EpilogueBuffers = NO_EPILOGUE, **overrides
) -> GemmPlan:
    """Plan ``problem`` for ``hardware`` (default: the visible GPU, else an H100).

    ``epilogue`` is the fused epilogue's shared-memory needs; keyword overrides
    pin :class:`GemmConfig` fields, e.g. ``tile_n=128``, and ``split_k`` (1 turns
    splitting off; a fused epilogue never splits).
    """
    hw = hardware or current_hardware()
    split_k, reason = 1, None
    if "split_k" in overrides:
        split_k = overrides.pop("split_k")
        if split_k != 1 and (epilogue.chain or not feasible(problem, split_k)):
            raise ConfigError(
                f"split_k={split_k}: needs a plain GEMM (no epilogue), L == 1, and K={problem.k} divisible by "
                f"{8 * split_k} with slices of at least 1024; use split_k=1"
            )
    elif not epilogue.chain:
        split_k, reason = choose_split_k(problem, hw)
    inner = sliced(problem, split_k) if split_k > 1 else problem
    config = choose_config(inner, hw, epilogue, **overrides)
    if reason is not None:
        config = replace(config, reasons=(reason, *config.reasons))
    return GemmPlan(problem, config, hw, epilogue, split_k, reason)
