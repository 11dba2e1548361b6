#!/usr/bin/env bash
# The one launcher of every Ray experiment (configs/openrlhf/*.yaml, configs/megatron/*.yaml).
#
#   bash examples/scripts/run.sh EXPERIMENT [--submit] [driver flags...]
#
# EXPERIMENT is an experiment's file name without .yaml (llama8b_bird_dph_js,
# omnisql32b_bird_dph_js_megatron_tp8, tiny_cpu_grpo, ...) or the path of a config.
# Without --submit: the running Ray cluster (or a private one the driver starts for the run),
# the DPH pre-sampling stage when the config has one (resumable; instant when done), then
# training. With --submit: both stages as one `ray job submit` job to RAY_ADDRESS (default
# http://127.0.0.1:8265; with RAY_ADDRESS unset and nothing there, a head for the job is started
# here on free ports and stopped when it ends). Every run gets a new folder runs/EXPERIMENT/<timestamp> (RUN_DIR overrides it); the
# last line names it. Without a GPU the CPU path (tiny_cpu_*) runs as it is on a laptop.
# Driver flags go to training, e.g. --dry-run, --div.anchor_eta 0.1, --ckpt.load_enable; a
# --plugin MODULE (a module registering your own method) goes to the pre-sampling stage too.
# Environment (see _common.sh): DATA_DIR, RUN_DIR, PRESAMPLE_DIR, TINY_MODEL, SEED, PYTHON,
# NUM_GPUS, RAY_ADDRESS, DRY_RUN=1, OPENRLHF_DIV_KEEP_RAY_TMP=1. Every experiment's command: docs/configs.md.
# `openrlhf-div run EXPERIMENT --engine openrlhf|megatron` calls this script (the one Ray launcher;
# docs/configs.md "Launchers" says why not the reverse); section.key=value overrides
# (method.anchor_eta=0.3) among the driver flags reach both stages, merged by the one loader.
set -euo pipefail
# shellcheck source=examples/scripts/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

usage() { sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

EXPERIMENT="${1:-}"
if [[ -z "$EXPERIMENT" || "$EXPERIMENT" == -* ]]; then
  usage
  [[ "$EXPERIMENT" == "-h" || "$EXPERIMENT" == "--help" ]] && exit 0
  exit 2
fi
shift
SUBMIT=0
args=()
for a in "$@"; do
  if [[ "$a" == "--submit" ]]; then SUBMIT=1; else args+=("$a"); fi
done
cfg="$(experiment_config "$EXPERIMENT")" || exit 2
# section.key=value overrides checked (method registry, schema, the driver's flags) before anything
# starts: a typo is one line with "did you mean", as on the local engine (openrlhf_div/engines/overrides.py, openrlhf_div/engines/openrlhf/check_overrides.py)
"$PYTHON" -m openrlhf_div.engines.openrlhf.check_overrides "$cfg" ${args[@]+"${args[@]}"} || exit 2
if [[ "$SUBMIT" == "1" ]]; then
  submit_job "$cfg" "${args[@]}"
else
  run_local "$cfg" "${args[@]}"
fi
