"""A patched transformers model under tensor_parallel_plan on GPUs (an NCCL world, one GPU per rank, the kernels): the
steps of test_transformers_parallel.py, trained against the same model in float64 on the CPU."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.integrations.test_transformers_parallel import _llama_step, _mixtral_step, _qwen3_step
from tests.nn.gloo_world import spawn

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")

STEPS = {
    "llama_heads": _llama_step,
    "llama_sequence": functools.partial(_llama_step, sequence_parallel=True, batch=1),
    "llama_sequence_two": functools.partial(_llama_step, sequence_parallel=True, batch=2),
    "qwen3_heads": functools.partial(_qwen3_step, sequence_parallel=False),
    "qwen3_sequence": functools.partial(_qwen3_step, sequence_parallel=True),
    "mixtral_features": functools.partial(_mixtral_step, sequence_parallel=False),
    "mixtral_sequence": functools.partial(_mixtral_step, sequence_parallel=True),
}


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_patched_model_trains_split_over_gpus_like_the_whole_one(step, world):
    # the tiny models are sized by the world: a key/value head and 72 MLP features per rank (_tiny_sizes)
    if torch.cuda.device_count() < world:
        pytest.skip(f"a world of {world} ranks needs {world} GPUs; this machine has {torch.cuda.device_count()}")
    spawn(STEPS[step], world, backend="nccl")
