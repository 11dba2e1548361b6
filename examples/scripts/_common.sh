#!/usr/bin/env bash
# Shared helpers of the openrlhf-div launchers. Sourced by run.sh (the one launcher of every
# experiment) and sweep_methods.sh; not meant to be run on its own.
#
# Environment (all optional):
#   PYTHON         python with openrlhf-div installed        (default: python3)
#   NUM_GPUS       GPUs the local Ray head offers            (default: all visible)
#   RAY_ADDRESS    dashboard address for `ray job submit`    (default: http://127.0.0.1:8265)
#   DATA_DIR, RUN_DIR, PRESAMPLE_DIR, SEED   expanded inside the configs (${VAR:-default})
#   DRY_RUN=1      print the commands instead of running them
#   RAY_ENTRYPOINT_RESOURCES   with --submit: Ray resources the job's driver needs, JSON (e.g.
#                  '{"nodeB": 1}' to run it on the node started with --resources '{"nodeB": 1}')
#   STAGES         with --submit: all (default) | presample | train -- which stages the job runs

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"

say() { printf '[openrlhf-div] %s\n' "$*" >&2; }

# Run a command, or print it when DRY_RUN=1.
run() {
  if [[ "${DRY_RUN:-0}" == "1" ]]; then
    printf '%q ' "$@"
    printf '\n'
  else
    "$@"
  fi
}

config_path() {
  local cfg="$1"
  [[ "$cfg" == /* ]] || cfg="${REPO_ROOT}/${cfg}"
  if [[ ! -f "$cfg" ]]; then
    say "config not found: $cfg"
    return 1
  fi
  printf '%s\n' "$cfg"
}

# The config of an experiment: its name (configs/openrlhf/NAME.yaml or configs/megatron/NAME.yaml)
# or a path. A family base (_*.yaml) or an unknown name is an error that lists the experiments.
experiment_config() {
  local name="$1" f
  if [[ "$name" == *.yaml || "$name" == */* ]]; then
    config_path "$name"
    return
  fi
  for f in "${REPO_ROOT}/configs/openrlhf/${name}.yaml" "${REPO_ROOT}/configs/megatron/${name}.yaml"; do
    if [[ -f "$f" && "$(basename "$f")" != _* ]]; then
      printf '%s\n' "$f"
      return 0
    fi
  done
  local have=()
  for f in "${REPO_ROOT}"/configs/openrlhf/[!_]*.yaml "${REPO_ROOT}"/configs/megatron/[!_]*.yaml; do
    have+=("$(basename "$f" .yaml)")
  done
  say "no experiment ${name} (configs/openrlhf/ and configs/megatron/ hold: ${have[*]})"
  return 1
}

# The --plugin MODULE / --plugin=MODULE arguments among the driver flags (for the pre-sampling stage).
plugin_args() {
  local out=() prev=""
  for a in "$@"; do
    if [[ "$prev" == "--plugin" ]]; then out+=(--plugin "$a"); fi
    if [[ "$a" == --plugin=* ]]; then out+=("$a"); fi
    prev="$a"
  done
  if [[ ${#out[@]} -gt 0 ]]; then printf '%s\n' "${out[@]}"; fi
}

# Start a local Ray head unless one is already running on this machine.
ensure_ray_head() {
  if [[ "${DRY_RUN:-0}" == "1" ]]; then
    echo "ray start --head (unless already running)"
    return 0
  fi
  if ray status >/dev/null 2>&1; then
    say "using the running Ray cluster"
  else
    local gpus=()
    if [[ -n "${NUM_GPUS:-}" ]]; then gpus=(--num-gpus "$NUM_GPUS"); fi
    ray start --head --node-ip-address 127.0.0.1 --include-dashboard=true "${gpus[@]}"
  fi
}

# True when the config (its extends chain resolved by openrlhf_div.config) has a presample stage;
# the loader exits 0 (yes) or 10 (no); anything else (an unreadable config, no PyYAML in $PYTHON)
# stops the launcher instead of silently skipping the stage.
has_presample() {
  local rc=0
  "$PYTHON" -m openrlhf_div.config --section presample "$1" || rc=$?
  case "$rc" in
    0) return 0 ;;
    10) return 1 ;;
    *) say "cannot read config $1 with $PYTHON (exit status $rc)"; exit 2 ;;
  esac
}

# True when the driver flags ask for a dry run: then nothing runs for real (no Ray head, no
# pre-sampling, no job), every stage only prints what it would do.
wants_dry_run() {
  local a
  for a in "$@"; do [[ "$a" == "--dry-run" ]] && return 0; done
  return 1
}

# The DPH pre-sampling stage, then training, on the current machine's Ray cluster.
# Usage: run_local CONFIG [driver flags...]
run_local() {
  local cfg
  cfg="$(config_path "$1")"
  shift
  cd "$REPO_ROOT" || return 1
  local pre=()
  if wants_dry_run "$@"; then
    pre=(--dry-run)
  else
    ensure_ray_head
  fi
  if has_presample "$cfg"; then
    say "pre-sampling D_pef / D_exp (resumable; instant when already done)"
    local plugins=()
    mapfile -t plugins < <(plugin_args "$@")
    run "$PYTHON" -m openrlhf_div.cli.presample_ray --config "$cfg" "${plugins[@]}" "${pre[@]}"
  fi
  run "$PYTHON" -m openrlhf_div.cli.train_ppo_ray --config "$cfg" "$@"
}

# JSON for --runtime-env-json: ship the repository (without data/, runs/, checkpoints, .venv) as
# the job's working directory, pass the config and task variables (OPENRLHF_DIV_*) to every
# worker; refuse relative output/input paths and an upload over Ray's limit before submitting.
runtime_env_json() {
  local check=()
  if [[ "${DRY_RUN:-0}" == "1" ]]; then check=(--warn-only); fi
  "$PYTHON" -m openrlhf_div.engines.openrlhf.jobs "${check[@]}" "$REPO_ROOT" "$1"
}

# Submit pre-sampling + training as one Ray job to a running cluster.
# Usage: submit_job CONFIG [driver flags...]
submit_job() {
  local cfg rel
  cfg="$(config_path "$1")"
  shift
  rel="${cfg#"${REPO_ROOT}"/}"
  local steps="true" dry="" stages="${STAGES:-all}"
  case "$stages" in
    all|presample|train) ;;
    *) say "STAGES=${stages}: expected all, presample or train"; return 2 ;;
  esac
  if wants_dry_run "$@"; then
    # dry all the way: print the job (nothing is submitted) whose stages are dry runs too
    dry=" --dry-run"
    local DRY_RUN=1
  fi
  if [[ "$stages" != "train" ]] && has_presample "$cfg"; then
    local plugins=() pl=""
    mapfile -t plugins < <(plugin_args "$@")
    if [[ ${#plugins[@]} -gt 0 ]]; then pl="$(printf ' %q' "${plugins[@]}")"; fi
    steps="python -m openrlhf_div.cli.presample_ray --config ${rel}${pl}${dry}"
  fi
  local extra=""
  if [[ $# -gt 0 ]]; then extra="$(printf ' %q' "$@")"; fi
  local train="python -m openrlhf_div.cli.train_ppo_ray --config ${rel}${extra}"
  if [[ "$stages" == "presample" ]]; then
    if [[ "$steps" == "true" ]]; then say "STAGES=presample: ${rel} has no presample section"; return 2; fi
    train="true"
  fi
  local entry=()
  if [[ -n "${RAY_ENTRYPOINT_RESOURCES:-}" ]]; then entry=(--entrypoint-resources "$RAY_ENTRYPOINT_RESOURCES"); fi
  local renv
  renv="$(runtime_env_json "$cfg")" || return 1
  # OpenRLHF's train() puts TOKENIZERS_PARALLELISM, NCCL_DEBUG and RAY_ENABLE_ZERO_COPY_TORCH_TENSORS
  # into its own ray.init runtime env; Ray refuses the same keys in the job's, so they reach
  # the driver as plain environment variables instead.
  local upstream_env=("TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-true}" "NCCL_DEBUG=${NCCL_DEBUG:-WARN}"
                      "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=${RAY_ENABLE_ZERO_COPY_TORCH_TENSORS:-1}")
  run ray job submit --address "${RAY_ADDRESS:-http://127.0.0.1:8265}" "${entry[@]}" \
    --runtime-env-json "$renv" \
    -- env "${upstream_env[@]}" bash -c "${steps} && ${train}"
}
