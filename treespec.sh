#!/usr/bin/env bash
# One entry point for a fresh clone: sets up .venv (Python >= 3.12) on first use, then
#   ./treespec.sh test [pytest args]   runs the test suite
#   ./treespec.sh <treespec args>      runs the `treespec` command (e.g. `demo`, `check-config`)
set -euo pipefail
root="$(cd "$(dirname "$0")" && pwd)"
py="$("$root/scripts/env.sh" test)"
if [ "${1:-}" = "test" ]; then
  shift
  cd "$root"
  exec "$py" -m pytest -n 2 "$@"
fi
exec "$(dirname "$py")/treespec" "$@"
