#!/usr/bin/env bash
# Before/after timing of the cascade's GQA shapes in one device call: two source trees (e.g.
# `git archive OLD | tar x -C .ab/before`, the same for HEAD into .ab/after, carried), each timed
# by its own benchmarks/bench_cascade.py in its own process, one after the other. They share a
# persistent compile cache: where both trees lower a kernel to the same program, the second
# process finds it there.
#
#   bash benchmarks/tools/cascade_ab.sh BEFORE_DIR AFTER_DIR OUT DTYPES [LIMIT_S] [BENCH_ARGS...]
#
# BENCH_ARGS go to both sides' bench_cascade.py (e.g. --shapes 8x8192x16 to time one shape).
#
# Each side's log goes to OUT/ab_<side>_<dtypes>.log; the rows to compare are its `shape=` lines.
set -uo pipefail
BEFORE=$1 AFTER=$2 OUT=$3 DTYPES=$4 LIMIT=${5:-170}
shift $(( $# < 5 ? $# : 5 ))
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/ab_jax_cache
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1
for side in before after; do
    dir=$BEFORE; [[ $side == after ]] && dir=$AFTER
    echo "== $side ($dir) $DTYPES"
    t0=$SECONDS
    (cd "$dir" && PYTHONPATH=. timeout "$LIMIT" python3 benchmarks/bench_cascade.py --lean --skip-conformance \
        --no-results --dtypes "$DTYPES" "$@") 2>&1 | tee "$OUT/ab_${side}_${DTYPES/,/_}.log"
    echo "== $side: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
done
