#!/usr/bin/env bash
# grpo on the tiny CPU end-to-end experiment with the Megatron-core policy actor at TP=2.
# Starts a local Ray head (unless one runs), pre-samples D_pef/D_exp when the
# config has a presample stage (resumable), then trains.
# Extra arguments go to the driver, e.g. --dry-run or --ckpt.load_enable.
set -euo pipefail
# shellcheck source=examples/scripts/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
run_local configs/openrlhf/tiny_cpu_grpo_megatron.yaml "$@"
