#!/usr/bin/env bash
# A/B of two versions of the engine within one GPU-machine call: the same machine, runs interleaved
# (old, new, old, new, ...), so the host's 10-20% spread between machines of the pool cancels out.
#
#   here:   git diff OLD -- strata_ray > ab-old.patch     (untracked: it travels with the working tree)
#   there:  source .devbundle/env.sh && STEPS="tests m80" bash scripts/device_check.sh > $OUT/check.txt 2>&1;
#           AB_SETUPS="resident budget" AB_ROUNDS=2 bash scripts/device_ab.sh > $OUT/ab.txt 2>&1
#
# The patch is reverted for the "old" runs and re-applied after each (the tree ends as it started, also
# when a run fails). Each run is bench_tiers at AB_DEPTH (8192) with AB_DECODE (32) tokens; results in
# /tmp/ab/<round>-<old|new>-<setup>.json, packed into $OUT/ab.tgz after every run (a call cut short keeps
# what ran), and one line per run in the log.
#   AB_SETUPS   resident (every expert on the GPU: an 80 GiB card), budget (a 24 GiB card); a setup may carry
#               environment for its run: resident:STRATA_X=0,STRATA_Y=1
#   AB_NEW_SETUPS  more setups run on the new side only (a switch the old code does not have)
#   AB_PATCH    the patch file (ab-old.patch); AB_LIMIT seconds a run (150)
# Needs device_check's m80 step first (the model at $M80, /tmp/m80.gguf) and its numba cache setup.
set -uo pipefail
patch_file=${AB_PATCH:-ab-old.patch}
M80=${M80:-/tmp/m80.gguf}
work=/tmp/ab
mkdir -p "$work"
[[ -f $patch_file ]] || { echo "device_ab: no patch file $patch_file" >&2; exit 2; }
[[ -f $M80 ]] || { echo "device_ab: no model at $M80 (run device_check's m80 step first)" >&2; exit 2; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/nbc}
export GOMP_SPINCOUNT=${GOMP_SPINCOUNT:-300000}

setup_args() {
    case ${1%%:*} in
        resident) echo "--card-gib 80" ;;
        budget) echo "--card-gib 24" ;;
        *) echo "device_ab: unknown setup $1 (resident, budget)" >&2; return 2 ;;
    esac
}

run_one() {  # run_one ROUND SIDE SETUP[:ENV=VAL,...]
    local args envs=() name="$1-$2-${3//[:=,]/_}"
    local out="$work/$name.json"
    args=$(setup_args "$3") || return 2
    [[ $3 == *:* ]] && IFS=, read -r -a envs <<< "${3#*:}"
    # shellcheck disable=SC2086
    timeout "${AB_LIMIT:-150}" env "${envs[@]}" python scripts/bench_tiers.py --model "$M80" \
        --depths "${AB_DEPTH:-8192}" --decode "${AB_DECODE:-32}" --chunk 4096 $args --json-out "$out" \
        > "$work/$name.log" 2>&1
    echo "round $1 $2 $3: exit $? $(python -c "import json,sys; r=json.load(open(sys.argv[1]))['results'][0]; \
print({k: round(v, 3) for k, v in r.items() if isinstance(v, (int, float)) and ('tok_s' in k or k.endswith('_ms')
       or k.endswith('ms_per_token') or k in ('hit_rate', 'of_roofline'))})" "$out" 2>/dev/null)"
    [[ -n "${OUT:-}" ]] && tar czf "$OUT/ab.tgz" -C /tmp ab
}

for round in $(seq 1 "${AB_ROUNDS:-2}"); do
    for side in old new; do
        if [[ $side == old ]]; then
            patch -s -p1 -R < "$patch_file" || { echo "device_ab: the patch does not revert" >&2; exit 2; }
        fi
        setups=${AB_SETUPS:-resident budget}
        [[ $side == new ]] && setups+=" ${AB_NEW_SETUPS:-}"
        for setup in $setups; do run_one "$round" "$side" "$setup"; done
        [[ $side == old ]] && patch -s -p1 < "$patch_file"
    done
done
