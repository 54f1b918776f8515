"""Every docstring example of the public API runs and prints what it says (doctest).

Examples that plan on ``"meta"`` tensors run on the CPU; those that launch kernels
(``device="cuda"``) are GPU tests. A first ``import`` line marked ``+SKIP`` is the
reader's; the examples run with ``torch`` and ``epicute`` imported.
"""

from __future__ import annotations

import doctest
import io

import pytest
import torch

import epicute


def _examples():
    finder = doctest.DocTestFinder(recurse=False)
    for name in epicute.__all__:
        for test in finder.find(getattr(epicute, name), name, globs={}):
            if test.examples:
                marks = [pytest.mark.gpu] if 'device="cuda"' in test.docstring else []
                yield pytest.param(test, id=name, marks=marks)


@pytest.mark.parametrize("example", list(_examples()))
def test_docstring_example_runs(example):
    example.globs.update(torch=torch, epicute=epicute)
    report = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    result = runner.run(example, out=report.write)
    assert result.failed == 0, report.getvalue()
