# Sourced by the GPU-machine scripts (device_check.sh, same_host_measure.sh, a call's own script): the compile
# caches carried into the call, unpacked before anything compiles. Only with $OUT set (on the device machine):
# never touch a dev checkout's mtimes or environment.
#   .nbc/nbc.tar.xz        numba's CPU kernels, made here for that machine (scripts/numba_cache_for.py)
#   .tcache/triton.tar.xz  Triton's kernels, packed on an earlier call (scripts/triton_cache.py)
# and, for the call to use: probe_numba_target DIR (this host's numba target into DIR/numba-target, for
# scripts/numba_targets/), pack_triton_cache (at a call's end: its Triton kernels into $OUT/triton.tar.xz,
# to carry next) and pack_dir DIR NAME (a work folder into $OUT/NAME.tgz).
if [[ -n "${OUT:-}" ]]; then
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache}  # one path for every process of the call
    if [[ -f .nbc/nbc.tar.xz ]]; then
        # numba's index keys a source file by its mtime as well as its hash: the tarball was made from sources
        # stamped with this date
        find strata_ray scripts tests -name '*.py' -exec touch -d '2026-01-01 00:00:00' {} +
        # --skip-old-files: a warm machine's files stay and the tarball adds the files they lack, so the
        # functions an earlier call never compiled come from it (session 43: a call without the tarball left a
        # partial cache, and the next call's runs compiled the decode team again); a function whose index the
        # warm cache already has keeps that index (numba's one file a function), with only the entries
        # compiled there
        mkdir -p "$(dirname "$NUMBA_CACHE_DIR")"
        tar xJf .nbc/nbc.tar.xz --skip-old-files -C "$(dirname "$NUMBA_CACHE_DIR")"
    fi
    if [[ -f .tcache/triton.tar.xz ]]; then  # ~200-260 s of compiling on a fresh machine otherwise
        python scripts/triton_cache.py unpack .tcache/triton.tar.xz || true
    fi
fi

pack_dir() {  # pack_dir DIR NAME: DIR into $OUT/NAME.tgz under a name of this process's own, then renamed, so
    # a run the tool cuts keeps the last whole archive and background steps that pack too never share a file
    [[ -n "${OUT:-}" ]] || return 0
    local part="$OUT/.$2-$BASHPID.tgz"
    tar czf "$part" -C "$(dirname "$1")" "$(basename "$1")" && mv -f "$part" "$OUT/$2.tgz"
}

pack_triton_cache() {
    [[ -n "${OUT:-}" ]] || return 0
    python scripts/triton_cache.py pack --out "$OUT/triton.tar.xz" || true
}

probe_numba_target() {  # a host without its index in numba_targets/ compiles the CPU kernels at its first
    # engine run: ~110 s on session 38's Intel H100 host, 305 s (the decode team) on session 44's
    [[ -n "${OUT:-}" ]] || return 0
    python scripts/numba_cache_for.py --probe-to "$1/numba-target" > "$1/numba-target.log" 2>&1 || true
}
