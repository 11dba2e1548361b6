"""The first-contact blockers of `ray job submit` / the launchers (issue 9), without a cluster.

Each test failed before its fix:
* the job's runtime env carried TOKENIZERS_PARALLELISM, which OpenRLHF's train() also puts into
  its ray.init: Ray's own merge (the function ray.init calls) refused the pair;
* task variables (OPENRLHF_DIV_*) did not travel with the job, nor into the driver's ray.init;
* relative output paths were accepted under `ray job submit`; data/ was uploaded, no size check;
* `--dry-run` given to a launcher ran pre-sampling for real / started a Ray head.
"""
from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
import sys

import pytest

from openrlhf_div.engines.openrlhf import jobs
from openrlhf_div.engines.openrlhf.launch import upstream_cli_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train_init_env_keys():
    """The env_vars keys of the ray.init call inside OpenRLHF's train() (read from its source)."""
    tree = ast.parse(open(upstream_cli_path()).read())
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    for node in ast.walk(train):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value == "env_vars" and isinstance(v, ast.Dict):
                    return {kk.value for kk in v.keys}
    raise AssertionError("no ray.init(runtime_env={'env_vars': ...}) in OpenRLHF's train()")


def test_upstream_env_keys_are_those_of_openrlhf_train():
    assert set(jobs.UPSTREAM_ENV) == _train_init_env_keys()


RUN = os.path.join(ROOT, "examples", "scripts", "run.sh")


def _submit_dry(experiment, *args, **env):
    e = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable, RAY_ADDRESS="http://head:8265", **env)
    e.pop("RAY_JOB_CONFIG_JSON_ENV_VAR", None)
    r = subprocess.run(["bash", RUN, experiment, "--submit", *args],
                       capture_output=True, text=True, env=e)
    assert r.returncode == 0, r.stderr
    words = shlex.split(r.stdout)
    return words, json.loads(words[words.index("--runtime-env-json") + 1]), r


def test_job_runtime_env_merges_with_train_init_in_ray():
    """Ray's own merge (what ray.init does in a submitted job's driver) accepts the launcher's
    job env together with OpenRLHF's train() env; the entrypoint hands the keys to the driver."""
    from ray.runtime_env.runtime_env import _merge_runtime_env

    words, renv, _ = _submit_dry("qwen25math7b_dapo17k_grpo", TOKENIZERS_PARALLELISM="false",
                                 OPENRLHF_DIV_MATH_TIMEOUT="3")
    train_env = {"env_vars": {k: v for k, v in jobs.UPSTREAM_ENV.items()}}
    assert _merge_runtime_env(renv, train_env) is not None
    job_env = {"env_vars": renv["env_vars"]}
    assert _merge_runtime_env({"env_vars": {"TOKENIZERS_PARALLELISM": "true"}}, train_env) is None  # the old bug
    assert not set(job_env["env_vars"]) & set(jobs.UPSTREAM_ENV)
    entry = words[words.index("--") + 1:]
    assert entry[0] == "env" and "TOKENIZERS_PARALLELISM=false" in entry  # the driver still gets the value
    assert renv["env_vars"]["OPENRLHF_DIV_MATH_TIMEOUT"] == "3"


def test_task_variables_reach_the_job_and_the_driver_init():
    env = {"OPENRLHF_DIV_SQL_DB_ROOT": "/data/a:/data/b", "RUN_DIR": "/r", "UNRELATED": "x",
           "TOKENIZERS_PARALLELISM": "false"}
    assert jobs.job_runtime_env_vars(env) == {"OPENRLHF_DIV_SQL_DB_ROOT": "/data/a:/data/b", "RUN_DIR": "/r"}
    drv = jobs.driver_runtime_env(env)["env_vars"]
    assert drv["OPENRLHF_DIV_SQL_DB_ROOT"] == "/data/a:/data/b" and drv["TOKENIZERS_PARALLELISM"] == "false"
    assert "UNRELATED" not in drv
    # inside a submitted job, keys the job already carries are left out (Ray refuses duplicates)
    env[jobs.JOB_CONFIG_ENV] = json.dumps({"runtime_env": {"env_vars": {"OPENRLHF_DIV_SQL_DB_ROOT": "/x"}}})
    drv = jobs.driver_runtime_env(env)["env_vars"]
    assert "OPENRLHF_DIV_SQL_DB_ROOT" not in drv and "RUN_DIR" in drv
    from ray.runtime_env.runtime_env import _merge_runtime_env

    assert _merge_runtime_env({"env_vars": {"OPENRLHF_DIV_SQL_DB_ROOT": "/x"}}, jobs.driver_runtime_env(env)) is not None


def test_submit_requires_absolute_paths(tmp_path):
    e = dict(os.environ, PYTHON=sys.executable, RAY_ADDRESS="http://127.0.0.1:1")
    for k in ("RUN_DIR", "DATA_DIR", "PRESAMPLE_DIR", "DRY_RUN"):
        e.pop(k, None)
    cfg_path = os.path.join(ROOT, "configs", "openrlhf", "qwen25math7b_dapo17k_dph_js.yaml")
    r = subprocess.run([sys.executable, "-m", "openrlhf_div.engines.openrlhf.jobs", ROOT, cfg_path],
                       capture_output=True, text=True, env=e, timeout=120)
    assert r.returncode != 0
    assert "absolute paths" in r.stderr and "ckpt.path" in r.stderr and "runs/qwen25math7b_dapo17k_dph_js/ckpt" in r.stderr
    # the launcher gives a fresh user absolute paths: a new run folder under the checkout's runs/
    r = subprocess.run(["bash", RUN, "qwen25math7b_dapo17k_dph_js", "--submit"],
                       capture_output=True, text=True, env=dict(e, DRY_RUN="1"), timeout=120)
    assert r.returncode == 0, r.stderr
    renv = json.loads(shlex.split(r.stdout.splitlines()[-1])[shlex.split(r.stdout.splitlines()[-1]).index("--runtime-env-json") + 1])
    run_dir = renv["env_vars"]["RUN_DIR"]
    assert run_dir.startswith(os.path.join(ROOT, "runs", "qwen25math7b_dapo17k_dph_js") + os.sep), run_dir
    assert os.path.isabs(renv["env_vars"]["DATA_DIR"]) and os.path.isabs(renv["env_vars"]["PRESAMPLE_DIR"])
    cfg = {"openrlhf": {"ckpt.path": "${RUN_DIR}/ckpt", "data.prompt_dataset": "${DATA_DIR}/x.jsonl",
                        "actor.model_name_or_path": "Qwen/Qwen2.5-7B"}}
    os.environ["RUN_DIR"], os.environ["DATA_DIR"] = str(tmp_path), str(tmp_path)
    try:
        jobs.check_job_paths(cfg, ROOT)  # absolute paths and a hub model name pass
    finally:
        del os.environ["RUN_DIR"], os.environ["DATA_DIR"]


def test_runtime_env_helper_imports_no_torch(tmp_path):
    """The launchers run `python -m openrlhf_div.engines.openrlhf.jobs` before every submit; it
    used to import torch (and the method registry) through launch.py's config loader."""
    code = ("import sys; from openrlhf_div.engines.openrlhf import jobs; "
            f"rc = jobs.main([{ROOT!r}, 'configs/openrlhf/tiny_cpu_grpo.yaml']); "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'deepspeed', 'transformers')); "
            "print('HEAVY', heavy, rc)")
    env = dict(os.environ, TINY_MODEL=str(tmp_path / "m"), DATA_DIR=str(tmp_path), RUN_DIR=str(tmp_path / "r"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert "HEAVY [] 0" in r.stdout, r.stdout + r.stderr
    assert json.loads(r.stdout.splitlines()[0])["env_vars"]["RUN_DIR"] == str(tmp_path / "r")


def test_upload_excludes_data_runs_venv_and_checks_size(tmp_path):
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("x = 1\n")
    for d in ("data", "runs", ".venv", "ckpt"):
        (root / d).mkdir()
        (root / d / "big.bin").write_bytes(b"\0" * 200_000)
    (root / "model.safetensors").write_bytes(b"\0" * 100_000)
    assert jobs.upload_size(str(root)) == len("x = 1\n")
    renv = jobs.job_runtime_env(str(root), {})
    assert {"data/", "runs/", ".venv/", "ckpt/"} <= set(renv["excludes"])
    (root / "pkg" / "weights.bin").write_bytes(b"\0" * 5000)
    with pytest.raises(ValueError, match=r"over Ray's 0 MiB limit"):
        jobs.job_runtime_env(str(root), {}, limit=4096)
    # the repository itself fits
    assert jobs.upload_size(ROOT) < jobs.RAY_UPLOAD_LIMIT


def test_launcher_dry_run_is_dry_all_the_way(tmp_path):
    """`--dry-run` to a launcher: no Ray head, no real pre-sampling, no job submitted."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    marker = tmp_path / "ray_called"
    (fake_bin / "ray").write_text(f"#!/bin/sh\necho \"$@\" >> {marker}\nexit 0\n")
    (fake_bin / "ray").chmod(0o755)
    e = dict(os.environ, PYTHON=sys.executable, PATH=f"{fake_bin}:{os.environ['PATH']}",
             RUN_DIR=str(tmp_path / "run"), PRESAMPLE_DIR=str(tmp_path / "pre"), DATA_DIR=str(tmp_path / "data"))
    e.pop("DRY_RUN", None)
    r = subprocess.run(["bash", RUN, "qwen25math7b_dapo17k_dph_js", "--dry-run"],
                       capture_output=True, text=True, env=e, timeout=900)
    assert r.returncode == 0, r.stderr
    assert not marker.exists(), marker.read_text()  # neither `ray status` nor `ray start`
    assert '"n_pre": 8' in r.stdout  # pre-sampling printed its settings instead of sampling
    assert not (tmp_path / "pre").exists()
    r = subprocess.run(["bash", RUN, "qwen25math7b_dapo17k_dph_js", "--submit", "--dry-run", "--plugin", "my.methods"],
                       capture_output=True, text=True, env=e, timeout=900)
    assert r.returncode == 0, r.stderr
    assert not marker.exists()  # nothing submitted
    words = shlex.split(r.stdout)
    assert words[:3] == ["ray", "job", "submit"]
    # a plug-in reaches the pre-sampling stage too
    assert "presample_ray --config configs/openrlhf/qwen25math7b_dapo17k_dph_js.yaml --plugin my.methods --dry-run" \
        in words[-1]


def test_placement_check_names_what_is_missing():
    """Issue 30: the driver compares the plan's needs with the live cluster (ray.cluster_resources())
    and stops in one line instead of waiting on a placement group forever (e2e:
    tests/e2e/test_laptop_path.py)."""
    need = {"GPU": 6, "CPU": 6, "detail": "actor 1 + vllm 5"}
    with pytest.raises(jobs.PlacementError) as exc:
        jobs.check_resources(need, "127.0.0.1:6379", have={"CPU": 8.0, "GPU": 4.0})
    msg = str(exc.value)
    assert "\n" not in msg and "needs 6 GPU(s) (actor 1 + vllm 5)" in msg and "has 4" in msg
    assert "--num-gpus 6" in msg
    with pytest.raises(jobs.PlacementError, match="needs 6 CPU"):
        jobs.check_resources(need, have={"CPU": 2.0, "GPU": 8.0})
    jobs.check_resources(need, have={"CPU": 8.0, "GPU": 6.0})  # enough: no error


def test_cpu_layer_applies_without_a_gpu_only():
    from openrlhf_div.compat import cpu_seams

    assert cpu_seams.cpu_mode({"OPENRLHF_DIV_CPU_SEAMS": "1"}) and not cpu_seams.cpu_mode({"OPENRLHF_DIV_CPU_SEAMS": "0"})
    assert cpu_seams.cpu_mode({}) == (not cpu_seams.gpu_present())
    env = cpu_seams.worker_env({"OMP_NUM_THREADS": "4"})
    assert env["OPENRLHF_DIV_CPU_SEAMS"] == "1" and env["DS_ACCELERATOR"] == "cpu"
    assert env["OMP_NUM_THREADS"] == "4"  # a value already set wins
    assert env["PYTHONPATH"].split(os.pathsep)[0] == cpu_seams.SITE_DIR
    assert os.path.isfile(os.path.join(cpu_seams.SITE_DIR, "sitecustomize.py"))
    rt = jobs.driver_runtime_env({}, cpu=True)["env_vars"]
    assert rt["OPENRLHF_DIV_CPU_SEAMS"] == "1" and "PYTHONPATH" in rt
    assert "OPENRLHF_DIV_CPU_SEAMS" not in jobs.driver_runtime_env({}, cpu=False)["env_vars"]
