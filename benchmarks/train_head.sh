#!/usr/bin/env bash
# Driver of the EAGLE-3 head recipe on the device machine, in calls of at most 10 minutes.
#
#   benchmarks/train_head.sh data   ROOT [MINUTES]        # self-distillation shards -> ROOT/data (resumable)
#   benchmarks/train_head.sh train  ROOT [MINUTES] [ARGS]  # train -> ROOT/run, resumes from its newest checkpoint
#   benchmarks/train_head.sh first  ROOT [DATA_MIN] [TOTAL_MIN] [--set K=V ...] [--export]  # data, then train, in one call
#   benchmarks/train_head.sh export ROOT                   # ROOT/run/head (bf16 HF layout), loss.png, metrics.json
#   benchmarks/train_head.sh pack   ROOT DEST [data]       # head + logs (+ the shards) as <= 15 MiB parts in DEST ($OUT)
#   benchmarks/train_head.sh unpack DIR DEST               # here: join DIR's parts and extract into DEST
#
# ROOT must outlive the calls of one warm machine (e.g. /root/eagle3); $OUT is emptied before each
# call and only 8 files of <= 16 MiB come back from it, so `pack` splits what must come back.
# The target is the default GGUF, found under $TREESPEC_CACHE (default /root/gguf, where
# stage_gguf.sh's `join /root/gguf` puts it). The gguf package is installed from a carried
# .whl/gguf-*.whl when the machine lacks it (only the target loading imports it).
# Extra arguments after MINUTES go to the Python command (e.g. --set train.steps=3000; a new run that
# goes on from the shipped head: --set head.init_from=treespec_jax/data/smollm2-eagle3); `first`
# passes them to both steps, which read the same config.
set -euo pipefail

ROOT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT_DIR"
# The checkout's virtual environment where there is one (here); the device machine has none and
# its python3 holds jax with CUDA.
PY="${PYTHON:-python3}"
if [[ -z "${PYTHON:-}" && -x "$ROOT_DIR/.venv/bin/python" ]]; then PY="$ROOT_DIR/.venv/bin/python"; fi
export TREESPEC_CACHE="${TREESPEC_CACHE:-/root/gguf}"
export PYTHONUNBUFFERED=1

usage() {
    sed -n '2,9p' "${BASH_SOURCE[0]}" >&2
    exit 2
}

# shellcheck source=need_gguf.sh
source "$ROOT_DIR/benchmarks/need_gguf.sh"

jax_cache() {
    # Compiled programs persist across the runs of one machine: a resumed run skips the compile.
    export JAX_COMPILATION_CACHE_DIR="$1/jax_cache"
    export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
    export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1
}

cmd="${1:-}"; shift || true
case "$cmd" in
data)
    ROOT="${1:?ROOT}"; MIN="${2:-4}"; shift 2 || shift $#
    need_gguf "$PY" "$ROOT_DIR" || exit 1; jax_cache "$ROOT"
    "$PY" -m treespec_jax.train.data --out "$ROOT/data" --max-minutes "$MIN" "$@"
    ;;
train)
    ROOT="${1:?ROOT}"; MIN="${2:-9}"; shift 2 || shift $#
    need_gguf "$PY" "$ROOT_DIR" || exit 1; jax_cache "$ROOT"
    "$PY" -m treespec_jax.train.eagle3 train --data "$ROOT/data" --run "$ROOT/run" --max-minutes "$MIN" "$@"
    ;;
first)
    ROOT="${1:?ROOT}"; DMIN="${2:-4}"; TOTAL="${3:-9.3}"; shift 3 || shift $#
    need_gguf "$PY" "$ROOT_DIR" || exit 1; jax_cache "$ROOT"
    t0=$(date +%s)
    # --export is the training step's alone; every other argument goes to both steps.
    data_args=()
    for a in "$@"; do [[ "$a" == --export ]] || data_args+=("$a"); done
    "$PY" -m treespec_jax.train.data --out "$ROOT/data" --max-minutes "$DMIN" "${data_args[@]}"
    left=$("$PY" -c "import time; print(max(0.5, $TOTAL - (time.time() - $t0) / 60))")
    "$PY" -m treespec_jax.train.eagle3 train --data "$ROOT/data" --run "$ROOT/run" --max-minutes "$left" "$@"
    ;;
export)
    ROOT="${1:?ROOT}"; shift || true
    need_gguf "$PY" "$ROOT_DIR" || exit 1; jax_cache "$ROOT"
    "$PY" -m treespec_jax.train.eagle3 export --run "$ROOT/run" --data "$ROOT/data" "$@"
    ;;
pack)
    ROOT="${1:?ROOT}"; DEST="${2:?DEST}"; WITH_DATA="${3:-}"
    mkdir -p "$DEST"
    items=()
    [[ -d "$ROOT/run/head" ]] && items+=("run/head")
    for f in config.json vocab.npz loss.csv eval.csv metrics.json train.log loss.png; do
        [[ -f "$ROOT/run/$f" ]] && items+=("run/$f")
    done
    [[ -f "$ROOT/data/summary.json" ]] && items+=("data/summary.json")
    [[ -f "$ROOT/run/loss.png" ]] && cp "$ROOT/run/loss.png" "$DEST/loss.png"
    [[ -f "$ROOT/run/metrics.json" ]] && cp "$ROOT/run/metrics.json" "$DEST/metrics.json"
    # The shards come only when asked, and only while everything stays within 4 parts (8 files and
    # 64 MiB come back; the two copies above and the caller's own files take the rest).
    shards=""
    [[ "$WITH_DATA" == data ]] && shards=$(cd "$ROOT" && ls data/shard_*.npz 2>/dev/null | grep -v '\.tmp\.' || true)
    size_items=$(cd "$ROOT" && du -cb "${items[@]}" 2>/dev/null | tail -1 | cut -f1)
    size_data=0
    [[ -n "$shards" ]] && size_data=$(cd "$ROOT" && du -cb $shards | tail -1 | cut -f1)
    if [[ -n "$shards" ]] && (( size_items + size_data < 4 * 15 * 1048576 )); then
        items+=($shards)
    elif [[ -n "$shards" ]]; then
        echo "train_head: data shards ($size_data bytes) left out of the pack (too large)" >&2
    fi
    (cd "$ROOT" && tar cf - "${items[@]}") | split -b 15M -d -a 1 - "$DEST/pack.tar.part"
    ls -l "$DEST"
    ;;
unpack)
    DIR="${1:?DIR}"; DEST="${2:?DEST}"
    mkdir -p "$DEST"
    cat "$DIR"/pack.tar.part* | tar xf - -C "$DEST"
    echo "train_head: unpacked into $DEST"
    ;;
*)
    usage
    ;;
esac
