#!/usr/bin/env bash
# dph_js_def (eta from the config name: configs/openrlhf/llama8b_bird_dph_js_def_eta02.yaml) on Llama-3.1-8B-Instruct / BIRD (text-to-SQL)
# Starts a local Ray head (unless one runs), pre-samples D_pef/D_exp when the
# config has a presample stage (resumable), then trains.
# Extra arguments go to the driver, e.g. --dry-run or --div.anchor_eta 0.1.
set -euo pipefail
# shellcheck source=examples/scripts/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
run_local configs/openrlhf/llama8b_bird_dph_js_def_eta02.yaml "$@"
