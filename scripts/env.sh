#!/usr/bin/env bash
# Finds a Python >= 3.12 (PATH, then pyenv), builds .venv once, and installs the package with
# the given extras. Sourced by ./treespec.sh and .ci/run; prints the venv's python on stdout.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
find_python() {
  local c
  for c in python3.12 python3.13 "$HOME/.pyenv/versions/3.12.1/bin/python3" \
           $(ls -d "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3 2>/dev/null); do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
      echo "$c"; return 0
    fi
  done
  echo "treespec: no Python >= 3.12 found (looked on PATH and in ~/.pyenv/versions)" >&2
  return 1
}
extras="${1:-test}"
stamp="$venv/.installed-$extras-$(sha1sum "$root/pyproject.toml" | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  py="$(find_python)"
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q -e "$root[$extras]" >&2
  touch "$stamp"
fi
echo "$venv/bin/python"
