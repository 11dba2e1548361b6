#!/usr/bin/env bash
# Methods x seeds on one experiment family, on any engine, then one comparison report.
#
#   bash examples/scripts/sweep_methods.sh FAMILY [--engine local|openrlhf|megatron]
#        [--methods "grpo dapo dph_f dph_js"] [--seeds "1 2 3"] [--out DIR] [--sampler auto|hf|vllm]
#        [--submit] [section.key=value ...] [-- OpenRLHF flags]
#
# FAMILY is the experiment prefix (tiny_cpu, llama8b_bird, qwen25math7b_dapo17k, ...): the run of
# METHOD is the experiment FAMILY_METHOD, started as `openrlhf-div run FAMILY_METHOD --engine ENGINE`
# with the seed (SEED and the override seed=SEED) in OUT/runs/METHOD/seedSEED; OUT defaults to
# runs/sweep_FAMILY (runs/sweep_FAMILY_local, _megatron for those engines). Each run evaluates its
# policy before the first step and after the last; the base model's evaluation (role base) is the
# first run's step-0 one, in OUT/runs/base; `openrlhf-div compare` writes OUT/report.
# Killed and started again with the same arguments, a sweep continues: finished runs are kept, an
# interrupted one resumes from its latest checkpoint. One line per run: its place, runs done, the
# overall ETA. On a CPU one line says how the sampler fits (--sampler hf: the local engine's
# in-process sampler). DRY_RUN=1 (or --dry-run) prints every command. Details:
# python -m openrlhf_div.engines.sweep --help, docs/configs.md "Sweeps".
set -euo pipefail
# shellcheck source=examples/scripts/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

usage() { sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

FAMILY="${1:-}"
if [[ -z "$FAMILY" || "$FAMILY" == -* ]]; then
  usage
  [[ "$FAMILY" == "-h" || "$FAMILY" == "--help" ]] && exit 0
  exit 2
fi
cd "$REPO_ROOT"
exec "$PYTHON" -m openrlhf_div.engines.sweep "$@"
