#!/usr/bin/env bash
# Shared helpers of the openrlhf-div launchers. Sourced by train_*.sh, submit_*.sh and
# sweep_methods.sh; not meant to be run on its own.
#
# Environment (all optional):
#   PYTHON         python with openrlhf-div installed        (default: python3)
#   NUM_GPUS       GPUs the local Ray head offers            (default: all visible)
#   RAY_ADDRESS    dashboard address for `ray job submit`    (default: http://127.0.0.1:8265)
#   DATA_DIR, RUN_DIR, PRESAMPLE_DIR, SEED   expanded inside the configs (${VAR:-default})
#   DRY_RUN=1      print the commands instead of running them

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

has_presample() { grep -q '^presample:' "$1"; }

# The DPH pre-sampling stage, then training, on the current machine's Ray cluster.
# Usage: run_local CONFIG [driver flags...]
run_local() {
  local cfg
  cfg="$(config_path "$1")"
  shift
  cd "$REPO_ROOT" || return 1
  ensure_ray_head
  if has_presample "$cfg"; then
    say "pre-sampling D_pef / D_exp (resumable; instant when already done)"
    run "$PYTHON" -m openrlhf_div.cli.presample_ray --config "$cfg"
  fi
  run "$PYTHON" -m openrlhf_div.cli.train_ppo_ray --config "$cfg" "$@"
}

# JSON for --runtime-env-json: ship the repository as the job's working directory and pass the
# config variables through.
runtime_env_json() {
  "$PYTHON" - "$REPO_ROOT" <<'PYEOF'
import json, os, sys
env = {k: os.environ[k] for k in ("DATA_DIR", "RUN_DIR", "PRESAMPLE_DIR", "SEED", "HF_HOME",
                                  "HF_TOKEN", "NCCL_DEBUG") if k in os.environ}
env.setdefault("TOKENIZERS_PARALLELISM", "true")
print(json.dumps({"working_dir": sys.argv[1], "excludes": ["runs/", ".venv/", ".git/", "*.pt"],
                  "env_vars": env}))
PYEOF
}

# Submit pre-sampling + training as one Ray job to a running cluster.
# Usage: submit_job CONFIG [driver flags...]
submit_job() {
  local cfg rel
  cfg="$(config_path "$1")"
  shift
  rel="${cfg#"${REPO_ROOT}"/}"
  local steps="true"
  if has_presample "$cfg"; then
    steps="python -m openrlhf_div.cli.presample_ray --config ${rel}"
  fi
  local extra=""
  if [[ $# -gt 0 ]]; then extra="$(printf ' %q' "$@")"; fi
  run ray job submit --address "${RAY_ADDRESS:-http://127.0.0.1:8265}" \
    --runtime-env-json "$(runtime_env_json)" \
    -- bash -c "${steps} && python -m openrlhf_div.cli.train_ppo_ray --config ${rel}${extra}"
}
