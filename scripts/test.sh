#!/usr/bin/env bash
# The README's test command: set up .venv if needed, then run the whole CPU test suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k lad -x`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest "$@"
