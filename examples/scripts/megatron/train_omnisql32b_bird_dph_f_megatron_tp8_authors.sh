#!/usr/bin/env bash
# dph_f on OmniSQL-32B / BIRD with the Megatron-core policy actor on one 8x80GB node (TP 8, host Adam, vLLM 2 x TP 4 colocated). (the authors' code: configs/megatron/omnisql32b_bird_dph_f_megatron_tp8_authors.yaml)
# Starts a local Ray head (unless one runs), pre-samples D_pef/D_exp when the config has a
# presample stage (resumable), then trains. Extra arguments go to the driver, e.g. --dry-run.
# Needs the GPU image (megatron-core; docs/scaling_megatron.md).
set -euo pipefail
# shellcheck source=examples/scripts/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../_common.sh"
run_local configs/megatron/omnisql32b_bird_dph_f_megatron_tp8_authors.yaml "$@"
