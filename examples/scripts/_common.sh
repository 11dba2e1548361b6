#!/usr/bin/env bash
# Shared helpers of the openrlhf-div launchers. Sourced by run.sh (the one launcher of every
# experiment) and sweep_methods.sh; not meant to be run on its own.
#
# Environment (all optional):
#   PYTHON         python with openrlhf-div installed (default: the repository's .venv/bin/python
#                  when there is one, else python3)
#   NUM_GPUS       GPUs a Ray head started by --submit offers (default: all visible; 4 logical
#                  GPUs on a machine without GPU)
#   OPENRLHF_DIV_KEEP_RAY_TMP=1   keep the temp dir (/tmp/openrlhf_div_ray_*, Ray's logs) of a cluster
#                  we start (the job's head; the driver's private one) after a run that succeeded
#   RAY_ADDRESS    dashboard address for `ray job submit`    (default: http://127.0.0.1:8265)
#   RUN_DIR        the run folder (default: a new runs/<experiment>/<timestamp> for every run)
#   DATA_DIR, PRESAMPLE_DIR, TINY_MODEL, SEED   expanded inside the configs (${VAR:-default})
#   DRY_RUN=1      print the commands instead of running them
#   RAY_ENTRYPOINT_RESOURCES   with --submit: Ray resources the job's driver needs, JSON (e.g.
#                  '{"nodeB": 1}' to run it on the node started with --resources '{"nodeB": 1}')
#   STAGES         with --submit: all (default) | presample | train -- which stages the job runs

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "${REPO_ROOT}/.venv/bin/python" ]]; then PYTHON="${REPO_ROOT}/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"

say() { printf '[openrlhf-div] %s\n' "$*" >&2; }

# Stop with one line when $PYTHON cannot import Ray (the README's set-up installs it).
require_ray() {
  if ! "$PYTHON" -c 'import ray' >/dev/null 2>&1; then
    say "error: ray is not importable by ${PYTHON}: run the README's set-up (bash scripts/setup_env.sh) or set PYTHON to the python that has openrlhf-div's stack"
    exit 2
  fi
}

# Ray's command line of $PYTHON's installation.
ray_cli() {
  local bin
  bin="$(dirname "$PYTHON")/ray"
  if [[ -x "$bin" ]]; then "$bin" "$@"; else "$PYTHON" -m ray.scripts.scripts "$@"; fi
}

# The run's variables (new run folder, absolute paths, the config's env:) and, for a config with a
# tiny: section, its tiny model and data built on first use (openrlhf_div.engines.openrlhf.prepare).
# Usage: prepare_run CONFIG [driver flags...]
prepare_run() {
  local cfg="$1" out nb=()
  shift
  if [[ "${DRY_RUN:-0}" == "1" ]] || wants_dry_run "$@"; then nb=(--no-build); fi
  out="$("$PYTHON" -m openrlhf_div.engines.openrlhf.prepare --repo "$REPO_ROOT" "${nb[@]}" "$cfg")" || exit 2
  eval "$out"
}

# The launcher's last line: where the run's files are.
say_run_dir() {
  if [[ "${DRY_RUN:-0}" != "1" ]] && ! wants_dry_run "$@"; then say "run folder: ${RUN_DIR}"; fi
}

# Run a command, or print it when DRY_RUN=1.
run() {
  if [[ "${DRY_RUN:-0}" == "1" ]]; then
    if [[ "$1" == "ray_cli" ]]; then printf 'ray '; shift; fi
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
# or a path. A family base (_*.yaml) or an unknown name is an error naming the closest experiments.
experiment_config() {
  local name="$1"
  if [[ "$name" == *.yaml || "$name" == */* ]]; then
    config_path "$name"
    return
  fi
  # the one lookup (openrlhf_div.engines.experiment.find_experiment): "did you mean" on a typo
  "$PYTHON" -m openrlhf_div.engines.experiment "$name"
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

# The section.key=value overrides among the driver flags (method.anchor_eta=0.3, presample.n_pre=4):
# both stages merge them into the experiment with the one loader (openrlhf_div.engines.experiment.load).
override_args() {
  local a
  for a in "$@"; do
    if [[ "$a" =~ ^(experiment|description|paper|plugins|task|method|div|engine|openrlhf|cluster|presample|env|tiny|toy|notes|local)(\.[^=]*)?= ]]; then
      printf '%s\n' "$a"
    fi
  done
}

# For --submit: a Ray dashboard answering at RAY_ADDRESS. With RAY_ADDRESS unset and nothing at
# the default address, start a head for this job (openrlhf_div.engines.openrlhf.head): on free
# ports (never Ray's defaults, so it collides with no other cluster on the machine), its own temp
# dir, logical GPUs where there is no GPU (the job's driver applies the CPU layer,
# openrlhf_div.compat.cpu_seams); stopped when the launcher exits (job done, failed, Ctrl-C,
# SIGTERM) by stop_job_head, which ends this cluster only (never `ray stop`).
# Sets JOB_ADDRESS (where to submit).
JOB_HEAD_DIR=""
JOB_PID=""
ensure_ray_head() {
  JOB_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
  if [[ "${DRY_RUN:-0}" == "1" ]]; then
    say "dry run: a Ray head for the job here (free ports) unless a cluster answers at ${JOB_ADDRESS}"
    return 0
  fi
  if "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/api/version", timeout=5)' \
      "$JOB_ADDRESS" >/dev/null 2>&1; then
    return 0
  fi
  if [[ -n "${RAY_ADDRESS:-}" ]]; then
    say "error: no Ray dashboard answers at RAY_ADDRESS=${RAY_ADDRESS}: start the cluster there, or unset RAY_ADDRESS to start one on this machine"
    exit 2
  fi
  local gpus="${NUM_GPUS:-}" cpus=()
  if [[ -z "$gpus" ]]; then
    gpus="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 4)')"
  fi
  if [[ "$(nproc)" -lt 8 ]]; then cpus=(--num-cpus 8); fi  # one logical CPU per placement bundle
  say "no Ray cluster at ${JOB_ADDRESS}: starting a Ray head for this job (${gpus} GPU(s); logical ones where there is no GPU)"
  trap 'stop_job_head' EXIT
  trap 'stopped_job Ctrl-C; stop_job_head; exit 130' INT
  trap 'stopped_job SIGTERM; stop_job_head; exit 143' TERM
  JOB_HEAD_OUT="$("$PYTHON" -m openrlhf_div.engines.openrlhf.head start --num-gpus "$gpus" "${cpus[@]}")" || exit 2
  eval "$JOB_HEAD_OUT"
  JOB_ADDRESS="$JOB_HEAD_ADDRESS"
  say "Ray head for this job: dashboard ${JOB_HEAD_ADDRESS}, GCS 127.0.0.1:${JOB_HEAD_GCS}, temp dir ${JOB_HEAD_DIR} (free ports; it stops when the job ends; a head of your own: ray start --head, then RAY_ADDRESS=http://127.0.0.1:8265)"
}

# The one line of a job stopped by Ctrl-C / SIGTERM: its run folder (marked incomplete, as the driver marks
# its own: engines/openrlhf/failures.py stopped) and how to resume from its last checkpoint, if any.
stopped_job() {
  local how="$1" tag="" resume="no checkpoint was saved yet: the same command starts it again"
  if [[ -n "${RUN_DIR:-}" && -d "$RUN_DIR" ]]; then
    tag="$(cat "$RUN_DIR/ckpt/_actor/latest" 2>/dev/null || true)"
    if [[ -n "$tag" ]]; then
      resume="resume from its last checkpoint $RUN_DIR/ckpt/_actor/$tag: the same command with RUN_DIR=$RUN_DIR and --ckpt.load_enable"
    fi
    printf 'stopped by %s; %s\n' "$how" "$resume" > "$RUN_DIR/INCOMPLETE" 2>/dev/null || true
    say "stopped (${how}): the job and its Ray head; run folder ${RUN_DIR} (marked incomplete: INCOMPLETE); ${resume}"
  else
    say "stopped (${how}): the job and its Ray head, before the job wrote its run folder"
  fi
}

# Stop the head ensure_ray_head started (and the submitting client), once. Its temp dir is removed,
# unless the job failed or OPENRLHF_DIV_KEEP_RAY_TMP=1: then the last line says where its logs are.
JOB_FAILED=0
JOB_HEAD_OUT=""
stop_job_head() {
  # a signal right after the head started, before its variables were set: they are in JOB_HEAD_OUT
  if [[ -z "$JOB_HEAD_DIR" && -n "$JOB_HEAD_OUT" ]]; then eval "$JOB_HEAD_OUT"; fi
  JOB_HEAD_OUT=""
  [[ -n "$JOB_HEAD_DIR" ]] || return 0
  local dir="$JOB_HEAD_DIR" keep=()
  JOB_HEAD_DIR=""
  if [[ -n "$JOB_PID" ]]; then kill "$JOB_PID" 2>/dev/null || true; fi
  if [[ "$JOB_FAILED" == "1" || "${OPENRLHF_DIV_KEEP_RAY_TMP:-0}" == "1" ]]; then keep=(--keep); fi
  "$PYTHON" -m openrlhf_div.engines.openrlhf.head stop "$dir" "${keep[@]}" || true
  if [[ ${#keep[@]} -gt 0 ]]; then say "the job's Ray head is stopped; its logs: ${dir}/session_latest/logs"; fi
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
  require_ray
  prepare_run "$cfg" "$@"
  # no Ray head here: the driver joins the running cluster (RAY_ADDRESS, or the one `ray start`
  # recorded) or starts a private one for this run (openrlhf_div.engines.openrlhf.jobs.init_ray)
  local pre=()
  if wants_dry_run "$@"; then
    pre=(--dry-run)
  fi
  if has_presample "$cfg"; then
    say "pre-sampling D_pef / D_exp (resumable; instant when already done)"
    local plugins=() overs=()
    mapfile -t plugins < <(plugin_args "$@")
    mapfile -t overs < <(override_args "$@")
    run "$PYTHON" -m openrlhf_div.cli.presample_ray --config "$cfg" "${plugins[@]}" "${overs[@]}" "${pre[@]}"
  fi
  run "$PYTHON" -m openrlhf_div.cli.train_ppo_ray --config "$cfg" "$@"
  say_run_dir "$@"
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
  require_ray
  prepare_run "$cfg" "$@"
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
    mapfile -t -O "${#plugins[@]}" plugins < <(override_args "$@")
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
  ensure_ray_head
  if [[ "${DRY_RUN:-0}" == "1" ]]; then
    run ray_cli job submit --address "$JOB_ADDRESS" "${entry[@]}" --runtime-env-json "$renv" \
      -- env "${upstream_env[@]}" bash -c "${steps} && ${train}"
    return 0
  fi
  # in the background + wait: a SIGTERM/SIGINT to this launcher runs its trap at once (bash runs
  # traps only between foreground commands), which stops the job's own head
  local rc=0
  ray_cli job submit --address "$JOB_ADDRESS" "${entry[@]}" --runtime-env-json "$renv" \
    -- env "${upstream_env[@]}" bash -c "${steps} && ${train}" &
  JOB_PID=$!
  wait "$JOB_PID" || rc=$?
  JOB_PID=""
  if [[ "$rc" != "0" ]]; then
    JOB_FAILED=1
    stop_job_head
    if [[ -s "$RUN_DIR/error.txt" ]]; then
      # the driver's named cause (engines/openrlhf/runfolder.py: record_failure), last, after Ray's
      # own end-of-job output (which repeats the job's log)
      say "$(head -c 4000 "$RUN_DIR/error.txt" | head -n 1) (the job failed: ray job submit exit status ${rc}; its run folder: ${RUN_DIR})"
    elif [[ -d "$RUN_DIR" ]]; then
      say "error: the job failed (ray job submit exit status ${rc}); its run folder: ${RUN_DIR}"
    else
      say "error: the job failed (ray job submit exit status ${rc}) before it wrote its run folder; the job's log is above"
    fi
    exit "$rc"
  fi
  stop_job_head
  say_run_dir "$@"
}
