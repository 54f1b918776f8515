"""Warp roles and register budgets of epicute's warp-specialized SM90 kernels, in plain Python.

Every kernel runs one producer warpgroup (TMA loads) and ``num_mma_warpgroups``
consumer warpgroups (WGMMA, softmax, epilogue); ``setmaxnreg`` moves registers from
the producer to the consumers. A family's config subclasses :class:`WarpRoles` (a
frozen dataclass with ``producer_regs`` and ``consumer_regs`` fields) and gets the
thread counts, the register check and the compile key from it.
"""

from __future__ import annotations

from dataclasses import fields

from epicute.errors import ConfigError

THREADS_PER_WARPGROUP = 128


class WarpRoles:
    """Thread and register arithmetic shared by the warp-specialized kernels' configs:
    one producer warpgroup plus ``num_mma_warpgroups`` consumers, each group's
    register budget set with ``setmaxnreg``."""

    producer_regs: int
    consumer_regs: int

    @property
    def num_mma_warpgroups(self) -> int:
        raise NotImplementedError

    @property
    def num_threads(self) -> int:
        return (1 + self.num_mma_warpgroups) * THREADS_PER_WARPGROUP

    @property
    def num_mma_threads(self) -> int:
        return self.num_mma_warpgroups * THREADS_PER_WARPGROUP

    def key(self) -> tuple:
        """What changes the generated code: every field the dataclass compares (all but ``reasons``)."""
        return tuple(getattr(self, f.name) for f in fields(self) if f.compare)

    def validate_registers(self) -> None:
        """Raise :class:`ConfigError` unless the register budgets are valid and fit an SM."""
        for name in ("producer_regs", "consumer_regs"):
            regs = getattr(self, name)
            if not 24 <= regs <= 256 or regs % 8:
                raise ConfigError(f"{name}={regs}: register budgets must be multiples of 8 in [24, 256] (setmaxnreg)")
        used = THREADS_PER_WARPGROUP * (self.producer_regs + self.num_mma_warpgroups * self.consumer_regs)
        if used > 65536:
            raise ConfigError(
                f"producer_regs={self.producer_regs} and consumer_regs={self.consumer_regs} need {used} registers; "
                "an SM has 65536"
            )


__all__ = ["THREADS_PER_WARPGROUP", "WarpRoles"]
