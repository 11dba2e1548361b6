#!/usr/bin/env bash
# The README's main-job command: set up .venv if needed, then run the main job.
# Extra arguments go to the command.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
# UTF-8 text whatever the locale (as scripts/test.sh)
export PYTHONUTF8=1
exec "$ROOT/.venv/bin/openrlhf-div" demo "$@"
