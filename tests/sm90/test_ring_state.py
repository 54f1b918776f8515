"""RingState's derived index and phase follow PipelineState's sequence (plain ints: no compile)."""

from __future__ import annotations

import pytest

from epicute.sm90.pipeline import RingState


def pipeline_state_sequence(stages: int, phase: int, steps: int) -> list[tuple[int, int]]:
    """(index, phase) as cutlass.pipeline.PipelineState advances: wrap the index, flip the phase."""
    index, out = 0, []
    for _ in range(steps):
        out.append((index, phase))
        index += 1
        if index == stages:
            index, phase = 0, phase ^ 1
    return out


@pytest.mark.parametrize("stages", (1, 2, 3, 4, 5, 8))
@pytest.mark.parametrize("role", ("consumer", "producer"))
def test_ring_state_matches_pipeline_state(stages, role):
    # Consumers start at (0, 0); producers one phase ahead at (0, 1): every buffer starts empty.
    state = RingState(stages, 0 if role == "consumer" else stages)
    got = []
    for _ in range(4 * stages + 3):
        got.append((state.index, state.phase))
        state.advance()
    assert got == pipeline_state_sequence(stages, 0 if role == "consumer" else 1, 4 * stages + 3)


def test_clone_is_independent():
    state = RingState(2, 3)
    copy = state.clone()
    state.advance()
    assert (copy.index, copy.phase) == (1, 1) and (state.index, state.phase) == (0, 0)
