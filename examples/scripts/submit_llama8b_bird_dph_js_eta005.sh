#!/usr/bin/env bash
# dph_js (eta from the config name: configs/openrlhf/llama8b_bird_dph_js_eta005.yaml) on Llama-3.1-8B-Instruct / BIRD (text-to-SQL)
# Submits pre-sampling (when the config has one) and training as one job to a
# running Ray cluster: RAY_ADDRESS=http://HEAD:8265 (ray job submit --runtime-env-json).
# Extra arguments go to the driver, e.g. --dry-run or --div.anchor_eta 0.1.
set -euo pipefail
# shellcheck source=examples/scripts/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
submit_job configs/openrlhf/llama8b_bird_dph_js_eta005.yaml "$@"
