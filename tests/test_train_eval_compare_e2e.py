"""`train`, `eval` and `compare` through the real CLI on one run directory, with one results
format (eval.json), the evaluation-settings check, and normal file modes under umask 0022."""
from __future__ import annotations

import json
import os
import stat

import pytest

from openrlhf_div.cli.main import main
from openrlhf_div.demo.warmup import VOCAB
from openrlhf_div.eval.results import EVAL_FORMAT
from openrlhf_div.tasks.demo import SplitSpec, write_splits

CONFIG = f"""\
task: demo
seed: 3
num_threads: 1
model:
  tiny_vocab: "{VOCAB}"
  tiny_hidden_size: 32
  tiny_layers: 1
data:
  train: {{data}}/train.jsonl
  eval: {{data}}/eval.jsonl
rollout:
  prompts_per_step: 2
  group_size: 2
  max_new_tokens: 6
  temperature: 1.0
optim:
  steps: 2
  learning_rate: 1.0e-3
eval:
  at_start: false
  n_samples: 4
  k: [1, 2, 4]
  max_prompts: 6
checkpoint:
  every: 1
logging:
  tensorboard: false
  progress: true
method:
  name: grpo
"""


def _modes(root):
    """``{relative path: mode}`` of every file and folder under ``root`` (itself included)."""
    out = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            out[os.path.relpath(p, root)] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


@pytest.fixture
def umask_0022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_train_eval_compare_one_run_directory(tmp_path, capsys, umask_0022):
    data = tmp_path / "data"
    write_splits(str(data), SplitSpec(seed=0, n_eval_regular=20))
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(CONFIG.format(data=data))
    run = tmp_path / "runs" / "grpo" / "seed3"

    # 1. train: the in-training evaluation writes the run's eval.json
    assert main(["train", "--config", str(cfg), f"output_dir={run}"]) == 0
    e_train = json.load(open(run / "eval.json"))
    assert e_train["format"] == EVAL_FORMAT and e_train["name"] == "grpo" and e_train["seed"] == 3
    assert e_train["info"] == {"source": "train", "step": 2}
    st = e_train["settings"]
    assert (st["n"], st["temperature"], st["top_p"], st["max_new_tokens"], st["keep_k"]) == (4, 1.0, 1.0, 6, 4)
    assert st["data"]["problems"] == 6 and st["grading"] and st["engine"] == "local"
    assert len(e_train["problems"]) == 6 and all(len(p["correct"]) == 4 for p in e_train["problems"])
    rows = [json.loads(x) for x in open(run / "eval.jsonl")]
    assert rows[-1]["step"] == 2 and rows[-1]["pass@4"] == pytest.approx(e_train["metrics"]["pass_at_k"]["4"])
    assert (run / "samples.jsonl").exists() and not list(tmp_path.rglob("results.json"))

    # 2. eval: the final model with the CLI, the same settings -> the same format, comparable
    ev = tmp_path / "eval" / "final"
    base_args = ["eval", "--model", str(run / "final_model"), "--task", "demo", "--data", str(data / "eval.jsonl"),
                 "--limit", "6", "--n", "4", "--max-new-tokens", "6", "--temperature", "1.0", "--no-progress"]
    assert main(base_args + ["--out", str(ev), "--role", "base", "--name", "final"]) == 0
    e_eval = json.load(open(ev / "eval.json"))
    assert e_eval["format"] == EVAL_FORMAT and e_eval["role"] == "base"
    same = ("n", "temperature", "top_p", "max_new_tokens", "keep_k", "grading", "data")
    assert {k: e_eval["settings"][k]["hash"] if k == "data" else e_eval["settings"][k] for k in same} == \
        {k: st[k]["hash"] if k == "data" else st[k] for k in same}

    # 3. compare: the train run directory against the eval output
    out = tmp_path / "cmp"
    capsys.readouterr()
    assert main(["compare", str(run), "--base", str(ev), "--out", str(out)]) == 0
    m = json.load(open(out / "metrics.json"))
    assert set(m["methods"]) == {"grpo"} and m["methods"]["grpo"]["seeds"] == [3]
    assert m["methods"]["grpo"]["pass@1"] == pytest.approx(e_train["metrics"]["pass@1"])
    assert m["settings_mismatch"] == []
    assert "different settings" not in open(out / "report.md").read()

    # a train run directory without eval.json: compare evaluates its final model (same seed, same numbers)
    os.remove(run / "eval.json")
    assert main(["compare", str(run), "--base", str(ev), "--out", str(tmp_path / "cmp2")]) == 0
    again = json.load(open(run / "eval.json"))
    assert [p["correct"] for p in again["problems"]] == [p["correct"] for p in e_train["problems"]]
    assert again["settings"] == {**st, "model": again["settings"]["model"]}

    # other evaluation settings: an error naming the difference, or --allow-mismatch and a marked report
    ev2 = tmp_path / "eval" / "longer"
    assert main(base_args[:-1] + ["--max-new-tokens", "9", "--out", str(ev2), "--role", "base"]) == 0
    capsys.readouterr()
    assert main(["compare", str(run), "--base", str(ev2), "--out", str(tmp_path / "cmp3")]) == 2
    err = capsys.readouterr().err
    assert "max_new_tokens: final_model=9, grpo/seed3=6" in err and "--allow-mismatch" in err
    assert main(["compare", str(run), "--base", str(ev2), "--out", str(tmp_path / "cmp3"), "--allow-mismatch"]) == 0
    assert "evaluated with different settings" in open(tmp_path / "cmp3" / "report.md").read()

    # 4. file modes follow the umask: 0644 files, 0755 folders (checkpoints, models, results, configs)
    assert os.path.isdir(run / "checkpoints" / "step_000002" / "model") and os.path.isdir(run / "final_model")
    bad = {}
    for root in (run, ev, out):
        for rel, mode in _modes(root).items():
            p = os.path.join(root, rel)
            want = 0o755 if os.path.isdir(p) else 0o644
            if mode != want:
                bad[os.path.relpath(p, tmp_path)] = oct(mode)
    assert bad == {}
