#!/usr/bin/env bash
# dapo on OmniSQL-32B / BIRD (text-to-SQL)
# Starts a local Ray head (unless one runs), pre-samples D_pef/D_exp when the
# config has a presample stage (resumable), then trains.
# Extra arguments go to the driver, e.g. --dry-run or --div.anchor_eta 0.1.
set -euo pipefail
# shellcheck source=examples/scripts/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
run_local configs/openrlhf/omnisql32b_bird_dapo.yaml "$@"
