"""The sweep on every engine and on a CPU (issue 39, defect 5): examples/scripts/sweep_methods.sh.

* A two-seed tiny sweep on the local engine (hf sampler) runs on a CPU, records two different
  seeds and draws two different sample sets, writes the base evaluation (role base) and the
  comparison report; run again it keeps the finished runs, resumes an interrupted one from its
  checkpoint and starts again one interrupted before its first checkpoint (about 40 s); the ETA of
  a continued sweep counts the kept runs' whole times, never a resumed run's remainder.
* The base-model evaluation on a CPU: vLLM's KV cache is sized (1 GiB), not vLLM's 92% of RAM.
* The dry run of every engine names one `openrlhf-div run` per (method, seed), with its seed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "scripts", "sweep_methods.sh")


def _env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RUN_DIR", "SEED", "DATA_DIR", "TINY_MODEL", "PRESAMPLE_DIR", "DRY_RUN")
           and not k.startswith("OPENRLHF_DIV_")}
    # the tiny model and data built for this test (not the repository's runs/ cache)
    env.update(TINY_MODEL=str(tmp_path / "tiny" / "model"), DATA_DIR=str(tmp_path / "tiny" / "data"),
               PYTHONUTF8="1", PYTHON=sys.executable, **extra)
    return env


def _sweep(tmp_path, *args, **env):
    return subprocess.run(["bash", SCRIPT, "tiny_cpu", *args], capture_output=True, text=True, cwd=ROOT,
                          env=_env(tmp_path, **env), timeout=600)


def _samples(run_dir):
    with open(os.path.join(run_dir, "samples.jsonl")) as fh:
        return [json.loads(line) for line in fh]


@pytest.mark.slow
def test_a_two_seed_local_sweep_runs_on_a_cpu_and_continues_when_run_again(tmp_path):
    out = tmp_path / "sweep"
    args = ("--engine", "local", "--methods", "grpo", "--seeds", "1 2", "--sampler", "hf", "--out", str(out))
    r = _sweep(tmp_path, *args)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "[sweep] no GPU: the local engine samples with its in-process hf sampler" in r.stderr
    assert "[sweep] run 2/2: grpo seed 2" in r.stderr and "ETA" in r.stderr
    s1, s2 = out / "runs" / "grpo" / "seed1", out / "runs" / "grpo" / "seed2"
    infos = [json.load(open(d / "run_info.json")) for d in (s1, s2)]
    assert [i["seed"] for i in infos] == [1, 2]  # two different seeds trained ...
    assert all(i["engine"] == "local" and i["experiment"] == "tiny_cpu_grpo" for i in infos)
    assert infos[0]["settings"] == infos[1]["settings"]  # ... the same experiment
    assert _samples(s1) != _samples(s2)  # ... and drew two different sample sets
    metrics = [[json.loads(x) for x in open(d / "metrics.jsonl")] for d in (s1, s2)]
    assert [r["step"] for r in metrics[0]] == [1, 2]  # the file's 2 steps
    base = json.load(open(out / "runs" / "base" / "eval.json"))
    assert base["role"] == "base" and base["seed"] is None
    assert (out / "report" / "report.md").exists()

    # killed and run again: seed 1 finished (kept), seed 2 interrupted after its checkpoint
    # (resumed), and a run interrupted before its first checkpoint (started again)
    os.remove(s2 / "sweep_done.json")
    before = json.load(open(s1 / "sweep_done.json"))
    r = _sweep(tmp_path, *args)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "run 1/2: grpo seed 1 done earlier, kept" in r.stderr
    assert "run 2/2: grpo seed 2 (interrupted: resuming from its latest checkpoint)" in r.stderr
    assert "resuming" in r.stderr and (s2 / "sweep_done.json").exists()
    assert json.load(open(s1 / "sweep_done.json")) == before and before["resumed"] is False
    # the ETA from the start of a continued sweep: the kept run's whole time (was: none until a run of this
    # invocation finished, then a resumed run's remainder taken for a whole run's time)
    line = next(x for x in r.stderr.splitlines() if "run 2/2: grpo seed 2 (interrupted" in x)
    assert ", ETA " in line, line
    assert json.load(open(s2 / "sweep_done.json"))["resumed"] is True
    assert [json.loads(x)["step"] for x in open(s2 / "metrics.jsonl")] == [1, 2]  # not trained twice

    import shutil

    shutil.rmtree(s2 / "checkpoints")
    os.remove(s2 / "sweep_done.json")
    r = _sweep(tmp_path, *args)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "(interrupted before its first checkpoint: starting again)" in r.stderr
    assert len(os.listdir(out / "attempts")) == 1
    assert json.load(open(s2 / "run_info.json"))["seed"] == 2


def test_the_sweeps_dry_run_on_every_engine(tmp_path):
    """Every engine: one `openrlhf-div run` per (method, seed) with that seed, the base evaluation
    from a run's step 0 (no second vLLM engine), the report; an unknown method names the family's."""
    for engine in ("local", "openrlhf", "megatron"):
        r = _sweep(tmp_path, "--engine", engine, "--methods", "grpo dph_js", "--seeds", "3 4",
                   "--out", str(tmp_path / engine), DRY_RUN="1")
        assert r.returncode == 0, r.stderr[-3000:]
        runs = [line for line in r.stdout.splitlines() if " run tiny_cpu_" in line]
        assert len(runs) == 4
        for line, (m, s) in zip(runs, [("grpo", 3), ("grpo", 4), ("dph_js", 3), ("dph_js", 4)]):
            assert line.startswith(f"SEED={s} ") and f"run tiny_cpu_{m} --engine {engine}" in line
            assert f" seed={s}" in line and f"/runs/{m}/seed{s}" in line
        assert "openrlhf.evaluate" not in r.stdout
        assert " compare " in r.stdout and "--base" in r.stdout
    r = _sweep(tmp_path, "--methods", "grpo nosuch", DRY_RUN="1")
    assert r.returncode == 2 and "no experiment tiny_cpu_nosuch (family tiny_cpu has the methods:" in r.stderr


def test_the_base_evaluation_sizes_vllms_kv_cache_on_a_cpu(monkeypatch, capsys):
    """Defect 5: vLLM's CPU engine took 92% of RAM for the base model's evaluation (the sweep died
    there); without a GPU the evaluation's engine gets a sized KV cache, said in one line."""
    from openrlhf_div.engines.openrlhf import evaluate as ev

    seen = {}

    class FakeLLM:
        def __init__(self, **kw):
            seen.update(kw)

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM))
    monkeypatch.setattr(ev, "_cuda", lambda: False)
    monkeypatch.delenv("OPENRLHF_DIV_VLLM_CPU_KV_CACHE_GB", raising=False)
    ev.make_vllm_generate_fn("some/model", 1, 0)
    assert seen["kv_cache_memory_bytes"] == 2**30
    assert "vLLM on a CPU: KV cache 1 GiB" in capsys.readouterr().err
