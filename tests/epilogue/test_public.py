"""The epilogue frontend's public names at ``epicute``'s top level."""

from __future__ import annotations

import epicute
from epicute.epilogue import library, operands, ops, tracer
from epicute.errors import EpilogueError


def test_top_level_names_are_the_frontends():
    assert epicute.epilogue is tracer.epilogue
    assert epicute.ops is ops and epicute.epilogues is library
    assert (epicute.RowVector, epicute.ColVector, epicute.Scalar, epicute.Tile) == (
        operands.RowVector, operands.ColVector, operands.Scalar, operands.Tile,
    )  # fmt: skip
    assert epicute.EpilogueError is EpilogueError and issubclass(EpilogueError, epicute.EpicuteError)
    assert issubclass(EpilogueError, ValueError)


def test_the_issue_example_decorates_and_traces():
    @epicute.epilogue
    def ffn_out(acc, bias, residual, alpha):
        return {"D": epicute.ops.gelu(alpha * acc + bias) + residual}

    graph = ffn_out.trace({"bias": "row", "residual": "tile", "alpha": "scalar"})
    assert [n.op for n in graph.nodes][-3:] == ["add", "gelu_erf", "add"]


def test_every_ops_name_is_callable():
    assert ops.__all__ and all(callable(getattr(epicute.ops, name)) for name in ops.__all__)
