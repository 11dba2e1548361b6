#!/usr/bin/env bash
# dph_f on OmniSQL-32B / BIRD with the Megatron-core policy actor on one 8x80GB node (TP 8, host Adam, vLLM 2 x TP 4 colocated). (the authors' code: configs/megatron/omnisql32b_bird_dph_f_megatron_tp8_authors.yaml)
# Submits pre-sampling (when the config has one) and training as one job to a running Ray
# cluster: RAY_ADDRESS=http://HEAD:8265 (ray job submit --runtime-env-json).
# Extra arguments go to the driver, e.g. --dry-run or --megatron.recompute selective.
set -euo pipefail
# shellcheck source=examples/scripts/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../_common.sh"
submit_job configs/megatron/omnisql32b_bird_dph_f_megatron_tp8_authors.yaml "$@"
