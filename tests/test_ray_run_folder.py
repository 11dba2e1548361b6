"""The Ray path's run folder (issue 30, item 3) without a cluster: what the driver writes before
``train()`` (config.yaml with the final command, run_info.json with engine, method, versions and
machine) and the trainer's metrics.jsonl (one row per step, cut back on resume). The files of a
whole run: tests/e2e/test_laptop_path.py."""
import json
import os

import pytest
import yaml

pytest.importorskip("openrlhf")

from openrlhf_div.engines.openrlhf import runfolder  # noqa: E402
from openrlhf_div.engines.openrlhf.launch import load_config, plan  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = os.path.join(ROOT, "configs", "openrlhf", "tiny_cpu_grpo.yaml")


def test_driver_files(tmp_path, monkeypatch):
    monkeypatch.setenv("RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("TINY_MODEL", str(tmp_path / "model"))
    p = plan(["--config", CFG])
    run_dir = runfolder.write_driver_files(p, load_config(CFG))
    assert run_dir == str(tmp_path / "run")
    cfg = yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))
    assert cfg["engine"] == "openrlhf" and cfg["experiment"] == "tiny_cpu_grpo"
    assert cfg["openrlhf"]["ckpt.output_dir"] == f"{tmp_path}/run/model"  # variables expanded
    assert cfg["command"].startswith("python -m openrlhf_div.cli.train_ppo_ray") and "--div.method grpo" in cfg["command"]
    info = json.load(open(os.path.join(run_dir, "run_info.json")))
    assert info["engine"] == "openrlhf" and info["method"]["name"] == "grpo" and info["task"] == "math"
    assert info["actor_backend"] == "deepspeed"
    assert info["gpus_needed"] == {"actor": 1, "vllm": 1, "total": 2}
    assert set(info["versions"]) >= {"openrlhf_div", "torch", "vllm", "ray", "deepspeed", "openrlhf"}
    assert info["versions"]["vllm"] and info["versions"]["torch"].startswith("torch==")
    assert info["machine"]["cpu_count"] and "accelerator" in info["machine"]
    # a second run into the same folder keeps the first run's record
    runfolder.write_driver_files(p, load_config(CFG))
    assert json.load(open(os.path.join(run_dir, "run_info.json"))) == info
    assert any(f.startswith("run_info.resume_") for f in os.listdir(run_dir))


def test_metrics_rows_and_resume_truncation(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("RUN_DIR", str(tmp_path))
    args = type("A", (), {"ckpt": type("C", (), {"output_dir": "/nowhere/model"})})()
    f = runfolder.RunFolder(args)
    assert f.dir == str(tmp_path)
    for step in (1, 2, 3):
        f.log_step(step, {"policy_loss": torch.tensor(-0.5 * step), "rollout/reward_mean": 0.25, "text": "x",
                          "nan": float("nan")})
    f.append(runfolder.EVAL_LOG, {"step": 0, "pass@1": 0.1})
    f.append(runfolder.EVAL_LOG, {"step": 3, "pass@1": 0.2})
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["policy_loss"] == -1.0 and "text" not in rows[1] and "nan" not in rows[1]
    f.truncate(2)  # resumed from the checkpoint of step 2: steps 3.. are redone
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [1, 2]
    assert [json.loads(x)["step"] for x in open(tmp_path / "eval.jsonl")] == [0]
