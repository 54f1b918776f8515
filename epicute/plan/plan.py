"""A :class:`GemmPlan`: problem + chosen config + everything derived from them.

This is what ``explain`` prints and what the runtime compiles and launches.
"""

from __future__ import annotations

from dataclasses import dataclass

from epicute.plan.config import GemmConfig, GemmProblem
from epicute.plan.hardware import Hardware, current_hardware
from epicute.plan.heuristics import choose_config
from epicute.plan.roofline import Roofline, roofline
from epicute.plan.smem import NO_EPILOGUE, EpilogueBuffers, SmemItem, smem_table


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GemmPlan:
    problem: GemmProblem
    config: GemmConfig
    hardware: Hardware
    #: shared memory the fused epilogue needs (none without an epilogue)
    epilogue: EpilogueBuffers = NO_EPILOGUE

    @property
    def smem(self) -> list[SmemItem]:
        return smem_table(self.config, self.problem.ab_dtype, self.problem.d_dtype, self.epilogue)

    @property
    def smem_bytes(self) -> int:
        return sum(item.bytes for item in self.smem)

    @property
    def num_tiles(self) -> int:
        p, c = self.problem, self.config
        return _ceil_div(p.m, c.tile_m) * _ceil_div(p.n, c.tile_n) * p.l

    @property
    def max_active_clusters(self) -> int:
        return self.hardware.num_sms // self.config.cluster_size

    @property
    def grid(self) -> tuple[int, int, int]:
        """Launch grid (cluster_m, cluster_n, clusters), as the kernel computes it."""
        p, c = self.problem, self.config
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
        return roofline(self.problem, self.hardware, c.tile_m, c.tile_n, c.tile_k, self.epilogue, c.schedule)


def plan_gemm(
    problem: GemmProblem, hardware: Hardware | None = None, epilogue: EpilogueBuffers = NO_EPILOGUE, **overrides
) -> GemmPlan:
    """Plan ``problem`` for ``hardware`` (default: the visible GPU, else an H100).

    ``epilogue`` is the fused epilogue's shared-memory needs; keyword overrides
    pin :class:`GemmConfig` fields, e.g. ``tile_n=128``.
    """
    hw = hardware or current_hardware()
    return GemmPlan(problem, choose_config(problem, hw, epilogue, **overrides), hw, epilogue)
