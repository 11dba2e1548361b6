#!/usr/bin/env bash
# grpo on a tiny Qwen2 built on the spot, single-digit sums (the CPU end-to-end test's family;
# the test itself runs grpo on the Megatron actor: *_tiny_cpu_grpo_megatron.sh).
# Submits pre-sampling (when the config has one) and training as one job to a
# running Ray cluster: RAY_ADDRESS=http://HEAD:8265 (ray job submit --runtime-env-json).
# Needs TINY_MODEL, DATA_DIR and RUN_DIR as absolute paths (tests/e2e/ray_harness.py builds them).
# Extra arguments go to the driver, e.g. --dry-run or --ckpt.load_enable.
set -euo pipefail
# shellcheck source=examples/scripts/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
submit_job configs/openrlhf/tiny_cpu_grpo.yaml "$@"
