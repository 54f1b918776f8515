"""The torch.compile integration on the GPU: the block's lifted GEMMs run the kernels, Inductor compiles the rest;
forward and backward against float64 autograd, static and dynamic shapes."""

from __future__ import annotations

import pytest
import torch

from epicute.integrations import compile as EC
from tests.integrations.compile_cases import block, block_leaves, step_errors

pytestmark = pytest.mark.gpu

TOL = 1e-2  # bf16 inputs, weights and outputs


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_block_trains_through_its_lifted_kernels(dynamic):
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=EC.backend, fullgraph=True, dynamic=dynamic)
    for tokens in ((3, 333), (1001,)):
        errors = step_errors(compiled, block_leaves(tokens, "cuda"))
        assert all(e < TOL for e in errors.values()), (tokens, errors)
    assert [steps for _, steps in EC.last_report().lifted] == [("add", "gelu", "mul", "add"), ("silu", "add")]
