"""A reusable harness for end-to-end runs of the OpenRLHF topology on a CPU Ray cluster.

It drives the product's own laptop path; nothing here makes the run work that a user's run lacks:

* :func:`build_tiny_experiment` builds the tiny Qwen2 and its math data with the package's
  builder (:mod:`openrlhf_div.engines.openrlhf.tiny_experiment`, what the launcher uses for a
  config's ``tiny:`` section).
* :class:`RayHead` starts a private Ray head on 127.0.0.1 (every port picked free, its own
  temp dir, logical GPUs for OpenRLHF's placement groups). The CPU compatibility layer is not
  the head's: the job's driver applies it because there is no GPU
  (:func:`openrlhf_div.engines.openrlhf.jobs.init_ray`, :mod:`openrlhf_div.compat.cpu_seams`),
  as on a user's laptop. It is stopped by killing its own process group (never ``ray stop``,
  which would stop other clusters on the machine).
* :func:`submit` runs ``examples/scripts/run.sh EXPERIMENT --submit`` (real ``ray job submit``) with the
  experiment's variables; a ``probe=True`` head has the test-only probe
  (``tests/e2e/site/e2e_probe.py``) imported in every worker (``OPENRLHF_DIV_SITE_HOOKS``, read by
  the package's CPU-layer ``sitecustomize``); :func:`tb_scalars` and :func:`probe_records` read
  what the job left.

Other engines (e.g. the Megatron actor) reuse it: write a ``configs/openrlhf/tiny_cpu_*.yaml``
and call ``submit(head, exp, "examples/scripts/run.sh", "tiny_cpu_<that>", "--submit", run_dir=...)``.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from openrlhf_div.engines.openrlhf import tiny_experiment as _tiny  # noqa: E402

SITE = os.path.join(REPO, "tests", "e2e", "site")
PROBE = os.path.join(SITE, "e2e_probe.py")
#: the fault corpus's injections (tests/e2e/test_ray_faults.py), each off unless its variable is set
FAULTS = os.path.join(SITE, "e2e_faults.py")
DIGITS, WORDS = _tiny.DIGITS, _tiny.WORDS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ the tiny experiment
_problems = _tiny.problems
build_tiny_model = _tiny.build_tiny_model


@dataclass
class TinyExperiment:
    root: str
    model: str
    data: str
    env: Dict[str, str] = field(default_factory=dict)


def build_tiny_experiment(root: str, *, n_prompts: int = 8, seed: int = 0) -> TinyExperiment:
    """Model + data under ``root`` (absolute paths: jobs run in Ray's copy of the repository),
    built by the package (:func:`openrlhf_div.engines.openrlhf.tiny_experiment.ensure`)."""
    root = os.path.abspath(root)
    model = _tiny.ensure(os.path.join(root, "model"), seed=seed)["model"]
    data = _tiny.write_tiny_data(os.path.join(root, "data"), n_prompts=n_prompts, seed=seed)
    # TINY_MODEL / DATA_DIR point the configs at this copy. The math reward's lenient extraction
    # comes from the configs' env: section, as for a user (the submitting environment has none).
    env = {"TINY_MODEL": model, "DATA_DIR": os.path.dirname(data)}
    return TinyExperiment(root, model, data, env)


# ------------------------------------------------------------------ a private Ray head
class RayHead:
    """``ray start --head`` on 127.0.0.1 in its own process group (see module doc).

    Not ``--block``: in that mode ``ray start`` kills the whole cluster when any subprocess
    exits, and on a loaded 2-core machine the Ray Client server (unused here: jobs go through
    the dashboard) gives up after its hard-coded 30 s wait for the raylet and exits 1. Without
    ``--block`` the processes run detached and :meth:`stop` kills them by temp dir / GCS port."""

    def __init__(self, *, num_cpus: int = 8, num_gpus: int = 4, env: Optional[Dict[str, str]] = None,
                 probe: bool = True, keep_logs: Optional[str] = None):
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.extra_env = dict(env or {})
        self.probe = probe
        self.keep_logs = keep_logs  # copy the session's logs here on stop
        self.proc: Optional[subprocess.Popen] = None
        self.temp_dir = tempfile.mkdtemp(prefix="rayE2E", dir="/tmp")
        self.gcs_port = free_port()
        self.dashboard_port = free_port()

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def env(self) -> Dict[str, str]:
        bin_dir = os.path.dirname(sys.executable)
        env = dict(os.environ)
        env.update({
            "PATH": bin_dir + os.pathsep + env.get("PATH", ""),
            # this checkout first (the shared venv's editable install may point elsewhere)
            "PYTHONPATH": os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                    if p and p != SITE]),
            "RAY_DEDUP_LOGS": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            # a loaded 2-core box starts the dashboard's modules slowly (default 30 s)
            "RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT": "300",
            "RAY_DASHBOARD_STARTUP_TIMEOUT_S": "300",
            "TOKENIZERS_PARALLELISM": "false",
        })
        env.pop("RAY_ADDRESS", None)
        # OPENRLHF_DIV_FORCE_CPU_GEMM (cpu_seams): every vLLM process takes that CPU GEMM branch
        keep = ("OPENRLHF_DIV_FORCE_CPU_GEMM",)
        for k in [k for k in env if k.startswith("OPENRLHF_DIV_") and k not in keep]:
            env.pop(k)  # task variables must reach the workers through the job, not the raylet
        # test-only: the CPU layer's sitecustomize imports these in every worker
        env["OPENRLHF_DIV_SITE_HOOKS"] = ",".join(([PROBE] if self.probe else []) + [FAULTS])
        env.update(self.extra_env)
        return env

    def start(self, timeout: float = 300.0, attempts: int = 3) -> "RayHead":
        """Start the head; on a loaded machine Ray's hard-coded 30 s raylet registration can
        time out, so a head whose ``ray start`` exits is retried (fresh ports, fresh temp dir)."""
        for attempt in range(attempts):
            try:
                return self._start_once(timeout)
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                self.temp_dir = tempfile.mkdtemp(prefix="rayE2E", dir="/tmp")
                self.gcs_port, self.dashboard_port = free_port(), free_port()
        return self

    def _start_once(self, timeout: float) -> "RayHead":
        # the ports Ray fixes by default (52365, 10001); the others it picks at random itself
        ports = {f"--{k}": str(free_port()) for k in ("dashboard-agent-listen-port", "ray-client-server-port")}
        lo = free_port()
        cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head",
               "--node-ip-address", "127.0.0.1", "--port", str(self.gcs_port),
               "--include-dashboard=true", "--dashboard-host", "127.0.0.1",
               "--dashboard-port", str(self.dashboard_port), "--num-cpus", str(self.num_cpus),
               "--num-gpus", str(self.num_gpus), "--temp-dir", self.temp_dir,
               "--min-worker-port", str(lo), "--max-worker-port", str(lo + 200), "--disable-usage-stats"]
        for k, v in ports.items():
            cmd += [k, v]
        self.log = open(os.path.join(self.temp_dir, "head.log"), "w")
        self.proc = subprocess.Popen(cmd, env=self.env(), stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + timeout
        import urllib.request

        while time.time() < deadline:
            if self.proc.poll() not in (None, 0):
                log, rc = self.head_log(), self.proc.returncode
                self.stop()
                raise RuntimeError(f"ray start exited {rc}: {log[-3000:]}")
            try:
                # the dashboard answers before `ray start` has registered its raylet (Ray gives
                # that 30 s, hard-coded): ready only once ray start says the runtime started
                with urllib.request.urlopen(f"{self.address}/api/version", timeout=2) as r:
                    if r.status == 200 and "Ray runtime started" in self._raw_log():
                        return self
            except OSError:
                pass
            time.sleep(1.0)
        log = self.head_log()
        self.stop()
        raise TimeoutError(f"Ray head did not come up in {timeout}s: {log[-3000:]}")

    def _raw_log(self) -> str:
        try:
            with open(os.path.join(self.temp_dir, "head.log")) as fh:
                return fh.read()
        except OSError:
            return ""

    def head_log(self) -> str:
        """``ray start``'s output without the dashboard's module chatter, then the tails of the
        session's error logs (what explains a failed start)."""
        parts = []
        try:
            with open(os.path.join(self.temp_dir, "head.log")) as fh:
                parts.append("\n".join(ln for ln in fh.read().splitlines()
                                       if "INFO head.py" not in ln and "INFO utils.py" not in ln))
        except OSError:
            pass
        logs = os.path.join(self.temp_dir, "session_latest", "logs")
        for name in ("dashboard.log", "gcs_server.err", "raylet.err", "raylet.out"):
            try:
                with open(os.path.join(logs, name)) as fh:
                    tail = [ln for ln in fh.read().splitlines()[-400:] if "ERROR" in ln or "Error" in ln
                            or "Traceback" in ln or "rror:" in ln]
                parts.append(f"--- {name}\n" + "\n".join(tail[-20:]))
            except OSError:
                pass
        return "\n".join(parts)

    def own_pids(self) -> List[int]:
        """Processes of this cluster (:func:`openrlhf_div.engines.openrlhf.head.own_pids`: its temp dir
        or its GCS port in the command line, or its GCS address as a job driver's ``RAY_ADDRESS``)."""
        from openrlhf_div.engines.openrlhf.head import own_pids

        return own_pids(self.temp_dir, self.gcs_port)

    def stop(self) -> None:
        if self.proc is not None:
            # the group outlives `ray start` (it returns once the cluster is up): the daemons and
            # the workers (whose command lines Ray rewrites to ray::...) are still in it
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
                time.sleep(2.0)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):  # stragglers that left the group
            pids = [p for p in self.own_pids() if p != os.getpid()]
            for p in pids:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
            if pids:
                time.sleep(2.0)
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc = None
        if self.keep_logs:  # what explains a failure outlives the temp dir
            logs = os.path.join(self.temp_dir, "session_latest", "logs")
            if os.path.isdir(logs):
                shutil.copytree(logs, self.keep_logs, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("*.sock", "events"))
            if os.path.exists(os.path.join(self.temp_dir, "head.log")):
                os.makedirs(self.keep_logs, exist_ok=True)
                shutil.copy(os.path.join(self.temp_dir, "head.log"), self.keep_logs)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# ------------------------------------------------------------------ jobs and their traces
@dataclass
class JobResult:
    returncode: int
    output: str
    run_dir: str


def submit(head: RayHead, exp: TinyExperiment, script: str, *args: str, run_dir: str,
           presample_dir: Optional[str] = None, timeout: float = 600.0,
           extra_env: Optional[Dict[str, str]] = None) -> JobResult:
    """``bash <script> <args>`` (``examples/scripts/run.sh EXPERIMENT --submit ...``) against ``head``."""
    env = head.env()
    env.update(exp.env)
    env.update({"RAY_ADDRESS": head.address, "PYTHON": sys.executable, "RUN_DIR": os.path.abspath(run_dir)})
    if presample_dir:
        env["PRESAMPLE_DIR"] = os.path.abspath(presample_dir)
    env.update(extra_env or {})
    proc = subprocess.run(["bash", os.path.join(REPO, script), *args], env=env, cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return JobResult(proc.returncode, proc.stdout, os.path.abspath(run_dir))


def tb_scalars(tb_dir: str) -> Dict[str, Dict[int, float]]:
    """``{tag: {step: value}}`` of every TensorBoard event file under ``tb_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: Dict[str, Dict[int, float]] = {}
    for dirpath, _, files in os.walk(tb_dir):
        if not any(f.startswith("events.out.tfevents") for f in files):
            continue
        acc = EventAccumulator(dirpath, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            for ev in acc.Scalars(tag):
                out.setdefault(tag, {})[int(ev.step)] = float(ev.value)
    return out


def probe_records(run_dir: str) -> List[Dict]:
    path = os.path.join(run_dir, "e2e_probe.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_state_dict(model_dir: str) -> Dict[str, "object"]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(model_dir, f)))
    return out
