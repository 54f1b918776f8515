"""compute-sanitizer over a small case of every kernel family: errors found, per family and tool.

Usage: python bench/sanitize.py [--tools memcheck,racecheck,synccheck] [--cases a,b] [--jobs N] [--out PATH]
Each case first runs once without a tool, which compiles its kernels into the disk cache; then each
(tool, case), ``--jobs`` at a time, runs ``bench/sanitize_case.py CASE`` under ``compute-sanitizer
--tool TOOL`` in a process of its own (no caching allocator, so memcheck sees each tensor's own
bounds); its log goes to ``$OUT/sanitize-TOOL-CASE.log``. A row per family and tool
(``bench/sanitize_case.FAMILIES``) holds the errors the tool reported over that family's cases
(``epicute``; 0 is clean) and whether the cases computed the right result. Writes
bench/results/sanitize.json (and $OUT/sanitize.json). Exit status 1 when any error was reported or
any case failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
from pathlib import Path

from common import write_result
from sanitize_case import CASES, FAMILIES

TOOLS = ("memcheck", "racecheck", "synccheck")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "sanitize.json"
#: memcheck/synccheck: "ERROR SUMMARY: 3 errors";
#: racecheck: "RACECHECK SUMMARY: 12 hazards displayed (7 errors, 5 warnings)"
SUMMARY = re.compile(r"(?:ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error)")


CASE_SCRIPT = str(Path(__file__).with_name("sanitize_case.py"))


def run(tool: str, case: str, out_dir: Path) -> tuple[int | None, bool, str]:
    """(errors reported, None when the tool printed no summary; the case's PASS; its log's path)."""
    log = out_dir / f"sanitize-{tool}-{case}.log"
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    command = ["compute-sanitizer", "--tool", tool, sys.executable, CASE_SCRIPT, case]
    with open(log, "w") as f:
        subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env=env, check=False)
    text = log.read_text(errors="replace")
    found = SUMMARY.findall(text)  # the first is the total ("... N errors were not printed" may follow)
    errors = int(next(x for x in found[0] if x)) if found else None
    return errors, bool(re.search(r"^PASS ", text, re.M)), str(log)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--jobs", type=int, default=4, help="sanitizer processes at a time")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    out_dir = Path(os.environ.get("OUT") or "/tmp")
    tools, cases = args.tools.split(","), args.cases.split(",")
    for case in cases:  # compiles (one at a time: the cache's lock would serialize them anyway)
        subprocess.run([sys.executable, CASE_SCRIPT, case], check=False)
    jobs = [(tool, case) for tool in tools for case in cases]
    with concurrent.futures.ThreadPoolExecutor(max(args.jobs, 1)) as pool:
        results = list(pool.map(lambda job: run(*job, out_dir), jobs))
    rows, clean = {}, True
    for (tool, case), (errors, passed, log) in zip(jobs, results):
        print(f"{tool:10s} {case:14s} errors {errors if errors is not None else '?'}  "
              f"{'PASS' if passed else 'FAIL'}  ({log})")  # fmt: skip
        row = rows.setdefault((FAMILIES[case], tool), {"case": f"{FAMILIES[case]}: {tool}", "epicute": 0,
                                                       "cases": [], "computed_right": True})  # fmt: skip
        row["cases"].append(case)
        # No summary (the tool or the process died) counts as an error: never a silent 0.
        row["epicute"] += 1 if errors is None else errors
        row["computed_right"] = row["computed_right"] and passed
        clean = clean and errors == 0 and passed
    command = "python bench/sanitize.py " + " ".join(sys.argv[1:])
    print(f"wrote {write_result(args.out, 'sanitize', command.strip(), 'errors', False, list(rows.values()))}")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
