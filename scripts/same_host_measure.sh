#!/usr/bin/env bash
# Issue 6's two targets on ONE host, in one GPU-machine call: llama.cpp's budget setup and our standard
# measure side by side, so "2x llama.cpp on the same machine" and "70% of this machine's roofline" are read
# from the same host (the pool's hosts differ up to 1.5x in their CPU rows and PCIe copies).
#
#   run tool, carry [".devbundle", "third_party/llama.cpp.tar.xz", ".nbc", ".tcache"] (llama.cpp's source
#   packed here by `tar cJf third_party/llama.cpp.tar.xz -C third_party llama.cpp`: 2 MiB against 21 unpacked,
#   which with the bundle and the tree passes the call's 64 MiB; without .nbc the numba forms compile here,
#   beside the build; .tcache: scripts/device_caches.sh, TRITON_BACK=1 brings this call's Triton kernels back):
#   source .devbundle/env.sh && bash scripts/same_host_measure.sh 2>&1 | tail -40
#
# Steps: build llama-bench (compare_llamacpp.sh build) ‖ the m80 synth (80b-a3b, Q4_0 experts) ‖ numba's
# precompile of the CPU forms; llama-bench's budget setup (24 GiB: --n-cpu-moe from the GGUF) at 1K and 8K,
# GEN=128, 2 repeats; then bench_tiers' standard measure (24 GiB card, 1K then 8K in one process, 256
# tokens each), three runs or SAME_HOST_RUN_ARGS' (below), as many as SAME_HOST_BUDGET_S (585) leaves room
# for. JSON and logs in /tmp/same-host, packed into $OUT/same-host.tgz after each step (the tool brings back a
# few files of $OUT, and a cut run keeps what it did), with this host's numba target (numba-target/: add it
# to scripts/numba_targets/ where it is new); out/same-host without $OUT. The llama-bench build stays in
# third_party/ for a warm machine's next call.
set -u
out=$([[ -n "${OUT:-}" ]] && echo /tmp/same-host || echo out/same-host)
mkdir -p "$out"
pack() {
    pack_dir "$out" same-host  # (scripts/device_caches.sh)
}
budget=${SAME_HOST_BUDGET_S:-585}
model=${M80:-/tmp/m80.gguf}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/nbc}
export GOMP_SPINCOUNT=${GOMP_SPINCOUNT:-300000}
source scripts/device_caches.sh  # the carried .nbc and .tcache
if [[ -f third_party/llama.cpp.tar.xz && ! -f third_party/llama.cpp/CMakeLists.txt ]]; then
    tar xJf third_party/llama.cpp.tar.xz -C third_party
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
probe_numba_target "$out"  # this host's numba target, for scripts/numba_targets/
(timeout 360 bash scripts/compare_llamacpp.sh build > "$out/build.log" 2>&1; echo "build rc $?" >> "$out/build.log") &
build_pid=$!
(timeout 360 python -m strata_ray.kernels.precompile --threads 15 --jobs 4 > "$out/precompile.log" 2>&1) &
precompile_pid=$!
[[ -f $model ]] || timeout 150 python -m strata_ray.run synth --arch qwen3next --preset 80b-a3b --expert-type Q4_0 \
    -o "$model" --no-progress > "$out/synth.log" 2>&1
echo "synth done at $((SECONDS - t0)) s"
wait "$precompile_pid"; echo "precompile done at $((SECONDS - t0)) s: $(tail -1 "$out/precompile.log")"
wait "$build_pid"; tail -2 "$out/build.log"; echo "build done at $((SECONDS - t0)) s"
timeout 150 env MODEL="$model" CONTEXTS=1024,8192 GEN=128 REPEATS=2 SETUPS=budget OUT="$out/cmp" \
    bash scripts/compare_llamacpp.sh llama > "$out/llama.log" 2>&1
echo "llama done at $((SECONDS - t0)) s"
pack
python - "$out" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(sys.argv[1] + "/cmp/llama-*.json")):
    try:
        for r in json.load(open(f)):
            print(os.path.basename(f), "prompt", r.get("n_prompt"), "gen", r.get("n_gen"), "depth", r.get("n_depth"),
                  round(r.get("avg_ts", 0), 1), "+-", round(r.get("stddev_ts", 0), 1), "tok/s")
    except (OSError, ValueError) as e:
        print(f, "unreadable:", e)
PY
# SAME_HOST_RUN_ARGS: each run's extra bench_tiers flags, runs split by ';' (an A/B, e.g.
# "--swiglu-fold=1;--swiglu-fold=0;--swiglu-fold=1"); by default three runs with none
IFS=";" read -r -a run_args <<< "${SAME_HOST_RUN_ARGS:-;;;}"  # ";;;": three empty fields
for i in "${!run_args[@]}"; do
    left=$((budget - (SECONDS - t0)))
    [[ $left -gt 45 ]] || break
    echo "run $i: ${run_args[$i]:-(defaults)}"
    # shellcheck disable=SC2086  # a run's flags split on spaces
    timeout "$left" python scripts/bench_tiers.py --model "$model" --depths 1024,8192 --decode 256 --chunk 4096 \
        --card-gib 24 --json-out "$out/std-$i.json" ${run_args[$i]} > "$out/std-$i.log" 2>&1
    grep -h "copy rates\|CPU kernels compiled\|kernels ready" "$out/std-$i.log" | cut -c1-150
    python - "$out/std-$i.json" "$i" <<'PY' || echo "run $i cut"
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print("ours", sys.argv[2], r["depth"], round(r["decode_tok_s"], 1), "tok/s, hit", round(r["hit_rate"], 3),
          "of the H200 roofline", round(r["of_roofline"], 3), "of this host's", round(r["of_roofline_here"], 3),
          "cpu ms", round(r["cpu_ms_per_token"], 2), "wait ms", round(r["wait_ms_per_token"], 2))
PY
    pack
done
[[ -n "${TRITON_BACK:-}" ]] && pack_triton_cache  # $OUT/triton.tar.xz: keep it as .tcache/triton.tar.xz
echo "end at $((SECONDS - t0)) s"
