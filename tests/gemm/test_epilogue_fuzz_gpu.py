"""The random-epilogue fuzzer on the GPU: kernel vs CPU reference (see tests/gemm/epilogue_fuzz.py).

Runs ``EPICUTE_FUZZ_CASES`` cases (default 40), three shapes per random program
so each compiled kernel serves several cases; ``EPICUTE_FUZZ_SEED`` replays a
run (fresh by default). Prints ``fuzz: <n> cases, <f> failures`` and reports
every failing case with its seeds, its program and a rerun command.
"""

from __future__ import annotations

import pytest

from tests.gemm import epilogue_fuzz as fuzz

pytestmark = pytest.mark.gpu


def test_random_epilogues_match_the_reference(capsys):
    summary, failures = fuzz.fuzz_from_env("fuzz", 40, fuzz.cases, fuzz.run_case, fuzz.describe)
    with capsys.disabled():
        print("\n" + summary)
    assert not failures, "\n\n".join(failures)
