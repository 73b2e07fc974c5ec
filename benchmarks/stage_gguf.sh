#!/usr/bin/env bash
# Stages the default GGUF (SmolLM2-135M-Instruct Q4_1, 98 MB) onto the device machine.
#
# The device machine reaches no network, and one run carries at most 64 MiB, the work tree
# included (about 23 MB with the shipped EAGLE-3 head), so the file goes over in three parts of
# under 34 MB, in three runs sent one right after the other: the machine must still be warm for
# the next one, since DEST lies outside the work tree and dies with the machine.
#
#   benchmarks/stage_gguf.sh split              # here: cached GGUF -> .stage/gguf1 .. gguf3
#   run carry=[".stage/gguf1"]  command="bash benchmarks/stage_gguf.sh put /root/gguf && ..."
#   run carry=[".stage/gguf2"]  command="bash benchmarks/stage_gguf.sh put /root/gguf && ..."
#   run carry=[".stage/gguf3"]  command="G=\$(bash benchmarks/stage_gguf.sh join /root/gguf) && ..."
#
# `put` copies whichever parts the run carries into DEST. `join` does the same, joins the parts,
# checks the sha256 and prints the joined file's path; it succeeds at once when the file is
# already there and whole, so later runs on the same warm machine can call it again.
set -euo pipefail

NAME=SmolLM2-135M-Instruct.Q4_1.gguf
# The same digest as treespec_jax/models/default.py DEFAULT_SHA256.
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STAGE="$ROOT/.stage"
PARTS=3
PART_BYTES=33000000

usage() {
    echo "usage: $0 split | put DEST_DIR | join DEST_DIR" >&2
    exit 2
}

part() {  # part I: the path of part I in the work tree
    echo "$STAGE/gguf$1/$NAME.part$1"
}

whole() {  # whole FILE: true when FILE exists with the default model's digest
    [[ -f "$1" ]] && [[ "$(sha256sum "$1" | cut -d' ' -f1)" == "$SHA256" ]]
}

put() {  # put DEST: copies the carried parts into DEST; prints how many DEST holds
    mkdir -p "$1"
    local i
    for ((i = 1; i <= PARTS; i++)); do
        [[ -f "$(part "$i")" ]] && cp "$(part "$i")" "$1/$NAME.part$i"
    done
    ls "$1"/"$NAME".part* 2>/dev/null | wc -l
}

case "${1:-}" in
split)
    PY="${PYTHON:-$ROOT/.venv/bin/python}"
    # ensure_default_gguf verifies the cached copy (fetching it first if needed).
    SRC=$(cd "$ROOT" && "$PY" -c 'from treespec_jax.models.default import ensure_default_gguf; print(ensure_default_gguf())')
    rm -rf "$STAGE"/gguf*
    for ((i = 1; i <= PARTS; i++)); do
        mkdir -p "$STAGE/gguf$i"
        count=(); ((i < PARTS)) && count=(count="$PART_BYTES")  # the last part takes the rest
        dd if="$SRC" of="$(part "$i")" bs=1M iflag=skip_bytes,count_bytes skip="$(((i - 1) * PART_BYTES))" \
            "${count[@]}" status=none
    done
    if [[ "$(for ((i = 1; i <= PARTS; i++)); do cat "$(part "$i")"; done | sha256sum | cut -d' ' -f1)" != "$SHA256" ]]; then
        echo "stage_gguf: the parts do not join back into $NAME" >&2
        exit 1
    fi
    for ((i = 1; i <= PARTS; i++)); do echo "stage_gguf: $(part "$i") ($(stat -c %s "$(part "$i")") bytes)"; done
    ;;
put)
    DEST="${2:-}"; [[ -n "$DEST" ]] || usage
    n=$(put "$DEST")
    echo "stage_gguf: $n of $PARTS parts in $DEST"
    ;;
join)
    DEST="${2:-}"; [[ -n "$DEST" ]] || usage
    if whole "$DEST/$NAME"; then
        echo "$DEST/$NAME"
        exit 0
    fi
    n=$(put "$DEST")
    if ((n != PARTS)); then
        echo "stage_gguf: $DEST holds $n of $PARTS parts; 'put' the others first, on the same warm machine" >&2
        exit 1
    fi
    for ((i = 1; i <= PARTS; i++)); do cat "$DEST/$NAME.part$i"; done >"$DEST/$NAME.joining"
    if ! whole "$DEST/$NAME.joining"; then
        rm -f "$DEST/$NAME.joining"
        echo "stage_gguf: the joined file does not have sha256 $SHA256" >&2
        exit 1
    fi
    mv "$DEST/$NAME.joining" "$DEST/$NAME"
    rm -f "$DEST/$NAME".part*
    echo "$DEST/$NAME"
    ;;
*)
    usage
    ;;
esac
