#!/usr/bin/env bash
# Runs epicute's GPU checks on the device machine, from the repository root:
#     bash bench/device.sh [test] [bench] [sanitize]      (default: all three, in that order)
# through the device tool: run(command="bash bench/device.sh", carry=[".device"]).
# Every step runs even if an earlier one failed; the exit status is non-zero if any failed.
# Files left in $OUT: gpu-tests.log (every shard's log), bench.log,
# gemm.json, sanitize.json and a sanitize-<tool>-<case>.log per tool and case.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(test bench sanitize)
for step in "${steps[@]}"; do
    case "$step" in
        test | bench | sanitize) ;;
        *) echo "device.sh: unknown step '$step' (want test, bench or sanitize)" >&2; exit 2 ;;
    esac
done
# shellcheck source=/dev/null
source .device/env.sh || { echo "device.sh: .device/env.sh failed (run stage.sh first?)" >&2; exit 1; }
export PYTHONUNBUFFERED=1
# Outside the device tool there is no $OUT: keep the logs in a fresh temp dir instead.
export OUT="${OUT:-$(mktemp -d)}"
echo "logs and results go to $OUT"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda)'

failed=()

# The GPU suite compiles ~150 kernel variants (1-4 s each, on one CPU core), so it
# runs as EPICUTE_TEST_SHARDS pytest processes (default 8) over round-robin slices of
# the test ids; tests are small, so sharing the GPU costs little. EPICUTE_TEST_PATHS
# (default: tests) narrows the run, e.g. to tests/attention/test_attention_gpu.py.
run_test() {
    local shards=${EPICUTE_TEST_SHARDS:-8} dir i status=0
    dir=$(mktemp -d)
    # shellcheck disable=SC2086  # several paths split on spaces
    python3 -m pytest -m gpu -q --collect-only -p no:cacheprovider ${EPICUTE_TEST_PATHS:-tests} 2>/dev/null |
        grep '::' >"$dir/ids"
    echo "$(wc -l <"$dir/ids") GPU tests in $shards shards"
    for ((i = 0; i < shards; i++)); do
        awk -v n="$shards" -v i="$i" 'NR % n == i' "$dir/ids" >"$dir/ids-$i"
        [ -s "$dir/ids-$i" ] || continue
        (mapfile -t ids <"$dir/ids-$i"
         python3 -m pytest -m gpu -q -p no:cacheprovider "${ids[@]}" >"$dir/log-$i" 2>&1) &
    done
    wait
    for ((i = 0; i < shards; i++)); do
        [ -f "$dir/log-$i" ] || continue
        cat "$dir/log-$i" >>"$OUT/gpu-tests.log"
        echo "shard $i: $(tail -n 1 "$dir/log-$i")"
        grep -qE "(failed|error)" <(tail -n 1 "$dir/log-$i") && status=1
        grep -qE "passed" <(tail -n 1 "$dir/log-$i") || status=1
    done
    grep -E "^(FAILED|ERROR) " "$OUT/gpu-tests.log"
    return $status
}

run_bench() {
    python3 bench/gemm.py --all 2>&1 | tee "$OUT/bench.log"
}

# memcheck, racecheck and synccheck over a small case of every kernel family (bench/sanitize_case.py);
# writes sanitize.json (errors per family and tool) and one log per tool and case.
run_sanitize() {
    python3 bench/sanitize.py --jobs 6 --out "$OUT/sanitize.json"
}

for step in "${steps[@]}"; do
    echo "=== $step ==="
    "run_$step" || failed+=("$step")
done

if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all steps passed: ${steps[*]}"
