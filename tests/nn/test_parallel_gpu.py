"""epicute.nn's sequence-parallel layers on GPUs (an NCCL world, one GPU per rank): the collectives inside the
GEMMs (epicute.distributed on torch's symmetric memory), trained against float64 (the check in test_parallel.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.nn.gloo_world import spawn
from tests.nn.test_parallel import sequence_gated_mlp, sequence_parallel_mlp

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("world", [2, 4, 8])
def test_sequence_parallel_layers_fuse_their_collectives_into_the_gemms(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"a world of {world} ranks needs {world} GPUs; this machine has {torch.cuda.device_count()}")
    spawn(functools.partial(sequence_parallel_mlp, batch=1), world, backend="nccl")


@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_sequence_parallel_gated_mlp_gathers_and_scatters_inside_its_gemms(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"a world of {world} ranks needs {world} GPUs; this machine has {torch.cuda.device_count()}")
    spawn(sequence_gated_mlp, world, backend="nccl")
