"""TMA's alignment rule as the launch applies it (epicute.runtime.checks)."""

from __future__ import annotations

import torch

from epicute.runtime.checks import with_aligned_unit_dims


def test_size_one_dims_get_aligned_strides_and_keep_their_values():
    # torch._scaled_mm's M-major blockwise scales, padded rows, as one batch: the batch stride torch gives the
    # unsqueezed view (1001 floats) is never stepped along, but a TMA descriptor encodes it.
    rows, blocks = 1001, 9
    scales = torch.rand(blocks, rows + 3)[:, :rows].t().unsqueeze(0)  # (1, M, KB), strides (?, 1, 1004)
    view = with_aligned_unit_dims(scales, contiguous_dim=1)
    assert view.shape == scales.shape and view.data_ptr() == scales.data_ptr()
    assert view.stride(0) % 4 == 0 and view.stride()[1:] == scales.stride()[1:]
    assert torch.equal(view, scales)  # the same elements of the same storage
    aligned = torch.rand(2, 8, 4)
    assert with_aligned_unit_dims(aligned, contiguous_dim=2) is aligned  # nothing to change: the tensor itself
    assert with_aligned_unit_dims(torch.rand(1, 4, 1)[:, :, :], contiguous_dim=1).stride()[2] % 4 == 0
