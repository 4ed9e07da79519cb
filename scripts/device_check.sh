#!/usr/bin/env bash
# One pass on the GPU machine: every GPU test (both expert-kernel variants), then the kernel, CPU-pool and
# tier benchmarks. Each step has its own time limit so one slow step cannot eat the session's device time;
# logs and JSON go to $OUT (the device tool's folder) or out/device.
#
#   run tool, carry [".devbundle"]:  source .devbundle/env.sh && bash scripts/device_check.sh
#   STEPS="tests kernels cpu tiers"   which steps (default: all four, in that order)
#   LIMIT_TESTS=240 LIMIT_KERNELS=180 LIMIT_CPU=90 LIMIT_TIERS=300   per-step time limits in seconds
set -uo pipefail
out=${OUT:-out/device}
mkdir -p "$out"
steps=${STEPS:-tests kernels cpu tiers}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME LIMIT_S CMD...: run, keep the log, show its tail
    local name=$1 limit=$2
    shift 2
    local override="LIMIT_${name^^}"  # e.g. LIMIT_TIERS=200 shortens one step
    limit=${!override:-$limit}
    [[ " $steps " == *" $name "* ]] || return 0
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - t0)) s"
    tail -n 40 "$out/$name.log"
}

nvidia-smi -L 2>/dev/null | tee "$out/gpu.txt"
step tests 240 python -m pytest -m gpu -q -p no:cacheprovider -rs
step kernels 180 python scripts/bench_kernels.py --quick --section-out "$out/kernels.md"
step cpu 90 python scripts/bench_cpu_kernels.py --threads 1,16
step tiers 300 python scripts/bench_tiers.py --layers 8 --decode 24 --pin-gib "${PIN_GIB:-0}" --json-out "$out/tiers.json"
