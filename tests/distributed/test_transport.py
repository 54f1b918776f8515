"""The reduce-scatter's exchange of partial sums: which rank each step's partial goes to and which one fills each
inbox slot, the arithmetic the symmetric-memory transport relies on at every world size (GPU worlds stop at the
GPUs a machine has; this holds for all)."""

from __future__ import annotations

import pytest

from epicute.distributed.transport import PartialExchange


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8, 16])
def test_each_partial_reaches_its_owner_in_the_slot_the_owner_reads(world):
    for rank in range(world):
        sender = PartialExchange(rank, world)
        owners = [sender.owner(step) for step in range(world - 1)]
        # every other rank once, its own rows never (they are the last GEMM's, not a partial's)
        assert sorted(owners) == sorted(set(range(world)) - {rank})
        for step, owner in enumerate(owners):
            # the owner's inbox slot ``step`` is read as this rank's partial
            assert PartialExchange(owner, world).source(step) == rank
    for rank in range(world):
        sources = [PartialExchange(rank, world).source(step) for step in range(world - 1)]
        assert sorted(sources) == sorted(set(range(world)) - {rank})
        # the last partial, read in place, comes from the next rank: it finished its other GEMMs first
        assert sources[-1] == (rank + 1) % world
