#!/usr/bin/env bash
# dph_js on Qwen2.5-Math-7B / DAPO-17k (math)
# Starts a local Ray head (unless one runs), pre-samples D_pef/D_exp when the
# config has a presample stage (resumable), then trains.
# Extra arguments go to the driver, e.g. --dry-run or --div.anchor_eta 0.1.
set -euo pipefail
# shellcheck source=examples/scripts/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
run_local configs/openrlhf/qwen25math7b_dapo17k_dph_js.yaml "$@"
