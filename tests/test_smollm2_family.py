"""The smollm2_arith experiment family (issue 40; docs/real_model.md): its data and how its files
resolve on the local engine. No model is loaded (seconds): the study itself is
benchmarks/real_model_study.sh, a benchmark, not a test.

* the shipped data are what examples/real_model/make_data.py writes (so they can be regenerated),
  every label is the arithmetic of its question, and no held-out question is a training question;
* the math task's lenient grading (the family's) reads SmolLM2-style answers the way the sizing
  measurements counted them;
* every method file resolves on the local engine (`openrlhf-div run ... --engine local --dry-run`)
  to its method on the family's settings, and dph_js reads D_pef from the folder the study script
  pre-samples into.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "examples", "data", "smollm2_arith")
METHODS = ("grpo", "dph_js", "ds_grpo", "lad_js")


def _make_data():
    spec = importlib.util.spec_from_file_location("smollm2_make_data",
                                                  os.path.join(ROOT, "examples", "real_model", "make_data.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(name):
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_shipped_data_are_the_generators_and_labels_are_right():
    md = _make_data()
    train, held = _rows("train.jsonl"), _rows("eval.jsonl")
    assert train == md.make_rows("add2", 64, seed=1)
    assert held == md.make_rows("add2", 32, seed=2, exclude={r["prompt"] for r in train})
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    from openrlhf_div.tasks.datasets import load_examples

    for level in md.LEVELS:
        rows = md.make_rows(level, 40, seed=7)
        assert len({r["prompt"] for r in rows}) == 40
        for r in rows:
            expr, ans = re.match(r"(\S+) = <<", r["answer"]).group(1), int(r["answer"].rsplit("####", 1)[1])
            assert eval(expr, {}) == ans >= 0, r  # noqa: S307 (our own generated "a+b-c")
            assert r["prompt"].endswith(md.INSTRUCTION)
    examples, _ = load_examples(os.path.join(DATA, "eval.jsonl"), "math")
    assert [e["label"] for e in examples] == [r["answer"].rsplit("#### ", 1)[1] for r in held]
    assert examples[0]["prompt"] == held[0]["prompt"]  # the instruction line stays in the prompt


def test_lenient_math_grading_reads_smollm2_style_answers():
    from openrlhf_div.tasks import get_task

    task = get_task("math", extract="lenient")
    assert task.score("Tom gives away 4 books, so he has 13 - 4 = 9 books left.", "9").correct
    assert task.score("Tom has 9 books left. The answer is 9.", "9").correct
    assert not task.score("Tom gives away 10 books. There are 3 books left.", "9").correct
    assert not task.score("Tom has many books left", "9").correct


@pytest.mark.parametrize("method", METHODS)
def test_every_method_file_resolves_on_the_local_engine(method, capsys, monkeypatch, tmp_path):
    from openrlhf_div.cli.main import main
    from openrlhf_div.engines import experiment as E

    monkeypatch.setenv("SMOLLM2_GGUF", "/models/smollm2.gguf")
    for var in ("DATA_DIR", "SEED", "RUN_DIR", "PRESAMPLE_DIR"):
        monkeypatch.delenv(var, raising=False)
    assert main(["run", f"smollm2_arith_{method}", "--engine", "local", "--dry-run",
                 "--run-dir", str(tmp_path / "run")]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["method"] == {"name": method}  # the preset, no hyperparameter changed
    assert cfg["task"] == "math" and cfg["task_options"] == {"extract": "lenient"}
    assert cfg["model"]["path"] == "/models/smollm2.gguf" and cfg["model"]["dtype"] == "auto"
    assert cfg["data"]["train"].endswith("examples/data/smollm2_arith/train.jsonl")
    assert (cfg["data"]["prompt_template"], cfg["data"]["system_prompt"]) == ("{prompt}", "")
    r, o = cfg["rollout"], cfg["optim"]
    assert (r["prompts_per_step"], r["group_size"], r["max_new_tokens"], r["temperature"]) == (8, 8, 32, 1.0)
    assert (r["backend"], r["vllm_enforce_eager"], r["on_policy_shortcut"]) == ("vllm", True, True)
    assert (o["mini_batches"], o["ppo_epochs"], o["learning_rate"], o["lr_schedule"]) == (1, 1, 2e-5, "constant")
    assert cfg["seed"] == 1 and cfg["num_threads"] == 1
    # the step count, the evaluation and the checkpoints are OpenRLHF's flags in the file (the local
    # engine derives its own from them): 64 prompts / 8 x 5 episodes = 40 steps, pass@1..16 every 8
    up = E.load(E.find_experiment(f"smollm2_arith_{method}"))["openrlhf"]
    assert len(_rows("train.jsonl")) // up["rollout.batch_size"] * up["train.num_episodes"] == 40
    assert (up["eval.steps"], up["eval.n_samples_per_prompt"], up["ckpt.save_steps"]) == (8, 16, 8)
    assert up["eval.dataset"].endswith("smollm2_arith}/eval.jsonl") and len(_rows("eval.jsonl")) == 32
    if method == "dph_js":
        exp = yaml.safe_load(open(os.path.join(ROOT, "configs", "openrlhf", "smollm2_arith_dph_js.yaml")))
        assert cfg["data"]["presample_dir"] == exp["data"]["presample_dir"]  # one name (the stage writes there)
        assert "out" not in exp["presample"] and "anchor_data" not in exp.get("div", {}) and "presample_dir" not in exp["local"]["data"]
        study = open(os.path.join(ROOT, "benchmarks", "real_model_study.sh")).read()
        assert f'PRESAMPLE="{cfg["data"]["presample_dir"]}"' in study
        assert (cfg["presample"]["n_pre"], cfg["presample"]["tau"], cfg["data"]["train_on_exp"]) == (8, 1, False)
        assert o["anchor_ratio"] == 8.0  # 64 online samples per step, 8 anchors


def test_the_seed_comes_from_the_sweep(capsys, monkeypatch, tmp_path):
    from openrlhf_div.cli.main import main

    monkeypatch.setenv("SEED", "3")
    assert main(["run", "smollm2_arith_grpo", "--engine", "local", "--dry-run", "--run-dir", str(tmp_path)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["seed"] == 3
