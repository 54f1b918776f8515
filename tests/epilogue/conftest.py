"""Fixtures of the epilogue tests: a freshly seeded generator per test, nonzero random tensors."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator with a fresh seed each run; the seed is printed, so a failure shows it."""
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"seed = {seed}")
    return torch.Generator().manual_seed(seed)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normal samples, with the (measure-zero, but never wanted) exact zeros replaced by 1."""
    x = torch.randn(*shape, generator=gen)
    return torch.where(x == 0, 1.0, x).to(dtype)


def away_from_zero(gen: torch.Generator, *shape: int, lo: float = 0.5, positive: bool = False) -> torch.Tensor:
    """Magnitudes in ``[lo, lo + 2)``, random signs unless ``positive``: safe for log, sqrt and division."""
    x = torch.rand(*shape, generator=gen) * 2 + lo
    if positive:
        return x
    return torch.where(torch.rand(*shape, generator=gen) < 0.5, -x, x)
