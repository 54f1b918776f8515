"""The random-epilogue fuzzer on the GPU: kernel vs CPU reference (see tests/gemm/epilogue_fuzz.py).

Runs ``EPICUTE_FUZZ_CASES`` cases (default 40), three shapes per random program
so each compiled kernel serves several cases; ``EPICUTE_FUZZ_SEED`` replays a
run (fresh by default). Prints ``fuzz: <n> cases, <f> failures`` and reports
every failing case with its seeds, its program and a rerun command.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.gemm import epilogue_fuzz as fuzz

pytestmark = pytest.mark.gpu


def test_random_epilogues_match_the_reference(capsys):
    count = int(os.environ.get("EPICUTE_FUZZ_CASES", "40"))
    base_seed = int(os.environ.get("EPICUTE_FUZZ_SEED") or random.SystemRandom().getrandbits(32))
    failures = []
    pairs = fuzz.cases(count, base_seed)
    for program, case_seed in pairs:
        try:
            problems = fuzz.run_case(program, case_seed)
        except Exception as e:  # noqa: BLE001 -- a crash fails this case; the others still run
            problems = [f"raised {type(e).__name__}: {e}"]
        if problems:
            failures.append(fuzz.describe(program, case_seed, problems))
    with capsys.disabled():
        print(f"\nfuzz: {len(pairs)} cases, {len(failures)} failures (EPICUTE_FUZZ_SEED={base_seed})")
    assert not failures, "\n\n".join(failures)
