#!/usr/bin/env bash
# dph_js on OmniSQL-32B / BIRD with the Megatron-core policy actor on two 8x80GB nodes (TP 8 x DP 2, distributed optimizer, vLLM 4 x TP 4 colocated). (the authors' code: configs/megatron/omnisql32b_bird_dph_js_megatron_2node_authors.yaml)
# Submits pre-sampling (when the config has one) and training as one job to a running Ray
# cluster: RAY_ADDRESS=http://HEAD:8265 (ray job submit --runtime-env-json).
# Extra arguments go to the driver, e.g. --dry-run or --megatron.recompute selective.
set -euo pipefail
# shellcheck source=examples/scripts/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../_common.sh"
submit_job configs/megatron/omnisql32b_bird_dph_js_megatron_2node_authors.yaml "$@"
