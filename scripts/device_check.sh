#!/usr/bin/env bash
# One pass on the GPU machine: GPU tests, kernel / CPU-pool / tier benchmarks, and the full synthetic
# 80b-a3b runs. Each step has its own time limit so one slow step cannot eat the session's device time.
# Logs and JSON go to a work folder; at the end it is packed into $OUT/device.tgz (the device tool brings
# back at most 8 files, so one tarball), or kept in out/device without $OUT.
#
#   run tool, carry [".devbundle", ".nbc", ".tcache"]:  source .devbundle/env.sh && bash scripts/device_check.sh
#   STEPS="tests kernels cpu tiers"   which steps, in this order (default: those four). Also:
#     cpustore  the CPU kernels over 8 of its expert layers as the host store holds them (file map, arena)
#     m80       write the full synthetic 80b-a3b (Q4_0 experts, 47 GB, ~50 s) to $M80 (/tmp/m80.gguf)
#     prefill   bench_tiers on it at a 24 GiB budget: the auto chunk, then ring overlap, then a pinned store
#     ptrace    a 1024-token prefill on it under torch.profiler (op tables by device and host time)
#     spin      decode at 8K on it with GOMP_SPINCOUNT 100 and 300000 (the CPU pool's two parallel regions
#               per expert call: threads asleep or spinning between them)
#     threads   decode at 8K on it with the CPU pool on DECODE_THREADS threads (default "14 15"), in each
#               CPU_THREAD_MODES (default "0"; "0 1": also the helper thread behind a device flag), with
#               each GOMP_SPINCOUNT in DECODE_SPINS (default "300000"), or the DECODE_RUNS triples
#               threads:mode:spin
#     trace     decode at 8K on it, then 3 tokens under torch.profiler (tables + a Chrome trace);
#               TRACE_SPIN sets its GOMP_SPINCOUNT (default 300000, the engine's on CUDA); once per card size
#               in TRACE_CARDS (GiB, default "24"; 80 holds every expert); TRACE_TIMELINE=N also lists N
#               layers of the middle token event by event (trace_summary.py --timeline); once per
#               TRACE_ENVS entry ("-" the defaults, else NAME=VALUE pairs joined by commas); TRACE_BY_LAYER
#               names the op listed by layer (default _wait_body: the device's wait for the CPU rows);
#               TRACE_ARGS adds bench_tiers arguments (e.g. "--expert-profile /tmp/p80.strp --prompt-seed 1")
#     ours      compare_llamacpp.sh's our half on it (CONTEXTS=OURS_CONTEXTS, default 1024,8192, GEN=32 REPEATS=1, --local;
#               OURS_SETUPS, default "budget cpu-experts"; results in cmp$OURS_TAG; OURS_EXTRA: more flags of
#               our bench, e.g. "--expert-profile /tmp/p80.strp")
#     fused     decode at 8K on it with the fused decode kernels off and on (FUSED_MODES, default "0 1")
#     team      decode at 8K on it, the CPU team at each TEAM_SIZES size, once per TEAM_SCHEDS host wait
#     pcie      decode at 8K on it with each PCIE_SHARES permille of the misses read by the GPU over PCIe
#               (auto: the engine's share from the host's memory rate;
#               an entry share:KiB also sets STRATA_STAGE_CHUNK_KIB, the staging copy's bytes a program;
#               share:KiB:N also STRATA_DECODE_PREFETCH, the experts a layer copies ahead of its routing;
#               share:KiB:N:P also STRATA_AHEAD_PROGRAMS, the programs of those copies; a suffix
#               @NAME=VALUE,NAME=VALUE sets more variables, e.g. 400:32:2@STRATA_TOKEN_GRAPH=1)
#     gather    prefill at 1K and 8K on it, pinned copies per part then by one gather kernel (GATHER_MODES)
#   KERNELS_ARGS="--types Q4_0 --variants simple,split"   extra arguments of the kernels step
#     ltimes    prefill at 1K and 8K on it, each layer's expert call, its phases and the dense part timed
#               (--layer-times), once per LTIMES_ENVS entry (default "-": no extra environment)
#     rows      bench_token_rows.py at 14 threads: the same experts every token, then fresh ones from DRAM
#               (ROWS_MIXER_US: with a mixer's time and the prediction before each routing, the warming team too)
#     resident  decode at 8K on it with every expert on the GPU, per RESIDENT_VARIANTS (expert kernel variants,
#               variant:NAME=VALUE also sets an environment variable)
#     dense     bench_dense_q8.py at 1 and 4 tokens, both forms (the CUDA C and Triton GEMVs) against copy
#               bandwidth; DENSE_ARGS adds arguments (e.g. "--sweep --no-f32")
#     launch    the host cost of replaying a CUDA graph by node kind, forked graphs too (bench_graph_launch.py;
#               LAUNCH_ARGS, default "--nodes 25,100")
#     flagorder bench_flag_wait.py (the in-graph flag wait's memory orders) and the wait's GPU tests
#     fulltiles the prompt MMA rows' full-tile form off / on, interleaved (bench_kernels --mma-full-tiles)
#     firstdecode  FIRSTDECODE_RUNS (40) processes of repro_first_decode.py (FIRSTDECODE_ARGS), then --analyze
#     warm      compile the CPU pool's parallel kernel (numba, minutes when not cached) before timed steps
#   CPU_SPINS="100 300000"   the cpu step once per GOMP_SPINCOUNT (default "100")
#   TESTS="tests/..."   the GPU tests to run (default: all); BACKGROUND_TESTS=1 runs them beside the others
#   LIMIT_TESTS=420 LIMIT_KERNELS=180 LIMIT_CPU=90 LIMIT_TIERS=300 LIMIT_M80=120 LIMIT_PREFILL=120 (each run)
#   LIMIT_SPIN=100 (each run) LIMIT_OURS=300   per-step time limits in seconds
# With $OUT set and a numba cache in .nbc/nbc.tar.xz (made for that machine), the cache is unpacked first and
# the sources touched to a fixed time, so numba's stamps match; the cache is packed again at the end. A warm
# machine's files are kept, the tarball adding only what they lack: overwriting them would drop what an earlier
# call compiled for a host the tarball has no index for (session 39: every call on the H100 host compiled
# ~100 s again). Triton's kernels likewise from .tcache/triton.tar.xz (scripts/device_caches.sh); TRITON_BACK=1
# brings this call's back as $OUT/triton.tar.xz (a fresh machine compiles them for 200-260 s otherwise).
set -uo pipefail
work=$([[ -n "${OUT:-}" ]] && echo /tmp/device-out || echo out/device)
mkdir -p "$work"
steps=${STEPS:-tests kernels cpu tiers}
M80=${M80:-/tmp/m80.gguf}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/nbc}
source scripts/device_caches.sh

probe_numba_target "$work"  # this host's numba target, for scripts/numba_targets/

pack() {  # the work folder into $OUT/device.tgz, after every step: a run cut by the tool's limit loses nothing
    pack_dir "$work" device  # (scripts/device_caches.sh; the background tests pack too)
}

step() {  # step NAME LIMIT_S CMD...: run, keep the log, show its tail
    local name=$1 limit=$2
    shift 2
    local override="LIMIT_${name^^}"  # e.g. LIMIT_TIERS=200 shortens one step
    limit=${!override:-$limit}
    [[ " $steps " == *" $name "* ]] || return 0
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" >> "$work/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - t0)) s"
    tail -n 25 "$work/$name.log"
    pack
}

nvidia-smi -L 2>/dev/null | tee "$work/gpu.txt"
{  # host facts that decide a CPU pool call's fixed cost: idle states (wake latency), governor, threading layer
    for d in /sys/devices/system/cpu/cpu1/cpuidle/state*; do
        [[ -d $d ]] && echo "cpuidle $(cat "$d/name") latency $(cat "$d/latency") us disabled $(cat "$d/disable")"
    done
    echo "governor $(cat /sys/devices/system/cpu/cpu1/cpufreq/scaling_governor 2>/dev/null || echo none)"
    echo "cores $(nproc), $(grep -m1 'model name' /proc/cpuinfo)"
    lscpu 2>/dev/null | grep -E "^(Thread|Core|Socket|NUMA node|L2|L3)"  # hyperthreads share a core's units
    echo "transparent hugepages $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
    python -c "import numba, numba.np.ufunc.parallel as p; p._launch_threads(); print('numba', numba.__version__, 'threading layer', numba.threading_layer())"
} 2>&1 | tee -a "$work/gpu.txt"
# shellcheck disable=SC2086
if [[ -n "${BACKGROUND_TESTS:-}" ]]; then  # the GPU tests beside the CPU-bound steps (joined before packing)
    step tests 420 python -m pytest -m gpu -q -p no:cacheprovider -rs ${TESTS:-} > "$work/tests-step.txt" 2>&1 &
    tests_pid=$!
else
    step tests 420 python -m pytest -m gpu -q -p no:cacheprovider -rs ${TESTS:-}
fi
[[ -f "$M80" ]] || step m80 120 python -m strata_ray.run synth --arch qwen3next --preset 80b-a3b \
    --expert-type Q4_0 -o "$M80" --no-progress
# compile (or load) the CPU pool's parallel kernel once, before the steps that would each pay for it
step warm 240 python scripts/bench_cpu_kernels.py --threads 15 --types Q4_0 --tokens 1 --top-k 10 --experts 64 \
    --reps 1
# shellcheck disable=SC2086
step kernels 180 python scripts/bench_kernels.py --quick ${KERNELS_ARGS:-} --section-out "$work/kernels.md"
for sp in ${CPU_SPINS:-100}; do  # OpenMP spin counts: between calls the threads sleep (100) or spin
    step cpu 90 env GOMP_SPINCOUNT="$sp" python scripts/bench_cpu_kernels.py --threads 1,15 --types Q4_0,Q8_0 \
        --tokens 1 --top-k 1,3,5,10
done
# the same calls over 8 of the file's expert layers as the engine holds them: file map, then anonymous memory
cpustore=(python scripts/bench_cpu_kernels.py --threads 15 --tokens 1 --top-k 5,10 --reps 3 --model "$M80")
step cpustore 150 "${cpustore[@]}" --types Q4_0
step cpustore 150 "${cpustore[@]}" --types Q4_0 --arena
step tiers 300 python scripts/bench_tiers.py --layers 8 --decode 24 --pin-gib "${PIN_GIB:-0}" --json-out "$work/tiers.json"
# the same 8K prefill three ways (each run loads the model, ~25 s): staged copies, ring overlap, pinned store
prefill=(python scripts/bench_tiers.py --model "$M80" --depths 8192 --decode 16 --chunk 4096)
step prefill 120 "${prefill[@]}" --ring-overlap 0 --pin-gib 0 --json-out "$work/prefill-staged.json"
step prefill 120 "${prefill[@]}" --pin-gib 0 --json-out "$work/prefill-overlap.json"
step prefill 150 "${prefill[@]}" --json-out "$work/prefill-pinned.json"  # the defaults: overlap, auto pin
# a 1024-token prefill under torch.profiler (a 2K trace ran out of 150 s building its tables, session 5)
step ptrace 150 python scripts/bench_tiers.py --model "$M80" --depths 1024 --decode 4 --chunk 1024 \
    --trace-prefill 1024 --json-out "$work/ptrace.json"
# decode with OpenMP's threads spinning 100 or 300000 rounds (the engine's default on CUDA) between calls
decode=(python scripts/bench_tiers.py --model "$M80" --depths 8192 --decode 32 --chunk 4096)
step spin 100 env GOMP_SPINCOUNT=100 "${decode[@]}" --json-out "$work/spin-100.json"
step spin 100 env GOMP_SPINCOUNT=300000 "${decode[@]}" --json-out "$work/spin-300000.json"
# decode at 8K with the CPU pool on each of these thread counts (the engine takes every core but one), and
# each decode CPU-rows mode (CPU_THREAD_MODES: 0 host thread, 1 helper thread behind a device flag, p the
# pipelined token, the engine's default)
# and each OpenMP spin count in DECODE_SPINS (default "300000"; the pool's threads sleep or spin between calls)
# (DECODE_RUNS="15:0:300000 14:1:300000 15:p:300000 ..." lists threads:mode:spin triples instead of the cross
# product; mode p is the pipelined decode, STRATA_DECODE_PIPELINE)
runs=${DECODE_RUNS:-}
if [[ -z "$runs" ]]; then
    for n in ${DECODE_THREADS:-14 15}; do
        for ct in ${CPU_THREAD_MODES:-0}; do
            for sp in ${DECODE_SPINS:-300000}; do runs+=" $n:$ct:$sp"; done
        done
    done
fi
for run in $runs; do
    IFS=: read -r n ct sp <<< "$run"
    mode=(--decode-cpu-thread "$ct" --decode-pipeline 0)  # 0: the host plans each layer; 1: helper thread
    [[ $ct == p ]] && mode=(--decode-pipeline 1)  # p: the whole token enqueued, one numba worker per token
    step threads 100 env GOMP_SPINCOUNT="$sp" "${decode[@]}" --cpu-threads "$n" "${mode[@]}" \
        --json-out "$work/threads-$n-ct$ct-spin$sp.json"
done
# decode at 8K (24 GiB card) with each PCIE_SHARES permille (default "0 500 700 1000") of a layer's misses read by
# the GPU from the page-locked store over PCIe, the CPU pool computing the rest (STRATA_PCIE_SHARE); an entry
# share:KiB also sets the staging copy's bytes a program (STRATA_STAGE_CHUNK_KIB, default 32), share:KiB:N the
# experts a layer copies ahead of its routing (STRATA_DECODE_PREFETCH; unset: the engine's default)
# (a suffix #ARG,ARG adds bench_tiers arguments, after any @ suffix: 400:32#--adapt-every=0,--depths=1024,8192)
n_pcie=0
for entry in ${PCIE_SHARES:-0 500 700 1000}; do
    envs=() extra=()
    # arguments split at the commas that start another one (",--"): --depths=1024,8192 stays one
    if [[ $entry == *#* ]]; then args=${entry#*#}; IFS=$'\x1f' read -r -a extra <<< "${args//,--/$'\x1f'--}"; fi
    entry=${entry%%#*}
    [[ $entry == *@* ]] && IFS=, read -r -a envs <<< "${entry#*@}"
    IFS=: read -r ps ck pf ap <<< "${entry%%@*}"
    [[ $ps == auto ]] && ps=""  # the engine's own: from the host's memory rate (experts/pcie_share)
    n_pcie=$((n_pcie + 1))
    step pcie 100 env GOMP_SPINCOUNT=300000 STRATA_PCIE_SHARE="$ps" STRATA_STAGE_CHUNK_KIB="${ck:-32}" \
        ${pf:+STRATA_DECODE_PREFETCH="$pf"} ${ap:+STRATA_AHEAD_PROGRAMS="$ap"} "${envs[@]}" "${decode[@]}" \
        "${extra[@]}" --json-out "$work/pcie-$n_pcie-${entry//[=,@:]/_}.json"
done
# decode at 8K (24 GiB card) with the pipelined decode's CPU team at each TEAM_SIZES size in one process (default
# "15,12,9,15,12,9"), once per TEAM_SCHEDS entry (the host thread's wait: auto spin yield blocking; default auto)
for sc in ${TEAM_SCHEDS:-auto}; do
    step team 200 env GOMP_SPINCOUNT=300000 "${decode[@]}" --team-sizes "${TEAM_SIZES:-15,12,9,15,12,9}" \
        --sched "$sc" --json-out "$work/team-$sc.json"
done
# decode at 8K with the fused decode kernels off, then on (STRATA_FUSED_DECODE; GDN core, norms, combine, attention)
for fd in ${FUSED_MODES:-0 1}; do
    step fused 100 env GOMP_SPINCOUNT=300000 "${decode[@]}" --fused-decode "$fd" --json-out "$work/fused-$fd.json"
done
# prefill at 1K and 8K with the pinned expert copies as per-part copies, then as one gather kernel a batch
for gc in ${GATHER_MODES:-0 1}; do
    step gather 120 python scripts/bench_tiers.py --model "$M80" --depths 1024,8192 --decode 8 --chunk 4096 \
        --gather-copy "$gc" --json-out "$work/gather-$gc.json"
done
# prefill at 1K and 8K with each layer's expert call, its phases and the dense part before it timed by CUDA
# events, once per LTIMES_ENVS entry ("-" = the defaults; e.g. "- STRATA_STREAM_ALL=0 STRATA_RING_SLOTS=256",
# several variables joined by commas)
for le in ${LTIMES_ENVS:--}; do
    envs=()
    [[ $le == - ]] || IFS=, read -r -a envs <<< "$le"
    step ltimes 120 env "${envs[@]}" python scripts/bench_tiers.py --model "$M80" --depths 1024,8192 --decode 4 \
        --chunk 4096 --layer-times --json-out "$work/ltimes-${le//[=,]/_}.json"
done
# decode at 8K with every expert resident (an 80 GiB card) with each GPU expert kernel variant in
# RESIDENT_VARIANTS (default "simple split"): the expert kernels in series with the dense segment; an entry
# variant:NAME=VALUE[,NAME=VALUE] also sets those environment variables (e.g. words:STRATA_WORDS_CUDA=0)
n_res=0
for kvs in ${RESIDENT_VARIANTS:-simple split}; do
    kv=${kvs%%:*} extra=()
    [[ $kvs == *:* ]] && IFS=, read -r -a extra <<< "${kvs#*:}"
    n_res=$((n_res + 1))
    step resident 120 env STRATA_KERNEL_VARIANT="$kv" "${extra[@]}" python scripts/bench_tiers.py --model "$M80" \
        --card-gib 80 --depths 8192 --decode 32 --chunk 4096 --json-out "$work/resident-$n_res-${kvs//[:=]/_}.json"
done
# a decode layer's CPU rows flag to flag, 14 threads: the same experts every token (L3-friendly), then new
# routing over 5.4 GB of experts (DRAM, as in the engine)
# (ROWS_MISSES: the CPU entries a layer, a list, default 6; ROWS_SAME=0 skips the first run; ROWS_MIXER_US=N
# plays a mixer of N us before each routing, the prediction handed over first, and adds the warming team)
[[ ${ROWS_SAME:-1} == 0 ]] || step rows 150 python scripts/bench_token_rows.py --threads 14 --tokens 10 \
    --misses "${ROWS_MISSES:-6}"
step rows 200 python scripts/bench_token_rows.py --threads 14 --tokens 10 --fresh --layers 48 --experts 64 \
    --misses "${ROWS_MISSES:-6}" ${ROWS_MIXER_US:+--mixer-us "$ROWS_MIXER_US"}
# the dense Q8_0 GEMV against copy bandwidth: both forms at 1 and 4 tokens
step dense 150 python scripts/bench_dense_q8.py --tokens 1,4 ${DENSE_ARGS:-}
# the host cost of a graph replay by node kind (kernels, device-to-device copies, copies as kernels)
step launch 90 python scripts/bench_graph_launch.py ${LAUNCH_ARGS:---nodes 25,100}
# the in-graph host-flag wait's memory orders (STRATA_FLAG_ORDER): each one's cost a layer in a graph of 48,
# then the wait's GPU tests in each order
step flagorder 90 python scripts/bench_flag_wait.py --json-out "$work/flag_wait.json"
step flagorder 90 python -m pytest -m gpu -q -s -p no:cacheprovider tests/kernels/test_flag_wait.py
# the Q4_0 / Q8_0 prompt MMA rows' full-tile form (STRATA_MMA_FULL_TILES) off, on, off, on in one process
# (the prompt lines print before the CPU kernels', which the limit may cut)
step fulltiles 240 python scripts/bench_kernels.py --types Q4_0,Q8_0 --no-sweep --variants words --tokens 1 \
    --mma-full-tiles 0,1,0,1
# the first decode after a CUDA load in fresh processes (session 55's flaky case): FIRSTDECODE_RUNS of
# repro_first_decode (default 40; each 3 loads x 3 generates, ~10 s), FIRSTDECODE_ARGS added (e.g. --fill),
# then its count of the loads whose first generate differed (a step of its own: session 58's limit cut the
# processes, and the count with them)
# shellcheck disable=SC2016
step firstdecode 500 bash -c 'for _ in $(seq "$1"); do timeout 100 python scripts/repro_first_decode.py $2 \
    >> "$0/first_decode.jsonl"; done' "$work" "${FIRSTDECODE_RUNS:-40}" "${FIRSTDECODE_ARGS:---tag base}"
step firstdecode 60 python scripts/repro_first_decode.py --analyze "$work/first_decode.jsonl"
# one 8K decode's op tables and a Chrome trace of 3 tokens: where a token's time goes, device and host
# (once per TRACE_ENVS entry as LTIMES_ENVS: "-" the defaults, else variables joined by commas)
for gib in ${TRACE_CARDS:-24}; do
    for te in ${TRACE_ENVS:--}; do
        envs=()
        [[ $te == - ]] || IFS=, read -r -a envs <<< "$te"
        tag="$gib-${te//[=,]/_}"
        # shellcheck disable=SC2086
        step trace 120 env GOMP_SPINCOUNT="${TRACE_SPIN:-300000}" "${envs[@]}" "${decode[@]}" --card-gib "$gib" \
            --trace-decode 3 --trace-out "$work/decode-trace-$tag.json" --json-out "$work/trace-$tag.json" \
            ${TRACE_ARGS:-}
        step trace 60 python scripts/trace_summary.py "$work/decode-trace-$tag.json" --tokens 3 \
            --timeline "${TRACE_TIMELINE:-0}" --by-layer "${TRACE_BY_LAYER:-_wait_body}"
        rm -f "$work/decode-trace-$tag.json"  # tens of MB: the summary is what comes back
    done
done
step ours 300 env MODEL="$M80" CONTEXTS="${OURS_CONTEXTS:-1024,8192}" GEN=32 REPEATS="${REPEATS:-1}" SETUPS="${OURS_SETUPS:-budget cpu-experts}" \
    OURS_ARGS="--local ${OURS_EXTRA:-}" OUT="$work/cmp${OURS_TAG:-}" bash scripts/compare_llamacpp.sh ours
if [[ -n "${tests_pid:-}" ]]; then
    wait "$tests_pid"
    cat "$work/tests-step.txt"
fi
if [[ -n "${OUT:-}" ]]; then
    # the numba cache comes back on its own only when asked (NBC_BACK=1): inside device.tgz it pushed the
    # tarball past what the device tool brings back (session 6, call 1)
    [[ -n "${NBC_BACK:-}" && -d "$NUMBA_CACHE_DIR" ]] && tar czf "$OUT/nbc.tgz" -C "$(dirname "$NUMBA_CACHE_DIR")" \
        "$(basename "$NUMBA_CACHE_DIR")"
    [[ -n "${TRITON_BACK:-}" ]] && pack_triton_cache  # $OUT/triton.tar.xz: keep it as .tcache/triton.tar.xz
    pack
    echo "packed $work into \$OUT/device.tgz"
fi
