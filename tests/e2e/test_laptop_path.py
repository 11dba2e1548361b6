"""The laptop Ray path as a fresh user meets it (issue 30): the README's set-up and nothing else.

* ``bash examples/scripts/run.sh tiny_cpu_grpo`` in a clean environment (no ``PYTHONPATH``, no
  ``OPENRLHF_DIV_*`` / ``DS_ACCELERATOR`` / ``NUM_GPUS`` / ``TINY_MODEL`` / ``DATA_DIR`` /
  ``RUN_DIR``, the venv not activated): the launcher finds the checkout's ``.venv`` Python, builds
  the tiny model and data on first use, the driver applies the CPU layer (no GPU) and starts a
  private Ray cluster for the run; it succeeds in a new run folder that holds what a local run's
  holds (config.yaml, run_info.json, metrics.jsonl, eval.jsonl / eval.json / eval_step0.json, the
  model), the launcher's last line names that folder, and ``compare`` reads it side by side with
  a local run of the same tiny task, without a base run. The driver's private cluster leaves no
  ``/tmp/openrlhf_div_ray_*`` folder; the controller prints one progress line per step (the local
  engine's formatter: k/N, ETA, reward, loss, entropy) instead of OpenRLHF's bar.
* Then ``run.sh tiny_cpu_grpo --submit`` in the same clean environment, no cluster running: the
  launcher starts a head for the job on free ports, submits it with ``ray job submit``, stops that
  head (and only it) at the end; the job's log carries the same progress lines.
* A run asking for more GPUs than the live cluster has stops within seconds with one line that
  names what is missing (the old driver waited forever on the placement group).

The launcher puts the checkout itself first on ``PYTHONPATH`` (``examples/scripts/_common.sh``),
so these runs import this checkout's package whatever the venv's editable install points at.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

import ray_harness as h

pytestmark = [pytest.mark.ray_e2e, pytest.mark.slow]

RUN = os.path.join(h.REPO, "examples", "scripts", "run.sh")
#: what a fresh shell has; nothing of the project's
CLEAN_KEYS = ("HOME", "USER", "LANG", "LC_ALL", "TERM", "TMPDIR")


def clean_env() -> dict:
    env = {k: os.environ[k] for k in CLEAN_KEYS if k in os.environ}
    venv_bin = os.path.join(h.REPO, ".venv", "bin")
    # the venv not activated: none of its bin folders on PATH
    env["PATH"] = os.pathsep.join(p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                                  if p and os.path.realpath(p) != os.path.realpath(venv_bin) and ".venv" not in p)
    return env


def _have_venv() -> bool:
    return os.path.exists(os.path.join(h.REPO, ".venv", "bin", "python"))


@pytest.fixture
def fresh_user(tiny_experiment):  # tiny_experiment: the stack-present / switched-off checks
    if not _have_venv():
        pytest.skip("no .venv in the checkout (the README's set-up makes one)")
    return clean_env()


def _failure(text: str) -> str:
    """The part of a failed run's output that explains it: the first traceback (the workers'
    logs arrive interleaved, so the tail alone often shows vLLM's shutdown), then the tail."""
    lines = text.splitlines()
    at = next((i for i, ln in enumerate(lines) if "Traceback" in ln and "vllm_plugin" not in "".join(lines[i:i + 12])),
              None)
    head = "\n".join(lines[at:at + 60]) if at is not None else ""
    return head + "\n...\n" + "\n".join(lines[-40:])


def _last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _local_run(tmp_path) -> str:
    """The same tiny task on the local engine, evaluated alike (n=4, T=1, 4 new tokens, lenient
    math grading, the same 8 prompts as they are)."""
    model, data = os.path.join(h.REPO, "runs", "tiny_cpu", "model"), os.path.join(h.REPO, "runs", "tiny_cpu", "data")
    cfg = tmp_path / "tiny_local.yaml"
    cfg.write_text(
        "task: math\ntask_options: {extract: lenient}\n"
        f"model: {{path: {model}}}\n"
        f"data: {{train: {data}/train.jsonl, eval: {data}/train.jsonl, prompt_template: '{{prompt}}'}}\n"
        "method: {name: grpo}\n"
        "rollout: {prompts_per_step: 4, group_size: 4, max_new_tokens: 4, temperature: 1.0, top_p: 1.0, backend: hf}\n"
        "optim: {steps: 2}\neval: {n_samples: 4, k: [1, 2, 4], temperature: 1.0}\n"
        "logging: {tensorboard: false, progress: false}\n")
    out = tmp_path / "local_run"
    r = subprocess.run([os.sys.executable, "-m", "openrlhf_div.cli.main", "train", "--config", str(cfg),
                        f"output_dir={out}"], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=h.REPO),
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return str(out)


def test_fresh_user_runs_tiny_cpu_grpo_locally(fresh_user, tmp_path):
    before = set(os.listdir(os.path.join(h.REPO, "runs", "tiny_cpu_grpo"))) \
        if os.path.isdir(os.path.join(h.REPO, "runs", "tiny_cpu_grpo")) else set()
    proc = subprocess.run(["bash", RUN, "tiny_cpu_grpo"], env=fresh_user, cwd="/", stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=1500)
    out = proc.stdout
    last = _last_line(out)
    run_dir = last.split("run folder: ", 1)[1].strip() if "run folder: " in last else ""
    try:
        assert proc.returncode == 0, _failure(out)
        assert last.startswith("[openrlhf-div] run folder: "), last
        assert os.path.dirname(run_dir) == os.path.join(h.REPO, "runs", "tiny_cpu_grpo")
        assert os.path.basename(run_dir) not in before  # a new folder for this run
        # what a local run leaves (issue 30, item 3)
        for f in ("model/config.json", "tb", "config.yaml", "run_info.json", "metrics.jsonl", "eval.jsonl",
                  "eval.json", "eval_step0.json", "results.md", "samples.jsonl"):
            assert os.path.exists(os.path.join(run_dir, f)), (f, sorted(os.listdir(run_dir)))
        info = json.load(open(os.path.join(run_dir, "run_info.json")))
        assert info["engine"] == "openrlhf" and info["method"]["name"] == "grpo" and info["cpu_path"]
        assert info["versions"]["vllm"] and info["versions"]["ray"] and info["machine"]["cpu_count"]
        rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
        assert [r["step"] for r in rows] == [1, 2] and all("rollout/reward_mean" in r for r in rows)
        evals = [json.loads(x) for x in open(os.path.join(run_dir, "eval.jsonl"))]
        assert [r["step"] for r in evals] == [0, 2] and "pass@4" in evals[0]
        ev = json.load(open(os.path.join(run_dir, "eval.json")))
        assert ev["settings"]["n"] == 4 and ev["info"]["step"] == 2 and len(ev["problems"]) == 8
        assert "lenient" in ev["settings"]["grading"]  # graded as the rewards were
        sc = h.tb_scalars(os.path.join(run_dir, "tb"))
        assert sorted(sc["train/rollout/reward_mean"]) == [1, 2]
        # the lenient extraction came from the config's env: section (rewards > 0 somewhere)
        assert any(v > 0 for v in sc["train/rollout/reward_mean"].values()), sc["train/rollout/reward_mean"]
        assert "private" in out  # the driver started its own cluster (no RAY_ADDRESS, none running)
        # ... and removed its temp dir at exit (issue 30: no /tmp/openrlhf_div_ray_* left behind)
        private = re.search(r"temp dir (/tmp/openrlhf_div_ray_\w+)", out)
        assert private and not os.path.exists(private.group(1)), private and private.group(1)
        _assert_progress_lines(out)
        # `compare` reads this Ray run and a local run of the same tiny task side by side, with no
        # base run (the step-0 evaluation the runs hold)
        local = _local_run(tmp_path)
        cmp_dir = tmp_path / "cmp"
        r = subprocess.run([os.sys.executable, "-m", "openrlhf_div.cli.main", "compare", f"ray_grpo={run_dir}",
                            f"local_grpo={local}", "--out", str(cmp_dir)], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=h.REPO), timeout=300)
        assert r.returncode == 0, r.stderr
        md = (cmp_dir / "report.md").read_text()
        assert "| ray_grpo |" in md and "| local_grpo |" in md and "step-0 evaluation" in md, md
        # `--submit` with no cluster running: a head for the job (free ports), real `ray job submit`
        _fresh_user_submits(fresh_user, before | {os.path.basename(run_dir)})
    finally:
        if run_dir and os.path.isdir(run_dir) and os.path.basename(run_dir) not in before:
            shutil.rmtree(run_dir, ignore_errors=True)


def _assert_progress_lines(out: str) -> None:
    """The Ray controller's step line (issue 30: the local engine's formatter, not OpenRLHF's tqdm)."""
    lines = [ln for ln in out.splitlines() if "[openrlhf-div] train grpo: " in ln]
    assert len(lines) == 2, "\n".join(lines) or out[-3000:]
    assert "train grpo: 1/2 (50%)" in lines[0] and ", ETA " in lines[0], lines[0]
    assert "train grpo: 2/2 (100%)" in lines[1], lines[1]
    for ln in lines:
        assert re.search(r"reward=[\d.]+, loss=-?[\d.]+(e-?\d+)?, entropy=[\d.]+, s_per_step=", ln), ln
        assert "anchor=" not in ln  # grpo has no anchor term
    assert "Episode [1/1]" not in out  # OpenRLHF's own bar is replaced
    assert "[openrlhf-div] [eval] step 0: pass@1 " in out and "[openrlhf-div] [eval] step 2: pass@1 " in out


def _dashboard_answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/api/version", timeout=3):
            return True
    except OSError:
        return False


def _fresh_user_submits(env: dict, before: set) -> None:
    """``run.sh tiny_cpu_grpo --submit`` with no Ray cluster at the default address and RAY_ADDRESS
    unset: the launcher starts a head for the job on free ports (never 6379 / 8265: other clusters
    of the machine are left alone), submits with ``ray job submit``, prints the job's log (the
    progress lines included), stops that head only and removes its temp dir; the last line names
    the run folder."""
    from openrlhf_div.engines.openrlhf.head import own_pids

    if _dashboard_answers("http://127.0.0.1:8265"):
        pytest.skip("a Ray cluster answers at the default address: --submit rightly submits there")
    proc = subprocess.run(["bash", RUN, "tiny_cpu_grpo", "--submit"], env=env, cwd="/", stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=1500)
    out = proc.stdout
    last = _last_line(out)
    run_dir = last.split("run folder: ", 1)[1].strip() if "run folder: " in last else ""
    head = re.search(r"Ray head for this job: dashboard (http://127\.0\.0\.1:(\d+)), GCS 127\.0\.0\.1:(\d+), "
                     r"temp dir (/tmp/openrlhf_div_ray_\w+)", out)
    try:
        assert proc.returncode == 0, _failure(out)
        assert "no Ray cluster at http://127.0.0.1:8265: starting a Ray head for this job" in out, out[:3000]
        assert head, out[:3000]
        assert int(head.group(2)) != 8265 and int(head.group(3)) != 6379  # free ports, not Ray's defaults
        assert "succeeded" in out  # ray job submit followed the job to its end
        assert last.startswith("[openrlhf-div] run folder: "), last
        assert os.path.dirname(run_dir) == os.path.join(h.REPO, "runs", "tiny_cpu_grpo")
        assert os.path.basename(run_dir) not in before
        for f in ("config.yaml", "run_info.json", "metrics.jsonl", "eval.json", "model/config.json"):
            assert os.path.exists(os.path.join(run_dir, f)), (f, sorted(os.listdir(run_dir)))
        _assert_progress_lines(out)  # the job's log, streamed by ray job submit
        # the head is gone: its processes and its temp dir (it was this job's own)
        assert not os.path.exists(head.group(4)), head.group(4)
        assert not own_pids(head.group(4), int(head.group(3))), "the job's Ray head outlived the launcher"
        assert not _dashboard_answers(head.group(1))
    finally:
        if run_dir and os.path.isdir(run_dir) and os.path.basename(run_dir) not in before:
            shutil.rmtree(run_dir, ignore_errors=True)


def test_more_gpus_than_the_cluster_has_fails_in_seconds(ray_head, tiny_experiment, tmp_path):
    env = dict(ray_head.env(), **tiny_experiment.env, RAY_ADDRESS=f"127.0.0.1:{ray_head.gcs_port}",
               RUN_DIR=str(tmp_path / "run"), PYTHON=os.sys.executable)
    t0 = time.monotonic()
    proc = subprocess.run(["bash", RUN, "tiny_cpu_grpo", "--vllm.num_engines", str(ray_head.num_gpus + 2)],
                          env=env, cwd=h.REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=300)
    took = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    line = errors[0]
    want = ray_head.num_gpus + 3
    assert f"needs {want} GPU(s)" in line and f"has {ray_head.num_gpus}" in line and "--num-gpus" in line, line
    assert "Traceback" not in proc.stderr
    assert took < 30, f"the placement error took {took:.0f} s"


def test_a_stopped_submit_stops_the_jobs_head(fresh_user):
    """SIGTERM to the launcher while its job runs (``run.sh tiny_cpu_grpo --submit``, no cluster
    running): the job's head is stopped at once, its processes and temp dir gone, exit 143 (the
    launcher waits on ``ray job submit`` in the background, so its trap runs without waiting for
    the job to end)."""
    from openrlhf_div.engines.openrlhf.head import own_pids

    if _dashboard_answers("http://127.0.0.1:8265"):
        pytest.skip("a Ray cluster answers at the default address: --submit rightly submits there")
    runs = os.path.join(h.REPO, "runs", "tiny_cpu_grpo")
    before = set(os.listdir(runs)) if os.path.isdir(runs) else set()
    proc = subprocess.Popen(["bash", RUN, "tiny_cpu_grpo", "--submit"], env=fresh_user, cwd="/",
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, head = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            head = head or re.search(r"GCS 127\.0\.0\.1:(\d+), temp dir (/tmp/openrlhf_div_ray_\w+)", line)
            if "Job submission server address" in line or "submitted successfully" in line:
                break
        assert head, "".join(lines)[-3000:]
        os.kill(proc.pid, signal.SIGTERM)  # the launcher only, as `kill PID` does
        rest, _ = proc.communicate(timeout=120)
        out = "".join(lines) + rest
        assert proc.returncode == 143, out[-3000:]
        assert "stopped (SIGTERM): the job and its Ray head" in out, out[-3000:]
        assert not os.path.exists(head.group(2)) and not own_pids(head.group(2), int(head.group(1))), out[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if head:
            from openrlhf_div.engines.openrlhf.head import stop

            stop(head.group(2))  # whatever the assertions found: never leave a cluster behind
        for name in (set(os.listdir(runs)) if os.path.isdir(runs) else set()) - before:
            shutil.rmtree(os.path.join(runs, name), ignore_errors=True)  # the stopped run's folder
