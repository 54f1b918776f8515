"""The stage chain an epilogue lowers to, and how it prints."""

from __future__ import annotations

import pytest
import torch

from epicute import ops
from epicute.epilogue.schedule import IO_INSTRUCTIONS, OP_INSTRUCTIONS, Stage, schedule
from epicute.epilogue.tracer import as_epilogue
from epicute.errors import EpilogueError


def full(acc, bias, residual, alpha, unused):
    y = alpha * acc + bias
    return {"D": ops.gelu(y) + residual, "pre": y, "rmax": ops.row_amax(y), "colsum": ops.col_sum(acc)}


KINDS = {"bias": "row", "residual": "tile", "alpha": "scalar", "unused": "tile"}


def traced(out_dtypes=None):
    epi = as_epilogue(full)
    return epi.trace(KINDS, {"bias": "bf16", "residual": "bf16"}, out_dtypes, d_dtype=torch.bfloat16)


def test_stage_chain_for_a_tile_operand_a_vector_an_aux_output_and_reductions():
    sched = schedule(traced({"pre": torch.float32}))
    assert [(s.scope, s.kind) for s in sched.stages] == [
        ("tile", "load_vectors"),
        ("subtile", "slice_acc"),
        ("subtile", "load_tiles"),
        ("subtile", "compute"),
        ("subtile", "reduce"), ("subtile", "reduce"),
        ("subtile", "cast"), ("subtile", "cast"),
        ("subtile", "store_smem"), ("subtile", "store_smem"),
        ("subtile", "fence_barrier"),
        ("subtile", "tma_store"),  # one bulk group stores D and the aux tile
        ("subtile", "advance"),
        ("tile", "finalize_reductions"),
    ]  # fmt: skip
    by_kind = {s.kind: s for s in sched.stages}
    assert by_kind["tma_store"].names == ("D", "pre") and by_kind["load_tiles"].names == ("residual",)
    assert sched.tile_operands == ("residual",) and sched.vector_operands == ("bias",)
    assert sched.scalar_operands == ("alpha",) and sched.tile_outputs == ("D", "pre")
    assert sched.reductions == ("rmax", "colsum")


def test_stages_carry_their_nodes():
    graph = traced()
    sched = schedule(graph)
    by_kind = {}
    for s in sched.stages:
        by_kind.setdefault(s.kind, []).append(s)
    assert by_kind["load_vectors"][0].nodes == (dict(graph.inputs)["bias"],)
    assert by_kind["load_tiles"][0].nodes == (dict(graph.inputs)["residual"],)
    compute_ops = [graph.node(i).op for i in by_kind["compute"][0].nodes]
    assert compute_ops == ["mul", "add", "gelu_erf", "add"]
    assert [s.nodes for s in by_kind["cast"]] == [(dict(graph.outputs)["D"],), (dict(graph.outputs)["pre"],)]
    assert [graph.node(s.nodes[0]).op for s in by_kind["reduce"]] == ["row_amax", "col_sum"]


def test_printing_one_line_per_stage():
    text = str(schedule(traced({"pre": torch.float32})))
    lines = text.splitlines()
    assert len(lines) == 14
    assert (
        lines[0] == " 0  tile     load_vectors         bias (row, bf16): this tile's slice, global -> registers "
        "before the mainloop (latency hidden), -> smem after it"
    )
    assert lines[2].startswith(" 2  subtile  load_tiles           residual (tile, bf16)")
    assert "rmax = row_amax(%6)" in lines[4] and "out-of-bounds elements excluded" in lines[4]
    assert "D: fp32 -> bf16 (round to nearest even)" in lines[6] and "pre: fp32 -> fp32 (no conversion)" in lines[7]
    assert "D, pre: one thread issues the TMA stores" in lines[11] and "commit the bulk group" in lines[11]
    assert "gives rmax (L, M), colsum (L, N) (deterministic: no float atomics)" in lines[13]
    assert "unused" not in text


def test_attention_chain_reads_operands_where_used_and_stages_outputs_in_turn():
    from epicute.epilogue.schedule import ATTENTION_SM90

    sched = schedule(traced({"pre": torch.bfloat16}), style=ATTENTION_SM90)
    assert [s.kind for s in sched.stages] == [
        "slice_acc", "read_tiles", "read_vectors", "compute", "reduce", "reduce", "cast", "cast",
        "store_smem", "fence_barrier", "tma_store",  # D through Q's buffer...
        "store_smem", "fence_barrier", "tma_store",  # ...then the aux tile, once the D store has read it
        "finalize_reductions",
    ]  # fmt: skip
    assert "the smem staging tile" in str(sched) and "advance" not in str(sched)


def test_a_plain_kernel_runs_the_chain_of_its_identity_epilogue():
    from epicute.epilogue.schedule import plain_graph

    sched = schedule(plain_graph("fp8e4m3"))
    kinds = [s.kind for s in sched.stages]
    assert kinds == ["slice_acc", "cast", "store_smem", "fence_barrier", "tma_store", "advance"]
    assert "D: fp32 -> fp8e4m3 (saturating)" in str(sched)
    # D = acc with another output still computes (it routes acc to both).
    routed = schedule(as_epilogue(lambda acc: {"D": acc, "copy": acc}).trace({}))
    assert "no ops: acc to every output" in str(routed)


def test_every_stage_kind_has_a_kernel_emitter():
    from epicute.epilogue.schedule import STAGE_KINDS
    from epicute.sm90.epilogue_chain import EMITTERS

    assert set(EMITTERS) == set(STAGE_KINDS)


def test_minimal_epilogue_has_only_the_fixed_links():
    sched = schedule(as_epilogue(lambda acc: acc).trace({}))
    assert [s.kind for s in sched.stages] == [
        "slice_acc",
        "cast",
        "store_smem",
        "fence_barrier",
        "tma_store",
        "advance",
    ]
    assert sched.tile_operands == sched.vector_operands == sched.reductions == ()


def test_operand_specs_must_match_the_graph():
    epi = as_epilogue(lambda acc, b: acc + b)
    graph = epi.trace({"b": "row"}, {"b": "bf16"})
    good = epi.operands({"b": torch.ones(8, dtype=torch.bfloat16)}, 4, 8)
    assert schedule(graph, good).vector_operands == ("b",)
    with pytest.raises(EpilogueError, match="'b': the graph was traced for row bf16, got row fp32"):
        schedule(graph, epi.operands({"b": torch.ones(8)}, 4, 8))
    with pytest.raises(EpilogueError, match="got nothing"):
        schedule(graph, {})


def test_stage_scope_and_str():
    assert Stage("load_vectors", "x").scope == "tile" and Stage("compute", "y").scope == "subtile"
    assert str(Stage("advance", "next")) == "subtile  advance              next"


def test_instructions_per_element_counts_ops_and_io():
    sched = schedule(traced({"pre": torch.float32}))
    io = IO_INSTRUCTIONS
    # mul, add, gelu, add; one tile operand, one vector; D and "pre" stored; two reductions.
    expected = 1 + 1 + OP_INSTRUCTIONS["gelu_erf"] + 1 + io["tile_input"] + io["vector"]
    expected += 2 * io["tile_output"] + 2 * io["reduction"]
    assert sched.instructions_per_element() == expected
    assert sched.buffers().instructions_per_element == expected
    # Every elementwise op of the language has a cost.
    from epicute.epilogue.graph import ELEMENTWISE

    assert set(OP_INSTRUCTIONS) == set(ELEMENTWISE)


def test_delayed_stores_move_the_store_after_the_next_subtiles_math():
    from epicute.epilogue.schedule import delay_stores, delayable, plain_graph

    def fn(acc, bias):
        return {"D": ops.gelu(acc + bias), "pre": acc + bias, "rs": ops.row_sum(acc)}

    sched = schedule(as_epilogue(fn).trace({"bias": "row"}, {"bias": "bf16"}))
    delayed = delay_stores(sched.stages)
    assert [s.kind for s in delayed] == [
        "load_vectors", "slice_acc", "compute", "reduce", "cast", "cast", "delayed_store", "store_smem", "store_smem",
        "finalize_reductions",
    ]  # fmt: skip
    assert next(s for s in delayed if s.kind == "delayed_store").names == ("D", "pre")
    assert sched.buffers().delayed_chain == tuple(str(s) for s in delayed)
    assert delayable(schedule(plain_graph("bf16")).stages)
    # Operand tiles through the TMA ring, and quantize_groups' two passes, keep the store where it is.
    assert not delayable(schedule(traced()).stages) and schedule(traced()).buffers().delayed_chain == ()
    quantized = as_epilogue(lambda acc: dict(zip(("D", "scales"), ops.quantize_groups(acc))))
    stages = schedule(quantized.trace({}, out_dtypes={"D": torch.float8_e4m3fn})).stages
    assert not delayable(stages)
    with pytest.raises(EpilogueError, match="two passes"):
        delay_stores(stages)
