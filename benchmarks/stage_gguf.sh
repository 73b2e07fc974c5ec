#!/usr/bin/env bash
# Stages the default GGUF (SmolLM2-135M-Instruct Q4_1, 98 MB) onto the device machine.
#
# The device machine reaches no network, and one run carries at most 64 MiB (the work tree
# included), so the file goes over in two parts, in two runs sent one right after the other (the
# machine must still be warm for the second: /root/gguf lies outside the work tree and dies with
# it). Part one is the larger (60 MB); part two (38 MB) leaves room for the EAGLE-3 head (20 MB)
# in the run that joins the file and then uses both.
#
#   benchmarks/stage_gguf.sh split                 # here: cached GGUF -> .stage/gguf1, .stage/gguf2
#   run carry=[".stage/gguf1"]  command="bash benchmarks/stage_gguf.sh part1 /root/gguf"
#   run carry=[".stage/gguf2"]  command="bash benchmarks/stage_gguf.sh join /root/gguf && ..."
#
# `join` checks the sha256 and prints the joined file's path; it succeeds at once when the
# file is already there and whole, so later runs on the same warm machine can call it again.
set -euo pipefail

NAME=SmolLM2-135M-Instruct.Q4_1.gguf
# The same digest as treespec_jax/models/default.py DEFAULT_SHA256.
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STAGE="$ROOT/.stage"
PART1="$STAGE/gguf1/$NAME.part1"
PART2="$STAGE/gguf2/$NAME.part2"
PART1_BYTES=60000000
MAX_PART=61000000  # bytes; each part stays under it (with a 3 MB work tree, under 64 MiB a run)

usage() {
    echo "usage: $0 split | part1 DEST_DIR | join DEST_DIR" >&2
    exit 2
}

whole() {  # whole FILE: true when FILE exists with the default model's digest
    [[ -f "$1" ]] && [[ "$(sha256sum "$1" | cut -d' ' -f1)" == "$SHA256" ]]
}

case "${1:-}" in
split)
    PY="${PYTHON:-$ROOT/.venv/bin/python}"
    # ensure_default_gguf verifies the cached copy (fetching it first if needed).
    SRC=$(cd "$ROOT" && "$PY" -c 'from treespec_jax.models.default import ensure_default_gguf; print(ensure_default_gguf())')
    mkdir -p "$STAGE/gguf1" "$STAGE/gguf2"
    head -c "$PART1_BYTES" "$SRC" >"$PART1"
    tail -c +"$((PART1_BYTES + 1))" "$SRC" >"$PART2"
    for p in "$PART1" "$PART2"; do
        n=$(stat -c %s "$p")
        if (( n >= MAX_PART )); then
            echo "stage_gguf: $p is $n bytes, not under $MAX_PART" >&2
            exit 1
        fi
    done
    if [[ "$(cat "$PART1" "$PART2" | sha256sum | cut -d' ' -f1)" != "$SHA256" ]]; then
        echo "stage_gguf: the two parts do not join back into $NAME" >&2
        exit 1
    fi
    echo "stage_gguf: $PART1 ($(stat -c %s "$PART1") bytes) and $PART2 ($(stat -c %s "$PART2") bytes)"
    ;;
part1)
    DEST="${2:-}"; [[ -n "$DEST" ]] || usage
    [[ -f "$PART1" ]] || { echo "stage_gguf: $PART1 is not here; carry .stage/gguf1 (after 'split')" >&2; exit 1; }
    mkdir -p "$DEST"
    cp "$PART1" "$DEST/$NAME.part1"
    echo "stage_gguf: part 1 in $DEST ($(stat -c %s "$DEST/$NAME.part1") bytes); now send 'join $DEST' carrying .stage/gguf2"
    ;;
join)
    DEST="${2:-}"; [[ -n "$DEST" ]] || usage
    if whole "$DEST/$NAME"; then
        echo "$DEST/$NAME"
        exit 0
    fi
    [[ -f "$DEST/$NAME.part1" ]] || { echo "stage_gguf: $DEST/$NAME.part1 is missing (run 'part1 $DEST' first, on the same warm machine)" >&2; exit 1; }
    [[ -f "$PART2" ]] || { echo "stage_gguf: $PART2 is not here; carry .stage/gguf2" >&2; exit 1; }
    cat "$DEST/$NAME.part1" "$PART2" >"$DEST/$NAME.joining"
    if ! whole "$DEST/$NAME.joining"; then
        rm -f "$DEST/$NAME.joining"
        echo "stage_gguf: the joined file does not have sha256 $SHA256" >&2
        exit 1
    fi
    mv "$DEST/$NAME.joining" "$DEST/$NAME"
    rm -f "$DEST/$NAME.part1"
    echo "$DEST/$NAME"
    ;;
*)
    usage
    ;;
esac
