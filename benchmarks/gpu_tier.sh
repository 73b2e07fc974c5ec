#!/usr/bin/env bash
# The compiled conformance tier (pytest `gpu` marker) on the device machine, in parallel workers,
# each test's outcome printed as it finishes so that a run cut at its limit still names every
# failure it reached (the project's addopts hold -q, which would cancel -v: they are cleared).
#
#   bash benchmarks/gpu_tier.sh OUT [LIMIT_S] [WORKERS] [PYTEST_ARGS...]
#
# OUT gets gpu_tier.log (every outcome line), gpu_tier.xml (JUnit, written at the end) and
# gpu_tier_failed.txt (the failed test ids). Extra arguments narrow the run (files, -k, a marker
# expression replacing the default "gpu", every compiled case with the sweeps, with -m ...; -m
# "gpu and not sweep" is the quick half). The 354 cases took 545 s at 8 workers on one H200
# (2026-12-05), mostly compiling, with other work on the GPU; more workers than 8 ran slower.
# The tests that load GGUF files need the gguf package: a carried .whl/gguf-*.whl is installed
# into /tmp/site when the machine lacks it.
set -uo pipefail
OUT=${1:?OUT}; LIMIT=${2:-600}; WORKERS=${3:-8}; shift $(( $# < 3 ? $# : 3 ))
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
marker=(-m gpu)
for a in "$@"; do [[ $a == -m ]] && marker=(); done
PY="${PYTHON:-python3}"
# shellcheck source=need_gguf.sh
source "$ROOT/benchmarks/need_gguf.sh"
need_gguf "$PY" "$ROOT" || echo "gpu_tier: the GGUF tests will not import" >&2
# Several workers share the GPU: none may take most of its memory up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
parallel=(); (( WORKERS > 0 )) && parallel=(-n "$WORKERS")
timeout "$LIMIT" "$PY" -m pytest -o addopts="" "${marker[@]}" "${parallel[@]}" -p no:cacheprovider -v -rfE \
    --tb=short --junitxml "$OUT/gpu_tier.xml" "$@" 2>&1 | tee "$OUT/gpu_tier.log" | grep -E "FAILED|ERROR|passed|failed"
rc=${PIPESTATUS[0]}
grep -oE "tests/[^ ]+ (FAILED|ERROR)|(FAILED|ERROR) tests/[^ ]+" "$OUT/gpu_tier.log" \
    | grep -oE "tests/[^ ]+" | sort -u > "$OUT/gpu_tier_failed.txt"
echo "gpu_tier: exit $rc, $(grep -cE " PASSED" "$OUT/gpu_tier.log") passed, $(wc -l < "$OUT/gpu_tier_failed.txt") failed (ids in gpu_tier_failed.txt)"
exit "$rc"
