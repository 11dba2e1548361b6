#!/usr/bin/env bash
# DS-GRPO on Qwen/Qwen2.5-Math-1.5B (math)
# Submits pre-sampling (when the config has one) and training as one job to a
# running Ray cluster: RAY_ADDRESS=http://HEAD:8265 (ray job submit --runtime-env-json).
# Extra arguments go to the driver, e.g. --dry-run or --div.anchor_eta 0.1.
set -euo pipefail
# shellcheck source=examples/scripts/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
submit_job configs/openrlhf/qwen25math15b_ds_grpo.yaml "$@"
