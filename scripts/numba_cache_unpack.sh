# Sourced by the GPU-machine scripts (device_check.sh, same_host_measure.sh): unpack the numba cache made here
# for that machine (.nbc/nbc.tar.xz, scripts/numba_cache_for.py) into $NUMBA_CACHE_DIR. Only with $OUT set
# (on the device machine): never touch a dev checkout's mtimes.
if [[ -n "${OUT:-}" && -f .nbc/nbc.tar.xz ]]; then
    # numba's index keys a source file by its mtime as well as its hash: the tarball was made from sources
    # stamped with this date
    find strata_ray scripts tests -name '*.py' -exec touch -d '2026-01-01 00:00:00' {} +
    # --skip-old-files: a warm machine's files stay and the tarball adds the files they lack, so the functions
    # an earlier call never compiled come from it (session 43: a call without the tarball left a partial cache,
    # and the next call's runs compiled the decode team again); a function whose index the warm cache already
    # has keeps that index (numba's one file a function), with only the entries compiled there
    mkdir -p "$(dirname "$NUMBA_CACHE_DIR")"
    tar xJf .nbc/nbc.tar.xz --skip-old-files -C "$(dirname "$NUMBA_CACHE_DIR")"
fi
