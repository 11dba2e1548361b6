"""Ray runtime environments for the driver and for ``ray job submit`` (one place for both).

Facts this module is built on (Ray 2.55, OpenRLHF 0.11.2):

* OpenRLHF's ``train()`` calls ``ray.init(runtime_env={"env_vars": {...}})`` with the keys of
  :data:`UPSTREAM_ENV`. A job submitted with any of those keys in its runtime env dies in
  ``ray.init`` ("Failed to merge the Job's runtime env": Ray refuses duplicate keys). So the
  job's runtime env never carries them; the launcher exports them to the driver process, where
  ``train()`` reads them from ``os.environ``.
* Ray workers inherit the raylet's environment (the one ``ray start`` had), not the driver's.
  The variables a reward function needs (``OPENRLHF_DIV_*``, e.g. the SQL database roots) must
  travel in a runtime env: in the job's (``ray job submit``) and in the driver's ``ray.init``
  (local launchers): :func:`task_env`, :func:`driver_runtime_env`, :func:`init_ray`.
* A job's relative paths resolve inside Ray's per-node temporary copy of the working
  directory: checkpoints, exports and pre-sampling output written there are lost with it.
  :func:`check_job_paths` requires absolute paths for outputs and for local inputs.
* On several nodes, gloo groups (weight sync, TP) must advertise each node's own address: every
  run's runtime env names :data:`WORKER_SETUP_HOOK` as Ray's ``worker_process_setup_hook``
  (:mod:`.nodes`).
* The working directory is uploaded through the GCS, at most ``GCS_STORAGE_MAX_SIZE`` (512 MiB)
  zipped; :data:`UPLOAD_EXCLUDES` keeps data, runs, checkpoints and the venv out, and
  :func:`upload_size` measures what Ray would upload (with Ray's own exclusion rules) before
  submitting.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

#: the keys OpenRLHF 0.11.2's ``train()`` puts into its ``ray.init`` runtime env, with its defaults
UPSTREAM_ENV: Dict[str, str] = {
    "TOKENIZERS_PARALLELISM": "true",
    "NCCL_DEBUG": "WARN",
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
}

#: variables the configs expand (``${DATA_DIR:-...}``) and hub credentials: passed to every worker
CONFIG_VARS = ("DATA_DIR", "RUN_DIR", "PRESAMPLE_DIR", "SEED", "TINY_MODEL", "HF_HOME", "HF_TOKEN",
               "HF_ENDPOINT", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
#: every variable with this prefix configures a task's reward function (tasks/reward_funcs/*)
TASK_PREFIX = "OPENRLHF_DIV_"

#: never uploaded with a job (Ray also honours .gitignore)
UPLOAD_EXCLUDES = ["data/", "runs/", ".venv/", ".git/", "ckpt/", "checkpoints/", "*.pt", "*.safetensors",
                   "*.sqlite", "**/__pycache__/", ".pytest_cache/"]

#: Ray's limit on an uploaded working directory (GCS_STORAGE_MAX_SIZE in Ray 2.55)
RAY_UPLOAD_LIMIT = 512 * 1024 * 1024

JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray in a submitted job's driver

#: Ray runs it in every worker process of a run: gloo advertises the node's Ray address, not
#: whatever the hostname resolves to (openrlhf_div.engines.openrlhf.nodes)
WORKER_SETUP_HOOK = "openrlhf_div.engines.openrlhf.nodes.setup_worker"


def task_env(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The variables every Ray worker of a run needs: ``OPENRLHF_DIV_*``, :data:`CONFIG_VARS`, and
    ``TORCH_CUDA_ARCH_LIST`` in a form DeepSpeed's JIT builder parses (``9.0a`` -> ``9.0``,
    :mod:`openrlhf_div.compat.cuda_arch`): the actors build FusedAdam, and a worker would otherwise
    inherit the raylet's unparseable value."""
    from openrlhf_div.compat.cuda_arch import VAR as ARCH_VAR, parseable_arch_value

    environ = os.environ if environ is None else environ
    out = {k: v for k, v in environ.items() if k.startswith(TASK_PREFIX) or k in CONFIG_VARS}
    arch = parseable_arch_value(environ)
    if arch:
        out[ARCH_VAR] = arch
    return out


def job_runtime_env_vars(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``env_vars`` of a submitted job's runtime env: never a key of :data:`UPSTREAM_ENV`."""
    return {k: v for k, v in task_env(environ).items() if k not in UPSTREAM_ENV}


def _job_runtime_env(environ: Mapping[str, str]) -> Dict[str, Any]:
    raw = environ.get(JOB_CONFIG_ENV)
    if not raw:
        return {}
    try:
        cfg = json.loads(raw)
    except ValueError:
        return {}
    return cfg.get("runtime_env") or {}


def _job_env_keys(environ: Mapping[str, str]) -> set:
    return set((_job_runtime_env(environ).get("env_vars") or {}).keys())


def driver_runtime_env(environ: Optional[Mapping[str, str]] = None, cpu: bool = False) -> Dict[str, Any]:
    """The runtime env our drivers pass to ``ray.init``: OpenRLHF's own keys (as ``train()``
    would set them) plus :func:`task_env` (and, for a run without GPU, the CPU layer's
    :func:`~openrlhf_div.compat.cpu_seams.worker_env`), minus every key the submitted job's
    runtime env already has (Ray refuses to merge duplicates)."""
    environ = os.environ if environ is None else environ
    env = {k: environ.get(k, v) for k, v in UPSTREAM_ENV.items()}
    env.update(task_env(environ))
    if cpu:
        from openrlhf_div.compat.cpu_seams import worker_env

        env.update(worker_env(environ))
    taken = _job_env_keys(environ)
    out: Dict[str, Any] = {"env_vars": {k: v for k, v in env.items() if k not in taken}}
    if "worker_process_setup_hook" not in _job_runtime_env(environ):
        out["worker_process_setup_hook"] = WORKER_SETUP_HOOK
    return out


def running_cluster(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The Ray cluster this driver joins: ``RAY_ADDRESS`` (a submitted job always has it), else
    the one ``ray start`` last recorded on this machine if its GCS is alive; ``None``: none runs."""
    environ = os.environ if environ is None else environ
    if environ.get("RAY_ADDRESS"):
        return environ["RAY_ADDRESS"]
    from ray._private import services

    recorded = services.find_bootstrap_address(None)
    if recorded and recorded in set(services.find_gcs_addresses()):
        return recorded
    return None


#: logical CPUs a private CPU cluster declares at least (each OpenRLHF bundle asks for 1 CPU + 1 GPU)
PRIVATE_MIN_CPUS = 8


def init_ray(environ: Optional[Mapping[str, str]] = None, need: Optional[Dict[str, int]] = None) -> None:
    """``ray.init`` with :func:`driver_runtime_env` unless Ray is already initialised (then
    OpenRLHF's ``train()`` skips its own ``ray.init``).

    Without a GPU the CPU compatibility layer is applied (:mod:`openrlhf_div.compat.cpu_seams`):
    in this process and in every worker. With no running cluster (:func:`running_cluster`) the
    driver starts a private one for this run (its own temp dir, no dashboard, stopped when the
    driver exits) that declares ``need["GPU"]`` logical GPUs on a machine without GPU. Then
    :func:`check_resources` stops a run the cluster cannot place (``need``), in seconds."""
    import sys
    import tempfile

    import ray

    from openrlhf_div.compat import cpu_seams

    if ray.is_initialized():
        return
    environ = os.environ if environ is None else environ
    cpu = cpu_seams.cpu_mode(environ)
    if cpu:
        cpu_seams.apply_here(environ)
    runtime_env = driver_runtime_env(environ, cpu=cpu)
    address = running_cluster(environ)
    if address is None:
        kwargs: Dict[str, Any] = {}
        if cpu:
            gpus = int((need or {}).get("GPU", 0))
            kwargs = {"num_gpus": gpus, "num_cpus": max(os.cpu_count() or 1, PRIVATE_MIN_CPUS, gpus + 2)}
        what = f"{kwargs['num_gpus']} logical GPU(s): no GPU here, the CPU path" if cpu else "this machine's GPUs"
        from .head import KEEP_ENV, TEMP_PREFIX

        temp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir="/tmp")
        print(f"[openrlhf-div] no Ray cluster running (RAY_ADDRESS unset): starting a private one for this run "
              f"({what}; temp dir {temp_dir}, removed at exit unless the run fails or {KEEP_ENV}=1)",
              file=sys.stderr, flush=True)
        _PRIVATE.update(dir=temp_dir, ok=False)
        import atexit

        # registered after Ray's own atexit shutdown, so it runs first (atexit is last-in first-out)
        atexit.register(_close_private_cluster)
        ray.init(address="local", include_dashboard=False, runtime_env=runtime_env, _temp_dir=temp_dir, **kwargs)
        _note_interrupts()
    elif environ.get("RAY_ADDRESS"):
        ray.init(runtime_env=runtime_env)  # Ray reads RAY_ADDRESS itself (a submitted job's driver has it)
    else:
        ray.init(address=address, runtime_env=runtime_env)
    if need:
        check_resources(need, address or "the private cluster")


#: the private cluster this process started (:func:`init_ray`): its temp dir; ``ok`` once the run
#: ended well (or was refused with its one line: nothing in the cluster's logs explains more)
_PRIVATE: Dict[str, Any] = {}


def private_cluster_done() -> None:
    """The run of this process is over and needs no cluster logs: the private cluster's temp dir
    goes at exit (a run that ends any other way keeps it, and its last line says where)."""
    _PRIVATE["ok"] = True


def _note_interrupts() -> None:
    """Ctrl-C and SIGTERM end the run as before (``KeyboardInterrupt``; ``SystemExit(signum)``, Ray's
    own driver handler) and mark it interrupted: the private cluster's temp dir then goes too (a
    stop asked for is no failure to investigate)."""
    import signal
    import sys
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def on_term(signum, frame):
        _PRIVATE["interrupted"] = "SIGTERM"
        sys.exit(signum)

    prev_int = signal.getsignal(signal.SIGINT)

    def on_int(signum, frame):
        _PRIVATE["interrupted"] = "SIGINT"
        if callable(prev_int):
            prev_int(signum, frame)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_int)


def _close_private_cluster(stream=None) -> Optional[str]:
    """At the driver's exit (normal, an error, Ctrl-C, SIGTERM: :func:`_note_interrupts`): stop
    the private cluster, then remove its temp dir (``/tmp/openrlhf_div_ray_*``) unless the run
    failed (an error, not a stop asked for) or ``OPENRLHF_DIV_KEEP_RAY_TMP=1``; then one line, the
    driver's last, names the kept folder. Returns the kept folder (None: removed)."""
    import shutil
    import sys

    from .head import KEEP_ENV, keep_tmp

    temp_dir = _PRIVATE.pop("dir", None)
    if not temp_dir:
        return None
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except Exception:  # noqa: BLE001 -- the folder is still ours to handle
        pass
    stream = sys.stderr if stream is None else stream
    if keep_tmp():
        print(f"[openrlhf-div] {KEEP_ENV}=1: the private Ray cluster's files are kept in {temp_dir}",
              file=stream, flush=True)
        return temp_dir
    if not _PRIVATE.get("ok") and not _PRIVATE.get("interrupted"):
        print(f"[openrlhf-div] the run did not finish: the private Ray cluster's logs are kept in "
              f"{temp_dir}/session_latest/logs", file=stream, flush=True)
        return temp_dir
    shutil.rmtree(temp_dir, ignore_errors=True)
    return None


class PlacementError(RuntimeError):
    """The live Ray cluster cannot place what the run needs (one line: what is missing, how to provide it)."""


def check_resources(need: Mapping[str, int], where: str = "the Ray cluster",
                    have: Optional[Mapping[str, float]] = None) -> None:
    """Compare the run's needs (``{"GPU": n, ..., "detail": "actor 1 + vllm 1"}``) with the live
    cluster's resources (``ray.cluster_resources()``) and raise :class:`PlacementError` naming what
    is missing, instead of waiting forever on a placement group Ray cannot schedule."""
    if have is None:
        import ray

        have = ray.cluster_resources()
    detail = need.get("detail")
    for res in ("GPU", "CPU"):
        want = int(need.get(res, 0) or 0)
        got = float(have.get(res, 0.0))
        if want > got:
            how = (f"start the head with `ray start --head --num-{res.lower()}s {want}` (logical {res}s are "
                   f"fine on a CPU machine: the CPU path runs everything on the CPU) or add nodes, or ask for "
                   f"less (--actor.num_gpus_per_node, --vllm.num_engines, --ref.num_gpus_per_node)")
            raise PlacementError(f"this run needs {want} {res}(s){f' ({detail})' if detail else ''} but {where} "
                                 f"has {got:g}: {how}")


# ------------------------------------------------------------------ ray job submit
#: config keys that name an output directory (must be absolute under ray job submit)
OUTPUT_KEYS = ("ckpt.path", "ckpt.output_dir", "logger.tensorboard_dir", "out", "anchor_data")
#: config keys that may name a local input (absolute when they are a local path)
INPUT_KEYS = ("data.prompt_dataset", "eval.dataset", "actor.model_name_or_path", "data.prompt_data",
              "prompt_dataset", "model_name_or_path")


def _config_items(cfg: Mapping[str, Any]) -> Iterable:
    from openrlhf_div.config import expand_env

    for section in ("div", "openrlhf", "presample"):
        for k, v in (cfg.get(section) or {}).items():
            if isinstance(v, str):
                yield f"{section}.{k}", k, expand_env(v)


def check_job_paths(cfg: Mapping[str, Any], repo_root: str) -> None:
    """Under ``ray job submit`` relative paths resolve inside Ray's temporary copy of the
    working directory: refuse relative output paths and relative local input paths."""
    bad: List[str] = []
    for where, key, value in _config_items(cfg):
        if not value or os.path.isabs(value):
            continue
        if key in OUTPUT_KEYS or key.endswith(OUTPUT_KEYS):
            bad.append(f"{where} = {value!r} (output)")
        elif (key in INPUT_KEYS or key.endswith(INPUT_KEYS)) and (
                os.path.exists(os.path.join(repo_root, value)) or value.startswith(("data/", "runs/", "./"))):
            bad.append(f"{where} = {value!r} (local input; data/ and runs/ are not uploaded)")
    if bad:
        raise ValueError(
            "under `ray job submit` relative paths resolve inside Ray's per-node temporary copy of the "
            "working directory (outputs are lost with it, data/ and runs/ are not uploaded). Set "
            "DATA_DIR, RUN_DIR, PRESAMPLE_DIR (and TINY_MODEL where used) to absolute paths on a "
            "filesystem every node sees:\n  " + "\n  ".join(bad))


def upload_size(root: str, excludes: Sequence[str] = tuple(UPLOAD_EXCLUDES)) -> int:
    """Bytes of the files Ray would upload from ``root`` (its own exclusion rules: ``excludes``,
    .gitignore, .rayignore). An upper bound of the zipped size."""
    from pathlib import Path

    from ray._private.runtime_env import packaging

    root_path = Path(root).absolute()
    total = [0]

    def handler(p: Path) -> None:
        if p.is_file() and not p.is_symlink():
            total[0] += p.stat().st_size

    include_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"
    packaging._dir_travel(root_path, [packaging._get_excludes(root_path, list(excludes))], handler,
                          include_gitignore=include_gitignore)
    return total[0]


def job_runtime_env(repo_root: str, environ: Optional[Mapping[str, str]] = None,
                    limit: int = RAY_UPLOAD_LIMIT) -> Dict[str, Any]:
    """The ``--runtime-env-json`` of a submitted job (upload size checked first)."""
    size = upload_size(repo_root)
    if size >= limit:
        raise ValueError(
            f"the job's working directory {repo_root} would upload {size / 2**20:.0f} MiB, over Ray's "
            f"{limit / 2**20:.0f} MiB limit; move large files out of the repository (data/, runs/ and "
            "checkpoints are excluded already) or add them to .rayignore")
    return {"working_dir": repo_root, "excludes": list(UPLOAD_EXCLUDES), "env_vars": job_runtime_env_vars(environ),
            "worker_process_setup_hook": WORKER_SETUP_HOOK}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m openrlhf_div.engines.openrlhf.jobs REPO_ROOT CONFIG``: print the job's runtime
    env JSON after checking its paths and upload size (used by examples/scripts/_common.sh)."""
    import sys

    from openrlhf_div.config import load_experiment as load_config

    argv = list(sys.argv[1:] if argv is None else argv)
    warn_only = "--warn-only" in argv  # dry runs: report path problems, still print the env
    argv = [a for a in argv if a != "--warn-only"]
    if len(argv) != 2:
        print("usage: python -m openrlhf_div.engines.openrlhf.jobs [--warn-only] REPO_ROOT CONFIG", file=sys.stderr)
        return 2
    root, cfg_path = argv
    try:
        try:
            check_job_paths(load_config(cfg_path), root)
        except ValueError as exc:
            if not warn_only:
                raise
            print(f"warning: {exc}", file=sys.stderr)
        print(json.dumps(job_runtime_env(root)))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
