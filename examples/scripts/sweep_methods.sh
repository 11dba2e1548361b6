#!/usr/bin/env bash
# Methods x seeds on one experiment family, then one comparison report.
#
#   bash examples/scripts/sweep_methods.sh FAMILY [--methods "grpo dapo dph_f dph_js"]
#        [--seeds "1 2 3"] [--out runs/sweep_FAMILY] [--submit]
#
# FAMILY is the config prefix, e.g. llama8b_bird, qwen25math7b_dapo17k, omnisql32b_bird: the
# run of METHOD uses configs/openrlhf/FAMILY_METHOD.yaml. For every (method, seed) the run
# directory is OUT/runs/METHOD/seedSEED (RUN_DIR and SEED are exported into the config); the
# trained model is evaluated with vLLM into its eval.json, the base model once into
# OUT/runs/base, and `openrlhf-div compare` writes the report (table + pass@k plots) to
# OUT/report, the same report the demo writes. --submit runs each training as a Ray job on
# RAY_ADDRESS instead of the local cluster. DRY_RUN=1 prints every command.
set -euo pipefail
# shellcheck source=examples/scripts/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

usage() { sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

FAMILY="${1:-}"
if [[ -z "$FAMILY" || "$FAMILY" == -* ]]; then usage; exit 2; fi
shift
METHODS="grpo dapo dph_f dph_js"
SEEDS="1 2 3"
OUT=""
SUBMIT=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --methods) METHODS="$2"; shift 2 ;;
    --seeds) SEEDS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --submit) SUBMIT=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) say "unknown argument: $1"; usage; exit 2 ;;
  esac
done
OUT="${OUT:-runs/sweep_${FAMILY}}"
cd "$REPO_ROOT"

configs=()
for m in $METHODS; do
  cfg="configs/openrlhf/${FAMILY}_${m}.yaml"
  if [[ ! -f "$cfg" ]]; then
    have=(configs/openrlhf/"${FAMILY}"_*.yaml)
    say "no config $cfg (family ${FAMILY} has: ${have[*]})"
    exit 2
  fi
  configs+=("$cfg")
done

evaluate() {  # evaluate CONFIG RUN_DIR NAME ROLE SEED [MODEL]
  local extra=()
  if [[ -n "${6:-}" ]]; then extra=(--model "$6"); fi
  if [[ "$4" == "method" && -f "${OUT}/runs/base/eval.json" ]]; then
    extra+=(--base-eval "${OUT}/runs/base/eval.json")
  fi
  run "$PYTHON" -m openrlhf_div.engines.openrlhf.evaluate --config "$1" --out "$2" --name "$3" \
    --role "$4" --seed "$5" "${extra[@]}"
}

say "base model evaluation -> ${OUT}/runs/base"
evaluate "${configs[0]}" "${OUT}/runs/base" base base 0

run_dirs=("${OUT}/runs/base")
i=0
for m in $METHODS; do
  cfg="${configs[$i]}"
  i=$((i + 1))
  for s in $SEEDS; do
    export RUN_DIR="${OUT}/runs/${m}/seed${s}" SEED="$s"
    say "training ${m} seed ${s} -> ${RUN_DIR}"
    if [[ "$SUBMIT" == "1" ]]; then
      submit_job "$cfg"
    else
      run_local "$cfg"
    fi
    evaluate "$cfg" "$RUN_DIR" "$m" method "$s" "${RUN_DIR}/model"
    run_dirs+=("$RUN_DIR")
  done
done

say "comparison report -> ${OUT}/report"
run "$PYTHON" -m openrlhf_div.cli.main compare "${run_dirs[@]}" --out "${OUT}/report"
