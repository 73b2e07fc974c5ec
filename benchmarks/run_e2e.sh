#!/usr/bin/env bash
# The end-to-end tables on the device machine, each step under its own time limit so that one
# slow step leaves the others' results (every step tees its log and JSON into OUT).
#
#   bash benchmarks/run_e2e.sh llama8b OUT [BATCHES] [ARGS]   # (c): needs no model file; ARGS e.g.
#                                                              # --separate --profile --nodes 1
#   bash benchmarks/run_e2e.sh serve GGUF HEAD OUT [BATCHES] [TEMPS] [SHAPES] [PROMPTS] [TOKENS]
#                                                              # HF equality + peer, then (a)
#   bash benchmarks/run_e2e.sh peer GGUF OUT [BATCHES] [TOKENS]  # transformers' generate tok/s alone
#   bash benchmarks/run_e2e.sh heads GGUF HEAD_A HEAD_B OUT [SHAPES] [PROMPTS] [TOKENS]
#                                                              # acceptance of two heads, b1 greedy
#   bash benchmarks/run_e2e.sh breakdown GGUF HEAD OUT [BATCH]  # (b)
#   bash benchmarks/run_e2e.sh kernels HEAD OUT [BATCH] [SHAPES] [TEMPS]  # a step's kernels; random weights
#   bash benchmarks/run_e2e.sh kernels-graphs HEAD OUT [BATCH] [SHAPES] [TEMPS]  # the same at each CUDA-graph setting
#   bash benchmarks/run_e2e.sh prefill OUT [BATCHES]            # (d): needs no model file
#   bash benchmarks/run_e2e.sh compile HEAD OUT [SETTINGS] [ARGS]  # a new engine's compile, program by
#                                                              # program; SETTINGS "shape:batch:workers,...";
#                                                              # random weights; ARGS e.g. --inline-layers
#
# SHAPES: comma-separated names as bench_e2e.shape_spec reads them: plain, chain-sS, tree-kKsSnN, each
# optionally ending -chainB (e.g. tree-k4s6n24 or tree-k8s6n64-chain16).
# XLA_SETS (llama8b) runs one process per ";"-separated set of XLA_FLAGS ("default": none), e.g. whether
# cuBLAS GEMVs without XLA's split-K reductions beat them at B=1.
# GRAPHS (default auto) is the decode step's CUDA-graph settings to compare, e.g. GRAPHS=auto,xla
# (`backends.cuda_graphs`; serve and kernels; llama8b takes `--cuda-graphs` among its ARGS).
# Only 8 files come back from the device's OUT, so when OUT holds more they are packed into
# OUT/e2e.tar.gz at the end (`tar xzf` it here).
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
case "${1:-}" in serve | peer | heads | breakdown) need_gguf "$PY" "$ROOT" || exit 1 ;; esac

step() {  # step NAME SECONDS CMD...: runs CMD under a limit, tees its output to OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s): $*"
    mkdir -p "$OUT"  # OUT may name a folder not made yet (e.g. $OUT/l8 on the device)
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}

case "${1:-}" in
llama8b)
    OUT=$2
    if [[ -z "${XLA_SETS:-}" ]]; then
        step llama8b "${LIMIT:-420}" "$PY" benchmarks/bench_e2e.py llama8b --batches "${3:-1,8,32,64}" --out "$OUT" \
            "${@:4}"
    else
        # XLA_SETS="default;--xla_gpu_enable_triton_gemm=false": one process per set of XLA flags
        # (read once, when XLA starts), one after the other on the same machine, "default" = none.
        IFS=';' read -ra sets <<< "$XLA_SETS"
        for i in "${!sets[@]}"; do
            flags=${sets[$i]}; [[ $flags == default ]] && flags=
            mkdir -p "$OUT/xla$i"
            echo "== XLA_FLAGS set $i: ${flags:-none}" | tee "$OUT/xla$i/flags.txt"
            XLA_FLAGS="$flags" step "llama8b_xla$i" "${LIMIT:-420}" "$PY" benchmarks/bench_e2e.py llama8b \
                --batches "${3:-1,8,32,64}" --out "$OUT/xla$i" "${@:4}"
        done
    fi
    ;;
serve)
    GGUF=$2 HEAD=$3 OUT=$4
    # HF_LIMIT=0 skips the transformers comparison (recorded in RESULTS.md; it costs minutes).
    [[ "${HF_LIMIT:-200}" == 0 ]] || step hf_compare "${HF_LIMIT:-200}" "$PY" benchmarks/hf_compare.py --gguf "$GGUF" \
        --new-tokens 32 --out "$OUT"
    # One process per batch under its own limit (LIMIT s each): a slow compile at one batch cannot
    # cost the others' rows. 128 new tokens, as `heads` and bench_e2e's own default, so the table's
    # accept lengths compare with the head's measurement; the engines' compiles, not their decode
    # windows, take most of a row's time.
    IFS=, read -ra batches <<< "${5:-1}"
    for b in "${batches[@]}"; do
        mkdir -p "$OUT/b$b"
        step "serve_b$b" "${LIMIT:-380}" "$PY" benchmarks/bench_e2e.py serve --gguf "$GGUF" --head "$HEAD" \
            --batches "$b" --temperatures "${6:-0}" --shapes "${7:-plain,chain-s5,tree-k4s5n16,tree-k8s6n64}" \
            --prompts "${8:-64}" --new-tokens "${9:-128}" --cuda-graphs "${GRAPHS:-auto}" --out "$OUT/b$b"
    done
    ;;
peer)
    # The serve table's peer at every batch it has (hf_compare measures b1 and b8 beside its equality check).
    GGUF=$2 OUT=$3
    step hf_peer "${LIMIT:-240}" "$PY" benchmarks/hf_compare.py --gguf "$GGUF" --peer-only \
        --peer-batches "${4:-1,8,32,64}" --new-tokens "${5:-128}" --out "$OUT"
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
kernels | kernels-graphs)
    HEAD=$2 OUT=$3
    # kernels-graphs: every CUDA-graph setting in one process (they are per program, not per
    # process): how much of a launch-bound step's time goes to launches.
    graphs=${GRAPHS:-auto}; [[ $1 == kernels-graphs ]] && graphs=${GRAPHS:-xla,all,off}
    step "$1" "${LIMIT:-240}" "$PY" benchmarks/bench_e2e.py kernels --head "$HEAD" --batch "${4:-1}" \
        --shapes "${5:-plain,tree-k4s5n16}" --temperatures "${6:-0}" --cuda-graphs "$graphs" --out "$OUT"
    ;;
breakdown)
    GGUF=$2 HEAD=$3 OUT=$4
    step breakdown "${LIMIT:-240}" "$PY" benchmarks/bench_e2e.py breakdown --gguf "$GGUF" --head "$HEAD" \
        --batch "${5:-1}" --out "$OUT"
    ;;
compile)
    HEAD=$2 OUT=$3
    # One process per setting, without the persistent cache: XLA keeps autotuning results for the
    # life of a process, and a cache hit is not a compile (tools/compile_profile.py).
    # XLA_SETS as for llama8b, e.g. "default;--xla_gpu_autotune_level=0": how much is autotuning.
    IFS=, read -ra settings <<< "${4:-plain:8:1,tree-k4s5n16:8:1,tree-k4s5n16:8:8}"
    IFS=';' read -ra sets <<< "${XLA_SETS:-default}"
    for i in "${!sets[@]}"; do
        flags=${sets[$i]}; [[ $flags == default ]] && flags=
        for setting in "${settings[@]}"; do
            IFS=: read -r shape batch workers <<< "$setting"
            XLA_FLAGS="$flags" step "compile_${shape}_b${batch}_w${workers}_xla$i" "${LIMIT:-240}" env -u \
                JAX_COMPILATION_CACHE_DIR "$PY" benchmarks/tools/compile_profile.py --head "$HEAD" --shape "$shape" \
                --batch "$batch" --workers "$workers" --out "$OUT" "${@:5}"
        done
    done
    ;;
prefill)
    OUT=$2
    step prefill "${LIMIT:-240}" "$PY" benchmarks/bench_e2e.py prefill --batches "${3:-1,8,32}" --out "$OUT"
    ;;
*)
    sed -n '2,20p' "${BASH_SOURCE[0]}" >&2
    exit 2
    ;;
esac
if [[ -n "${OUT:-}" && -d "$OUT" ]] && (($(find "$OUT" -type f | wc -l) > 8)); then
    tar czf /tmp/e2e.tar.gz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/e2e.tar.gz "$OUT/e2e.tar.gz"
    echo "== $(tar tzf "$OUT/e2e.tar.gz" | grep -c '[^/]$') files packed into $OUT/e2e.tar.gz"
fi
