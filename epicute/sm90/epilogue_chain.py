"""The epilogue chain as kernels run it: one emitter per stage kind.

A kernel's epilogue is the chain of its :class:`~epicute.epilogue.fusion.EpilogueFusion`
(:mod:`epicute.epilogue.schedule`: which stages, in what order -- what ``explain``
prints). For each output tile the kernel builds an :class:`EpilogueRun`, the context
the stages share, and calls :func:`run_chain` at four points: ``prologue`` (the tile
is known, its mainloop not yet issued), ``begin`` (the accumulators are final),
``subtile`` (once per epilogue subtile, in row-major order) and ``end``. Each hook
visits the stages in chain order and lets each stage's emitter (:data:`EMITTERS`)
emit its code, so the kernel's epilogue is assembled from the chain's nodes and a
new stage kind is one emitter here, not an edit of a kernel body.

The emitters hold the logic every kernel shares (the fused compute, reductions,
casts, the fence/barrier/TMA-store hand-off, vector staging). What differs between
kernels -- how the accumulator is sliced, where operand tiles come from, which
staging buffer and TMA partition an output uses -- is the run's: a kernel subclasses
:class:`EpilogueRun` and gives each stored output a :class:`StagedOutput`.
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, cute

from epicute.epilogue.dtypes import FP8_MAX
from epicute.epilogue.group_quant import AMAX_FLOOR, GROUP_N
from epicute.sm90 import epilogue_emit as emit


class StagedOutput:
    """One stored tile output (D or an aux tile) of a kernel, for the current subtile.

    ``values``: fp32 registers the ``compute`` stage writes (D's may be the accumulator
    slice itself), which ``cast`` rounds into ``converted`` (registers of the stored dtype);
    ``values=None`` has ``compute`` round each element straight into ``converted`` instead, so
    no fp32 copy of the output is held (attention's aux tiles, next to a head_dim-wide O). The
    kernel's subclass stages ``converted`` (``store_smem``) and names the TMA copy that stores it
    (``tma_copy``).
    """

    def __init__(self, name: str, dtype: str, values):
        self.name, self.dtype, self.values = name, dtype, values

    def begin(self, run) -> None:
        """Per-tile setup (the tile's global partitions)."""

    def cast(self, run) -> None:
        raise NotImplementedError

    def cast_element(self, run, v: int, value) -> None:
        """``values=None``: round value ``v`` into ``converted`` as the compute produces it."""
        self.converted[v] = emit.round_scalar(value, self.dtype)

    def store_smem(self, run) -> None:
        raise NotImplementedError

    def tma_copy(self, run) -> tuple:
        """``(atom, smem, gmem)`` storing this subtile."""
        raise NotImplementedError


class EpilogueRun:
    """What the chain's stages share over one output tile, for one thread (trace-time state).

    The kernel sets: ``stages`` (its chain), ``fusion`` (None: the plain chain), ``outputs`` (name ->
    :class:`StagedOutput`), ``store`` (the :class:`~epicute.sm90.pipeline.TmaStoreEpilogue`),
    ``is_store_warp``, ``subtile_size`` (accumulator values per subtile), the fused epilogue's
    ``coords``/``coords0`` (tile-local (m, n) of this thread's and thread 0's values),
    ``origin``/``extent`` (the tile's corner and the problem's (M, N)), ``scalars``,
    ``vectors`` (name -> a tensor indexed by tile-local position), ``workspaces``,
    ``tile_index`` ((tn, tl) of the reduction workspaces) and ``lane``; and overrides the
    mechanics below. The chain sets ``subtile`` before each subtile hook.
    """

    fusion = None
    subtile = 0
    #: the row of the tile's own reduction slots, or None: partials go to global 16-row bands
    band_origin = None

    def __init__(self):
        self.col_partials: dict = {}
        #: quantize_groups: (static m, group) -> [|x| partial, tile-local m, tile-local n]; then 1 / scale
        self.group_partials: dict = {}
        self.group_reciprocals: dict = {}
        self._tile_epi = None

    @property
    def base(self) -> int:
        """Offset of this subtile's first value in the thread's accumulator order."""
        return self.subtile * self.subtile_size

    @property
    def tile_epi(self) -> emit.TileEpilogue:
        if self._tile_epi is None:
            self._tile_epi = emit.TileEpilogue(
                self.fusion,
                self.coords,
                self.coords0,
                self.vectors,
                self.scalars,
                self.origin,
                self.extent,
                self.band_origin,
            )
        return self._tile_epi

    # ---- kernel mechanics
    def slice_acc(self) -> None:
        """Make ``outputs["D"].values`` hold this subtile's accumulators."""
        raise NotImplementedError

    def tile_value(self, name: str, v: int, m, n):
        """Operand tile ``name``'s value for the subtile's value ``v`` (tile-local (m, n)), as fp32."""
        raise NotImplementedError

    def load_tiles(self) -> None:
        """Operand tiles of this subtile from their TMA ring into registers (``tile_value`` reads them)."""
        raise NotImplementedError

    def advance(self) -> None:
        """Step to the next subtile's staging buffers."""

    def park(self) -> None:
        """quantize_groups' first pass: keep this subtile's ``outputs["D"].values`` for the second."""
        raise NotImplementedError

    def unpark(self) -> None:
        """quantize_groups' second pass: ``outputs["D"].values`` are this subtile's kept values again."""
        raise NotImplementedError


class StageEmitter:
    """A stage kind's code, at the chain's four points (each a no-op unless overridden), and per
    element of the ``compute`` stage's loop (``element``: for stages that work element by
    element, so no value has to outlive its element)."""

    element = None  # element(run, stage, at, values), at = (v, m0, n0, m, n)

    def prologue(self, run: EpilogueRun, stage) -> None: ...

    def begin(self, run: EpilogueRun, stage) -> None: ...

    def subtile(self, run: EpilogueRun, stage) -> None: ...

    def end(self, run: EpilogueRun, stage) -> None: ...

    def pass_end(self, run: EpilogueRun, stage) -> None:
        """Between the two passes over the subtiles of a chain that has two (``group_scales`` splits it)."""


#: stage kind -> its emitter (every kind of :data:`epicute.epilogue.schedule.STAGE_KINDS`).
EMITTERS: dict[str, StageEmitter] = {}


def _emitter(kind: str):
    def register(cls):
        EMITTERS[kind] = cls()
        return cls

    return register


def run_chain(point: str, run: EpilogueRun, stages=None) -> None:
    """Emit every stage's code for ``point`` ("prologue", "begin", "subtile", "pass_end", "end"), in chain
    order; ``stages``: one pass's (see :func:`chain_passes`), else the whole chain."""
    for stage in run.stages if stages is None else stages:
        getattr(EMITTERS[stage.kind], point)(run, stage)


def chain_passes(stages: tuple) -> tuple[tuple, tuple]:
    """The chain's passes over a tile's subtiles: all of it, or (when D is quantized per group of columns,
    whose scale needs every column first) the stages up to ``group_scales`` and those after it."""
    split = next((i + 1 for i, stage in enumerate(stages) if stage.kind == "group_scales"), len(stages))
    return stages[:split], stages[split:]


@_emitter("load_vectors")
class LoadVectors(StageEmitter):
    """Vector slices: each thread loads its share from global memory before the mainloop (the latency
    hides behind it; positions past the problem's edge are clamped, and never read), and parks it in
    shared memory once the tile's epilogue starts. The kernel gives ``run.vector_sources`` (name ->
    global tensor indexed ``(batch, position)``), ``run.vector_lengths`` and ``run.thread``/``run.threads``."""

    def _slots(self, run, length: int) -> int:
        return -(-length // run.threads)

    def prologue(self, run, stage) -> None:
        run.vector_prefetch = {}
        for name in stage.names:
            axis = 1 if name in run.fusion.row_inputs else 0
            length = run.vector_lengths[name]
            loaded = []
            for j in range(self._slots(run, length)):
                pos = cutlass.min(run.thread + j * run.threads, length - 1)
                idx = cutlass.min(run.origin[axis] + pos, run.extent[axis] - 1)
                loaded.append(run.vector_sources[name][(run.batch, idx)].to(Float32))
            run.vector_prefetch[name] = loaded

    def begin(self, run, stage) -> None:
        # Every reader of the previous tile's slices passed that tile's last store barrier already.
        for name in stage.names:
            smem = run.vectors[name]
            for j, value in enumerate(run.vector_prefetch[name]):
                pos = run.thread + j * run.threads
                emit.store_if(pos < cute.size(smem), smem, pos, value)
        run.store.sync()


@_emitter("slice_acc")
class SliceAcc(StageEmitter):
    def subtile(self, run, stage) -> None:
        run.slice_acc()


@_emitter("load_tiles")
class LoadTiles(StageEmitter):
    def subtile(self, run, stage) -> None:
        run.load_tiles()


@_emitter("read_tiles")
class ReadTiles(StageEmitter):
    """Operand tiles read where ``compute`` needs them (``run.tile_value``): nothing of its own."""


@_emitter("read_vectors")
class ReadVectors(StageEmitter):
    """Vectors read where ``compute`` needs them (``run.vectors``, once per distinct row or column)."""


@_emitter("compute")
class Compute(StageEmitter):
    def subtile(self, run, stage) -> None:
        run.col_partials = {}
        visitors = [
            (lambda at, values, emitter=EMITTERS[s.kind], s=s: emitter.element(run, s, at, values))
            for s in run.stages if EMITTERS[s.kind].element is not None
        ]  # fmt: skip
        outputs = {name: out.values for name, out in run.outputs.items() if out.values is not None}
        run.tile_epi.compute(run.outputs["D"].values, run.base, run.tile_value, outputs, visitors)


def _reduction(run, stage):
    (name,) = stage.names
    return next(r for r in run.fusion.reductions if r.name == name)


@_emitter("reduce")
class Reduce(StageEmitter):
    """Folds each element into per-thread partials inside the compute loop; a column reduction then
    combines and stores this subtile's partials (the rows and the whole tensor wait for the tile's end)."""

    def element(self, run, stage, at, values) -> None:
        r = _reduction(run, stage)
        run.tile_epi.fold(r, at, values[r.arg], run.col_partials)

    def subtile(self, run, stage) -> None:
        r = _reduction(run, stage)
        if r.axis == "col":
            partials = {key: slot for key, slot in run.col_partials.items() if key[0] == r.name}
            ws = run.workspaces[run.fusion.reductions.index(r)]
            run.tile_epi.store_col_partials(r, partials, ws, run.tile_index[1], run.lane)


@_emitter("cast")
class Cast(StageEmitter):
    def element(self, run, stage, at, values) -> None:
        out = run.outputs[stage.names[0]]
        if out.values is None:  # rounded as it is computed (see StagedOutput)
            out.cast_element(run, at[0], values[stage.nodes[0]])

    def subtile(self, run, stage) -> None:
        out = run.outputs[stage.names[0]]
        if out.values is not None:
            out.cast(run)


@_emitter("store_smem")
class StoreSmem(StageEmitter):
    def begin(self, run, stage) -> None:
        run.outputs[stage.names[0]].begin(run)

    def subtile(self, run, stage) -> None:
        run.outputs[stage.names[0]].store_smem(run)


@_emitter("fence_barrier")
class FenceBarrier(StageEmitter):
    def subtile(self, run, stage) -> None:
        run.store.fence_and_sync()


@_emitter("tma_store")
class TmaStore(StageEmitter):
    def subtile(self, run, stage) -> None:
        run.store.issue(run.is_store_warp, [run.outputs[name].tma_copy(run) for name in stage.names])


@_emitter("advance")
class Advance(StageEmitter):
    def subtile(self, run, stage) -> None:
        run.advance()


@_emitter("delayed_store")
class DelayedStore(StageEmitter):
    """``fence_barrier``, ``tma_store`` and ``advance`` of the previous subtile (``schedule.delay_stores``)."""

    def subtile(self, run, stage) -> None:
        if run.subtile > 0:
            self._store(run, stage, run.subtile - 1)

    def end(self, run, stage) -> None:
        self._store(run, stage, run.subtile)  # the last subtile's

    @staticmethod
    def _store(run, stage, subtile: int) -> None:
        current, run.subtile = run.subtile, subtile  # the TMA copy's destination is that subtile's
        run.store.fence_and_sync()
        run.store.issue(run.is_store_warp, [run.outputs[name].tma_copy(run) for name in stage.names])
        run.advance()
        run.subtile = current


@_emitter("group_amax")
class GroupAmax(StageEmitter):
    """quantize_groups' first pass: fold each value's magnitude into its (row, group) partial (columns past N
    contribute nothing; rows past M need no mask: their partials only make scales that are never stored),
    then keep the subtile's values for the second pass."""

    def element(self, run, stage, at, values) -> None:
        _, m0, n0, m, n = at
        valid = run.origin[1] + n < run.extent[1]
        # Thread 0's static n and this thread's lie in one group: groups and 8-column atoms align.
        slot = run.group_partials.setdefault((m0, n0 // GROUP_N), [emit.identity("amax"), m, n])
        slot[0] = emit.fold_element("amax", slot[0], values[run.fusion.group_quant.arg], valid)

    def subtile(self, run, stage) -> None:
        run.park()


@_emitter("group_scales")
class GroupScales(StageEmitter):
    """Each (row, group)'s amax across the 4 lanes that share the row, its scale (stored by lane 0 of the
    quad into the M-major scales tensor, the last of ``run.workspaces``) and its reciprocal."""

    def pass_end(self, run, stage) -> None:
        gq = run.fusion.group_quant
        scales = run.workspaces[-1]
        for key, (partial, m_local, n_local) in run.group_partials.items():
            amax = emit.butterfly("amax", partial, (1, 2))
            scale = cutlass.max(amax, Float32(AMAX_FLOOR)) / Float32(FP8_MAX[gq.dtype])
            if cutlass.const_expr(gq.ue8m0):
                scale = emit.ceil_pow2(scale)
            row, group = run.origin[0] + m_local, (run.origin[1] + n_local) // GROUP_N
            in_bounds = (row < run.extent[0]) & (group * GROUP_N < run.extent[1])
            emit.store_if((run.lane % 4 == 0) & in_bounds, scales, (run.batch, group, row), scale)
            run.group_reciprocals[key] = Float32(1.0) / scale


@_emitter("group_quantize")
class GroupQuantize(StageEmitter):
    """quantize_groups' second pass: the kept values times their group's reciprocal scale (cast rounds them)."""

    def subtile(self, run, stage) -> None:
        run.unpark()
        values = run.outputs["D"].values
        for v in range(run.subtile_size):
            m0, n0 = run.coords0[run.base + v]
            values[v] = values[v] * run.group_reciprocals[(m0, n0 // GROUP_N)]


@_emitter("finalize_reductions")
class FinalizeReductions(StageEmitter):
    def end(self, run, stage) -> None:
        tn, tl = run.tile_index
        run.tile_epi.store_tile_partials(run.workspaces, tn, tl, run.lane)


__all__ = ["EMITTERS", "EpilogueRun", "StageEmitter", "StagedOutput", "chain_passes", "run_chain"]
