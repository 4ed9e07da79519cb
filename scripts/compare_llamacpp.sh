#!/usr/bin/env bash
# flashbench side by side with llama.cpp's llama-bench, on the same synthetic GGUF and the same VRAM budget.
#
#   scripts/compare_llamacpp.sh [fetch|build|llama|ours|table|run|all]   (default: all; fetch/build skip finished work)
#
# fetch  (needs PyPI) llama.cpp's source from the llama-cpp-python sdist (`pip download --no-binary :all:`),
#        stripped to what building llama-bench with CUDA needs (no models/, docs/, tests/, examples/, other
#        ggml backends or other tools) into third_party/llama.cpp, which git ignores. The GPU machine cannot
#        reach PyPI: fetch here and carry third_party/llama.cpp there (a few MB).
# build  llama-bench with CUDA (-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real, $JOBS jobs; ~4 min with 16).
# llama  synthesize the model if it is missing, then run llama-bench for each setup (JSON into $OUT)
# ours   the same for our bench (the two halves can run in separate device calls: each leaves JSON in $OUT)
# table  print both side by side with ratios, from the JSON in $OUT
# run    llama, ours and table. Same contexts, generation length and repeats for both engines. Setups:
#          cpu-experts  every routed expert on the CPU: llama-bench -ot exps=CPU, ours --expert-cache 0
#          budget       a GPU of BUDGET_MIB MiB: llama-bench --n-cpu-moe N (N computed from the GGUF so the
#                       other layers' experts fit the budget), ours --vram-budget-mib BUDGET_MIB
#
# Settings (environment):
#   MODEL=path.gguf       model to compare (default: $OUT/synth-$SYNTH_PRESET.gguf, synthesized if missing)
#   SYNTH_PRESET=80b-a3b  SYNTH_LAYERS=  (empty = the preset's depth; fewer layers = a faster, smaller run)
#   SYNTH_ARCH=qwen3next   SYNTH_EXPERT_TYPE=Q4_0   OURS_ARGS=  (extra flags for our bench, e.g. --prefill 4096)
#   CONTEXTS=8192,32768   GEN=128   REPEATS=3   BUDGET_MIB=24576 (empty = only cpu-experts)
#   SETUPS="budget cpu-experts"  (which setups, in this order; budget needs BUDGET_MIB)
#   RESERVE_MIB=700       VRAM kept free besides the dense weights when computing --n-cpu-moe
#   DEVICE=cuda (ours)   LLAMA_CUDA=ON (OFF = CPU-only llama-bench, to try the script without a GPU)
#   JOBS=16   OUT=out/compare   LLAMA_CPP_PYTHON_VERSION= (empty = newest)
#   LLAMA_ARGS="-fa 1 -ub 4096 -lm none"  (extra llama-bench flags; the default is GPU-MACHINE.md's reference
#              setting: flash attention, 4096-token ubatches, weights read into memory instead of mapped)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
THIRD_PARTY="$ROOT/third_party"
SRC="$THIRD_PARTY/llama.cpp"
LLAMA_CUDA="${LLAMA_CUDA:-ON}"  # OFF: a CPU-only llama-bench (to try the script on a machine without a GPU)
DEVICE="${DEVICE:-cuda}"        # our engine's --device
BUILD="${BUILD:-$THIRD_PARTY/llama.cpp-build$([[ $LLAMA_CUDA == ON ]] || echo -cpu)}"
LLAMA_BENCH="$BUILD/bin/llama-bench"
OUT="${OUT:-$ROOT/out/compare}"
SYNTH_PRESET="${SYNTH_PRESET:-80b-a3b}"
SYNTH_LAYERS="${SYNTH_LAYERS:-}"
SYNTH_ARCH="${SYNTH_ARCH:-qwen3next}"
SYNTH_EXPERT_TYPE="${SYNTH_EXPERT_TYPE:-Q4_0}"  # GPU-MACHINE.md's llama.cpp numbers: Q4_0 experts, Q8_0 dense
OURS_ARGS="${OURS_ARGS:-}"
MODEL="${MODEL:-$OUT/synth-$SYNTH_PRESET${SYNTH_LAYERS:+-L$SYNTH_LAYERS}.gguf}"
CONTEXTS="${CONTEXTS:-8192,32768}"
GEN="${GEN:-128}"
REPEATS="${REPEATS:-3}"
BUDGET_MIB="${BUDGET_MIB-24576}"
RESERVE_MIB="${RESERVE_MIB:-700}"
JOBS="${JOBS:-16}"
LLAMA_ARGS="${LLAMA_ARGS--fa 1 -ub 4096 -lm none}"
SETUPS="${SETUPS:-}"
PYTHON="${PYTHON:-python}"

say() { echo "compare_llamacpp: $*" >&2; }
die() { say "$*"; exit 2; }

# ---- fetch: the sdist's vendored llama.cpp, stripped ---------------------------------------------------------
fetch() {
    if [[ -f "$SRC/CMakeLists.txt" ]]; then say "source present: $SRC"; return; fi
    local dl="$THIRD_PARTY/download" spec="llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}"
    mkdir -p "$dl"
    if ! compgen -G "$dl/llama_cpp_python-*.tar.gz" >/dev/null; then
        say "downloading the $spec sdist (~76 MB) from PyPI (pip prepares its metadata: a few minutes)"
        "$PYTHON" -m pip download --no-binary :all: --no-deps -d "$dl" "$spec" >&2 \
            || die "pip download failed (PyPI unreachable? fetch on a machine with PyPI, then carry $SRC)"
    fi
    local sdist; sdist="$(ls -t "$dl"/llama_cpp_python-*.tar.gz | head -1)"
    local tmp; tmp="$(mktemp -d "$THIRD_PARTY/unpack.XXXX")"
    tar -xzf "$sdist" -C "$tmp"
    local tree; tree="$(echo "$tmp"/llama_cpp_python-*/vendor/llama.cpp)"
    [[ -f "$tree/CMakeLists.txt" ]] || die "no vendor/llama.cpp in $sdist"
    # what the build never reads: model vocabularies, docs, tests, examples, Python, other backends and tools
    rm -rf "$tree"/{models,docs,tests,examples,pocs,benches,media,gguf-py,conversion,scripts,requirements,ci} \
           "$tree"/{grammars,skills,app,.devops,.github} "$tree"/*.py
    find "$tree/ggml/src" -mindepth 1 -maxdepth 1 -type d -name 'ggml-*' \
        ! -name ggml-cpu ! -name ggml-cuda -exec rm -rf {} +
    find "$tree/tools" -mindepth 1 -maxdepth 1 ! -name llama-bench -exec rm -rf {} +
    cat > "$tree/tools/CMakeLists.txt" <<'EOF'
# stripped by scripts/compare_llamacpp.sh: llama-bench only
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(llama-bench)
EOF
    echo "$(basename "$sdist")" > "$tree/STRATA_SOURCE"
    mv "$tree" "$SRC"
    rm -rf "$tmp"
    say "stripped llama.cpp from $(basename "$sdist") into $SRC ($(du -sh "$SRC" | cut -f1); git ignores third_party/)"
}

# ---- build: llama-bench with CUDA --------------------------------------------------------------------------
build() {
    if [[ -x "$LLAMA_BENCH" ]]; then say "llama-bench present: $LLAMA_BENCH"; return; fi
    [[ -f "$SRC/CMakeLists.txt" ]] || die "no llama.cpp source in $SRC: run '$0 fetch' where PyPI is reachable"
    command -v cmake >/dev/null || die "cmake is not installed"
    if [[ $LLAMA_CUDA == ON ]]; then
        command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]] || die "nvcc (the CUDA toolkit) is not installed"
        command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
    fi
    local gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
    say "configuring llama-bench (CUDA $LLAMA_CUDA, sm_90)"
    cmake -S "$SRC" -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA="$LLAMA_CUDA" -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_NATIVE=ON -DGGML_CCACHE=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF >&2 \
        || die "cmake configure failed (above); it needs a full CUDA toolkit, cuBLAS (cublas_v2.h) included"
    say "building llama-bench with $JOBS jobs"
    local start=$SECONDS
    cmake --build "$BUILD" --target llama-bench -j "$JOBS" >&2 || die "building llama-bench failed (above)"
    say "built $LLAMA_BENCH in $((SECONDS - start)) s"
}

# ---- run: both engines, same model, same budget --------------------------------------------------------------
ensure_model() {
    if [[ -f "$MODEL" ]]; then return; fi
    # qwen3next: every 4th layer is full attention; llama.cpp aborts on a model without one (empty KV cache)
    if [[ $SYNTH_ARCH == qwen3next && -n "$SYNTH_LAYERS" && "$SYNTH_LAYERS" -lt 4 ]]; then
        die "SYNTH_LAYERS=$SYNTH_LAYERS: a qwen3next model needs at least 4 layers for llama.cpp (one attention layer)"
    fi
    mkdir -p "$(dirname "$MODEL")"
    say "synthesizing $MODEL (preset $SYNTH_PRESET${SYNTH_LAYERS:+, $SYNTH_LAYERS layers})"
    "$PYTHON" -m strata_ray.run synth --arch "$SYNTH_ARCH" --preset "$SYNTH_PRESET" ${SYNTH_LAYERS:+--layers "$SYNTH_LAYERS"} \
        --expert-type "$SYNTH_EXPERT_TYPE" -o "$MODEL"
}

llama_bench() {  # setup, placement flags... -> $OUT/llama-<setup>-{prefill,decode}.json
    local setup="$1"; shift
    say "llama-bench [$setup]: prefill at $CONTEXTS"
    # shellcheck disable=SC2086
    "$LLAMA_BENCH" -m "$MODEL" -ngl 999 "$@" -p "$CONTEXTS" -n 0 -r "$REPEATS" -o json $LLAMA_ARGS \
        > "$OUT/llama-$setup-prefill.json" || { say "llama-bench [$setup] prefill failed"; return 0; }
    say "llama-bench [$setup]: decode of $GEN tokens at depths $CONTEXTS"
    # shellcheck disable=SC2086
    "$LLAMA_BENCH" -m "$MODEL" -ngl 999 "$@" -p 0 -n "$GEN" -d "$CONTEXTS" -r "$REPEATS" -o json $LLAMA_ARGS \
        > "$OUT/llama-$setup-decode.json" || say "llama-bench [$setup] decode failed"
}

ours() {  # setup, engine flags... -> $OUT/ours-<setup>.json, its output in $OUT/ours-<setup>.log
    local setup="$1"; shift
    say "strata_ray bench [$setup]"
    # shellcheck disable=SC2086
    if ! "$PYTHON" -m strata_ray.run bench --model "$MODEL" --device "$DEVICE" "$@" $OURS_ARGS --contexts "$CONTEXTS" \
            --gen "$GEN" --repeats "$REPEATS" --story-tokens 0 --json-out "$OUT/ours-$setup.json" 2>&1 \
            | tee "$OUT/ours-$setup.log" >&2; then
        say "strata_ray bench [$setup] failed: $(tail -1 "$OUT/ours-$setup.log")"
    fi
}

side_by_side() {  # setup
    local setup="$1"
    "$PYTHON" -m strata_ray.bench.llamacpp compare --setup "$setup" --ours "$OUT/ours-$setup.json" \
        --ours-log "$OUT/ours-$setup.log" --llama "$OUT/llama-$setup-prefill.json" "$OUT/llama-$setup-decode.json" \
        | tee "$OUT/compare-$setup.md"
}

setups() {  # the setups to run, in order: $SETUPS, or budget (when BUDGET_MIB is set) then cpu-experts
    if [[ -n "$SETUPS" ]]; then
        echo $SETUPS  # checked at start (check_setups): a die in $(setups) would only leave the subshell
        return
    fi
    [[ -z "$BUDGET_MIB" ]] || echo budget
    echo cpu-experts
}

check_setups() {
    local s
    for s in $SETUPS; do
        [[ $s == cpu-experts || ($s == budget && -n "$BUDGET_MIB") ]] \
            || die "SETUPS: unknown setup '$s' (cpu-experts, or budget with BUDGET_MIB set)"
    done
}

prepare() {
    mkdir -p "$OUT"
    ensure_model
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>/dev/null || true
    say "model $MODEL; GPU $(cat "$OUT/gpu.txt" 2>/dev/null || echo unknown)"
}

run_llama() {
    [[ -x "$LLAMA_BENCH" ]] || die "no llama-bench at $LLAMA_BENCH: run '$0 build' first"
    prepare
    local setup
    for setup in $(setups); do
        rm -f "$OUT"/llama-"$setup"-*
        if [[ $setup == cpu-experts ]]; then
            llama_bench cpu-experts -ot "exps=CPU"
        else
            local ncmoe
            ncmoe="$("$PYTHON" -m strata_ray.bench.llamacpp n-cpu-moe --model "$MODEL" --budget-mib "$BUDGET_MIB" \
                --reserve-mib "$RESERVE_MIB")"
            say "budget $BUDGET_MIB MiB: llama-bench --n-cpu-moe $ncmoe"
            echo "$ncmoe" > "$OUT/llama-budget-ncmoe.txt"
            llama_bench budget --n-cpu-moe "$ncmoe"
        fi
    done
}

run_ours() {
    prepare
    local setup
    for setup in $(setups); do
        rm -f "$OUT"/ours-"$setup".*
        if [[ $setup == cpu-experts ]]; then
            ours cpu-experts --expert-cache 0
        else
            ours budget --vram-budget-mib "$BUDGET_MIB" --vram-reserve-mib "$RESERVE_MIB"
        fi
    done
}

table() {
    local setup
    for setup in $(setups); do side_by_side "$setup"; done
    say "tables in $OUT/compare-*.md; raw JSON in $OUT"
}

stage="${1:-all}"
if [[ "$stage" == "-h" || "$stage" == "--help" ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'  # the header above, without its '#'
    exit 0
fi
check_setups
case "$stage" in
    fetch) fetch ;;
    build) build ;;
    llama) run_llama ;;
    ours) run_ours ;;
    table) table ;;
    run) run_llama; run_ours; table ;;
    all) fetch; build; run_llama; run_ours; table ;;
    *) die "unknown stage '$stage' (fetch, build, llama, ours, table, run or all)" ;;
esac
