#!/usr/bin/env bash
# grpo on a tiny Qwen2 built on the spot, single-digit sums (the CPU end-to-end test's family;
# the test itself runs grpo on the Megatron actor: *_tiny_cpu_grpo_megatron.sh).
# Starts a local Ray head (unless one runs), pre-samples D_pef/D_exp when the
# config has a presample stage (resumable), then trains.
# Extra arguments go to the driver, e.g. --dry-run or --ckpt.load_enable.
set -euo pipefail
# shellcheck source=examples/scripts/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
run_local configs/openrlhf/tiny_cpu_grpo.yaml "$@"
