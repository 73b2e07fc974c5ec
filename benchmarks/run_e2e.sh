#!/usr/bin/env bash
# The end-to-end tables on the device machine, each step under its own time limit so that one
# slow step leaves the others' results (every step tees its log and JSON into OUT).
#
#   bash benchmarks/run_e2e.sh llama8b OUT [BATCHES] [ARGS]   # (c): needs no model file; ARGS e.g.
#                                                              # --separate --profile --nodes 1
#   bash benchmarks/run_e2e.sh serve GGUF HEAD OUT [BATCHES] [TEMPS] [SHAPES] [PROMPTS] [TOKENS]
#                                                              # HF equality + peer, then (a)
#   bash benchmarks/run_e2e.sh heads GGUF HEAD_A HEAD_B OUT [SHAPES] [PROMPTS] [TOKENS]
#                                                              # acceptance of two heads, b1 greedy
#   bash benchmarks/run_e2e.sh breakdown GGUF HEAD OUT [BATCH]  # (b)
#   bash benchmarks/run_e2e.sh kernels HEAD OUT [BATCH] [SHAPES] [TEMPS]  # a step's kernels; random weights
#   bash benchmarks/run_e2e.sh kernels-flags HEAD OUT [BATCH] [SHAPES] [TEMPS]  # the same, CUDA graphs on/off/min 1
#   bash benchmarks/run_e2e.sh prefill OUT [BATCHES]            # (d): needs no model file
#
# GGUF comes from `benchmarks/stage_gguf.sh join /root/gguf`; the gguf package from a carried
# .whl (need_gguf.sh installs it into /tmp/site when the machine lacks it). Steps log with
# PYTHONUNBUFFERED so that a step killed at its limit still leaves what it printed.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Compiled programs persist on the machine: the engines of one table share their prefill
# programs (a setting differs from the last in its step only), and a later call reuses them all.
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/treespec_jax_cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1
PY="${PYTHON:-python3}"
# shellcheck source=need_gguf.sh
source "$ROOT/benchmarks/need_gguf.sh"
case "${1:-}" in serve | heads | breakdown) need_gguf "$PY" "$ROOT" || exit 1 ;; esac

step() {  # step NAME SECONDS CMD...: runs CMD under a limit, tees its output to OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}

case "${1:-}" in
llama8b)
    OUT=$2
    step llama8b "${LIMIT:-420}" "$PY" benchmarks/bench_e2e.py llama8b --batches "${3:-1,8,32,64}" --out "$OUT" "${@:4}"
    ;;
serve)
    GGUF=$2 HEAD=$3 OUT=$4
    # HF_LIMIT=0 skips the transformers comparison (recorded in RESULTS.md; it costs minutes).
    [[ "${HF_LIMIT:-200}" == 0 ]] || step hf_compare "${HF_LIMIT:-200}" "$PY" benchmarks/hf_compare.py --gguf "$GGUF" \
        --new-tokens 32 --out "$OUT"
    # One process per batch under its own limit (LIMIT s each): a slow compile at one batch cannot
    # cost the others' rows.
    IFS=, read -ra batches <<< "${5:-1}"
    for b in "${batches[@]}"; do
        mkdir -p "$OUT/b$b"
        step "serve_b$b" "${LIMIT:-380}" "$PY" benchmarks/bench_e2e.py serve --gguf "$GGUF" --head "$HEAD" \
            --batches "$b" --temperatures "${6:-0}" --shapes "${7:-plain,chain-s5,tree-k4s5n16,tree-k8s6n64}" \
            --prompts "${8:-32}" --new-tokens "${9:-96}" --out "$OUT/b$b"
    done
    ;;
heads)
    # One process per head, same prompts and shapes: whether a newly trained head accepts more.
    GGUF=$2 OUT=$5
    for which in a b; do
        head=$3; [[ $which == b ]] && head=$4
        mkdir -p "$OUT/head_$which"
        step "head_$which" "${LIMIT:-150}" "$PY" benchmarks/bench_e2e.py serve --gguf "$GGUF" --head "$head" \
            --batches 1 --temperatures 0 --shapes "${6:-chain-s5,tree-k4s5n16}" --prompts "${7:-64}" \
            --new-tokens "${8:-128}" --out "$OUT/head_$which"
    done
    ;;
kernels | kernels-flags)
    HEAD=$2 OUT=$3
    kernels_step() {  # kernels_step NAME LIMIT DIR: the kernels table of HEAD into DIR
        step "$1" "$2" "$PY" benchmarks/bench_e2e.py kernels --head "$HEAD" --batch "${BATCH}" \
            --shapes "${SHAPES}" --temperatures "${TEMPS}" --out "$3"
    }
    BATCH=${4:-1} SHAPES=${5:-plain,tree-k4s5n16} TEMPS=${6:-0}
    if [[ $1 == kernels ]]; then
        kernels_step kernels "${LIMIT:-240}" "$OUT"
    else
        # The same table under XLA's CUDA-graph settings, one process each (XLA_FLAGS is read once
        # per process): whether launches are what a launch-bound step pays for.
        for variant in default graphs-off graphs-min1; do
            case $variant in
            default) flags="" ;;
            graphs-off) flags="--xla_gpu_enable_command_buffer=" ;;
            graphs-min1) flags="--xla_gpu_graph_min_graph_size=1" ;;
            esac
            mkdir -p "$OUT/$variant"
            XLA_FLAGS="$flags${XLA_FLAGS:+ $XLA_FLAGS}" kernels_step "kernels_$variant" "${LIMIT:-150}" "$OUT/$variant"
        done
    fi
    ;;
breakdown)
    GGUF=$2 HEAD=$3 OUT=$4
    step breakdown "${LIMIT:-240}" "$PY" benchmarks/bench_e2e.py breakdown --gguf "$GGUF" --head "$HEAD" \
        --batch "${5:-1}" --out "$OUT"
    ;;
prefill)
    OUT=$2
    step prefill "${LIMIT:-240}" "$PY" benchmarks/bench_e2e.py prefill --batches "${3:-1,8,32}" --out "$OUT"
    ;;
*)
    sed -n '2,16p' "${BASH_SOURCE[0]}" >&2
    exit 2
    ;;
esac
