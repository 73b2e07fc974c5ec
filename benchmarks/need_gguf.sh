# Sourced by the device scripts: `need_gguf PY ROOT` makes the gguf package importable for PY. The
# device machine has none and reaches no network, so a carried ROOT/.whl/gguf-*.whl is installed
# into /tmp/site and put on PYTHONPATH; fails naming what is missing when there is no wheel.
need_gguf() {
    local py=$1 root=$2 whl
    "$py" -c 'import gguf' 2>/dev/null && return 0
    whl=$(ls "$root"/.whl/gguf-*.whl 2>/dev/null | head -1 || true)
    [[ -n "$whl" ]] || { echo "no gguf package and no .whl/gguf-*.whl carried" >&2; return 1; }
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$whl" || return 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
}
