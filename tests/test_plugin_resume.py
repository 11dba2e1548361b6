"""Issue 43 item 2: a local run trained with ``--plugin`` resumes. Its run folder records the
plug-ins it loaded (config.yaml's ``plugins:``, run_info.json's ``plugins``); ``train --resume``
loads them before resolving the method, and names a plug-in it cannot load in one line.
Cost: three subprocesses of a 1-layer model, about 15 s on 2 cores."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "plugins", "plugin_method.py")

TINY = """\
task: demo
seed: 0
num_threads: 1
model: {{tiny_vocab: "{vocab}", tiny_hidden_size: 16, tiny_layers: 1}}
data: {{train: {data}/train.jsonl}}
rollout: {{prompts_per_step: 2, group_size: 2, max_new_tokens: 4}}
optim: {{steps: 1}}
eval: {{every: 0, at_start: false}}
checkpoint: {{every: 1}}
logging: {{tensorboard: false, progress: false}}
method: {{name: plugin_grpo}}
"""


def _env():
    env = {k: v for k, v in os.environ.items() if k != "OPENRLHF_DIV_PLUGINS"}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUTF8="1")
    return env


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "openrlhf_div.cli.main", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=300)


def test_a_plugin_run_resumes_and_a_missing_plugin_is_named(tmp_path):
    from openrlhf_div.demo.warmup import VOCAB
    from openrlhf_div.tasks.demo import SplitSpec, write_splits

    write_splits(str(tmp_path / "data"), SplitSpec(seed=0, n_eval_regular=4))
    plugin = tmp_path / "mine" / "plugin_method.py"
    plugin.parent.mkdir()
    shutil.copy(FIXTURE, plugin)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY.format(data=tmp_path / "data", vocab=VOCAB))
    run = tmp_path / "run"
    # the plug-in given on the command line, relative to the working directory
    r = _cli("--plugin", "mine/plugin_method.py", "train", "--config", str(cfg), f"output_dir={run}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert yaml.safe_load(open(run / "config.yaml"))["plugins"] == [str(plugin)]
    assert json.load(open(run / "run_info.json"))["plugins"] == [str(plugin)]

    # resumed from another directory, without --plugin: the recorded plug-in is loaded
    r = _cli("train", "--resume", str(run), "optim.steps=2", cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [json.loads(x)["step"] for x in open(run / "metrics.jsonl")] == [1, 2]

    # the plug-in file gone: one line naming it
    plugin.rename(tmp_path / "elsewhere.py")
    r = _cli("train", "--resume", str(run), "optim.steps=3", cwd=ROOT)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("[openrlhf-div]")]
    assert len(lines) == 1 and f"--resume {run}: the run was trained with the plug-in '{plugin}'" in lines[0], r.stderr
    assert "no such file" in lines[0]


def test_an_unknown_method_on_resume_says_how_to_load_its_plugin(tmp_path):
    """A run folder from before plug-ins were recorded (``plugins: []``): the hint names --plugin."""
    from openrlhf_div.config import ConfigError
    from openrlhf_div.engines.local.trainer import train

    run = tmp_path / "old"
    run.mkdir()
    (run / "config.yaml").write_text("task: demo\nplugins: []\nmethod: {name: grpo_nolow}\n")
    import pytest

    with pytest.raises(ConfigError, match=r"unknown method 'grpo_nolow'.*openrlhf-div --plugin MODULE_OR_FILE "
                                          r"train --resume"):
        train(resume=str(run))
