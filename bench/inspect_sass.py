"""Disassemble compiled GEMM variants and count the instructions that matter.

For each planned variant: HGMMA (tensor-core WGMMA) present, UTMALDG/UTMASTG (TMA
load/store) present, LDL/STL (local-memory spills) absent. Needs `cuobjdump`
(the device image has it); compiling needs no GPU.

Usage: python bench/inspect_sass.py [MxNxK ...]   (default: 8192x8192x8192 129x136x72)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

WATCH = ("HGMMA", "UTMALDG", "UTMASTG", "UTMAPF", "LDL", "STL", "STSM", "BAR", "SYNCS")


def sass_counts(cubin: Path) -> Counter:
    sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    counts: Counter = Counter()
    for line in sass.splitlines():
        match = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if match:
            opcode = match.group(1)
            for name in WATCH:
                if opcode == name or opcode.startswith((name + "_", name + ".")):
                    counts[name] += 1
    return counts


def main(shapes: list[str]) -> int:
    from epicute.gemm import GemmProblem, plan_gemm
    from epicute.gemm.compile import compile_gemm
    from epicute.gemm.launch import variant_of

    status = 0
    seen = set()
    for shape in shapes:
        m, n, k = (int(x) for x in shape.split("x"))
        plan = plan_gemm(GemmProblem(m, n, k))
        if variant_of(plan) in seen:  # the DSL would reuse its in-process build: no new cubin
            continue
        seen.add(variant_of(plan))
        with tempfile.TemporaryDirectory() as tmp:
            cwd = os.getcwd()
            os.chdir(tmp)
            os.environ["CUTE_DSL_KEEP_CUBIN"] = "1"
            try:
                compile_gemm(variant_of(plan))
            finally:
                os.chdir(cwd)
            cubins = list(Path(tmp).glob("*.cubin"))
            if not cubins:
                print(f"{shape}: no cubin was written")
                return 1
            counts = sass_counts(cubins[0])
        ok = (
            counts["HGMMA"] > 0
            and counts["UTMALDG"] > 0
            and counts["UTMASTG"] > 0
            and not counts["LDL"] + counts["STL"]
        )
        status |= not ok
        c = plan.config
        print(f"{shape} tile 128x{c.tile_n} cluster {c.cluster_m}x{c.cluster_n}: "
              + " ".join(f"{name}={counts[name]}" for name in WATCH) + ("  OK" if ok else "  CHECK"))  # fmt: skip
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["8192x8192x8192", "129x136x72"]))
