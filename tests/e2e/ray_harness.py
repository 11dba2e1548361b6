"""A reusable harness for end-to-end runs of the OpenRLHF topology on a CPU Ray cluster.

* :func:`build_tiny_experiment` builds, on the spot, a tiny Qwen2 (2 layers, head_dim 64, a
  word-level tokenizer over digits) taught single-digit sums for a few seconds so its rollouts
  are sometimes right, and a small math data set (``{"prompt": "2 + 5 =", "answer": "7"}``).
* :class:`RayHead` starts a private Ray head on 127.0.0.1 (every port picked free, its own
  temp dir, logical GPUs for OpenRLHF's placement groups) with ``tests/e2e/site`` on the
  ``PYTHONPATH`` of every process: the CPU seams (``cpu_seams.py``) and the probe
  (``e2e_probe.py``). It is stopped by killing its own process group (never ``ray stop``,
  which would stop other clusters on the machine).
* :func:`submit` runs ``examples/scripts/run.sh EXPERIMENT --submit`` (real ``ray job submit``) with the
  experiment's variables; :func:`tb_scalars` and :func:`probe_records` read what the job left.

Other engines (e.g. the Megatron actor) reuse it: write a ``configs/openrlhf/tiny_cpu_*.yaml``
and call ``submit(head, exp, "examples/scripts/run.sh", "tiny_cpu_<that>", "--submit", run_dir=...)``.
"""
from __future__ import annotations

import json
import os
import random
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
SITE = os.path.join(REPO, "tests", "e2e", "site")
DIGITS = [str(i) for i in range(10)]
WORDS = ["+", "=", "and", "so", "is", "the", "sum"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ the tiny experiment
def _problems(rng: random.Random, n: int) -> List[Dict[str, str]]:
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 4), rng.randint(0, 4)
        out.append({"prompt": f"{a} + {b} =", "answer": str(a + b)})
    return out


def build_tiny_model(path: str, *, seed: int = 0, warmup_steps: int = 40) -> str:
    """A 2-layer Qwen2 (hidden 128, 2 heads of 64, vocab 19) and its word-level tokenizer,
    taught ``a + b = c <eos>`` for ``warmup_steps`` Adam steps so sampling at T=1 gets a
    fraction of the sums right (rewards vary within a group)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {"<pad>": 0, "<eos>": 1}
    for w in DIGITS + WORDS:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).float()  # taught in float32 (bf16 matmuls on CPU are slow), saved in bf16
    rng = random.Random(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(warmup_steps):
        batch = [hf_tok(f"{p['prompt']} {p['answer']} <eos>")["input_ids"] for p in _problems(rng, 16)]
        ids = torch.tensor(batch)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.config.dtype = "bfloat16"
    model.to(torch.bfloat16).save_pretrained(path)
    hf_tok.save_pretrained(path)
    return path


@dataclass
class TinyExperiment:
    root: str
    model: str
    data: str
    env: Dict[str, str] = field(default_factory=dict)


def build_tiny_experiment(root: str, *, n_prompts: int = 8, seed: int = 0) -> TinyExperiment:
    """Model + data under ``root`` (absolute paths: jobs run in Ray's copy of the repository)."""
    root = os.path.abspath(root)
    os.makedirs(os.path.join(root, "data"), exist_ok=True)
    model = os.path.join(root, "model")
    if not os.path.exists(os.path.join(model, "config.json")):
        build_tiny_model(model, seed=seed)
    data = os.path.join(root, "data", "train.jsonl")
    with open(data, "w") as fh:
        for p in _problems(random.Random(seed + 1), n_prompts):
            fh.write(json.dumps(p) + "\n")
    # The tiny model answers with a bare number: the math reward's lenient extraction. Set only in
    # the submitting environment (never on the Ray head), so rewards > 0 also show that task
    # variables travel with the job to the vLLM actors that score.
    env = {"TINY_MODEL": model, "DATA_DIR": os.path.dirname(data), "OPENRLHF_DIV_MATH_EXTRACT": "lenient"}
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
            "PYTHONPATH": os.pathsep.join([SITE, REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]),
            "OPENRLHF_DIV_CPU_SEAMS": "1",
            "OPENRLHF_DIV_E2E_PROBE": "1" if self.probe else "0",
            "DS_ACCELERATOR": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            # vLLM's CPU platform turns OpenRLHF's executor choice for TP=1 ("uni", what a GPU
            # runs: the model in the EngineCore process) into "mp" (one more spawned process
            # importing vLLM, ~15 CPU-s per engine) unless this is 0; with 0 the CPU run has the
            # GPU's process layout. AsyncLLM (OpenRLHF's engine) keeps its EngineCore process.
            "VLLM_ENABLE_V1_MULTIPROCESSING": env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
            "RAY_DEDUP_LOGS": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            # a loaded 2-core box starts the dashboard's modules slowly (default 30 s)
            "RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT": "300",
            "RAY_DASHBOARD_STARTUP_TIMEOUT_S": "300",
            "TOKENIZERS_PARALLELISM": "false",
        })
        env.pop("RAY_ADDRESS", None)
        # OPENRLHF_DIV_FORCE_CPU_GEMM (cpu_seams): every vLLM process takes that CPU GEMM branch
        keep = ("OPENRLHF_DIV_CPU_SEAMS", "OPENRLHF_DIV_E2E_PROBE", "OPENRLHF_DIV_FORCE_CPU_GEMM")
        for k in [k for k in env if k.startswith("OPENRLHF_DIV_") and k not in keep]:
            env.pop(k)  # task variables must reach the workers through the job, not the raylet
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
        """Processes of this cluster (its temp dir or its GCS port in the command line)."""
        out = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    cmd = fh.read().decode(errors="replace")
            except OSError:
                continue
            if self.temp_dir in cmd or f"127.0.0.1:{self.gcs_port}" in cmd:
                out.append(int(pid))
        return out

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
