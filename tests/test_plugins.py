"""The plug-in hook (openrlhf_div.plugins): a method registered in a file outside the package
reaches the CLI (`train` in a fresh process), the Ray driver (its `--div.method` choices, the plan)
and, through OPENRLHF_DIV_PLUGINS, the Ray workers' runtime env. The Ray workers themselves import
it in tests/e2e/test_ray_e2e.py (the Megatron job trains `plugin_grpo` through `ray job submit`).
Cost: two subprocesses, about 10 s on 2 cores."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from openrlhf_div import plugins as PL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join("tests", "fixtures", "plugins", "plugin_method.py")

TINY = """\
task: demo
seed: 0
num_threads: 1
model: {{tiny_vocab: "{vocab}", tiny_hidden_size: 16, tiny_layers: 1}}
data: {{train: {data}/train.jsonl}}
rollout: {{prompts_per_step: 2, group_size: 2, max_new_tokens: 4}}
optim: {{steps: 2}}
checkpoint: {{every: 0}}
logging: {{tensorboard: false, progress: false}}
method: {{name: plugin_grpo}}
"""


@pytest.fixture(autouse=True)
def _forget_plugins():
    """What a test's plug-ins registered is removed afterwards: every test process collects every
    file, and another file's test runs one step of every registered method."""
    from openrlhf_div.algorithms.registry import _REGISTRY

    before_methods, before_loaded, before_modules = set(_REGISTRY), list(PL._loaded), set(sys.modules)
    yield
    for name in set(_REGISTRY) - before_methods:
        _REGISTRY.pop(name, None)
    PL._loaded[:] = before_loaded
    for mod in set(sys.modules) - before_modules:
        if mod.startswith("openrlhf_div_plugin_"):
            del sys.modules[mod]


def _env(**kw):
    env = {k: v for k, v in os.environ.items() if k != PL.ENV_VAR}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **kw)
    return env


def test_split_load_export_and_errors(tmp_path, monkeypatch):
    assert PL.split_plugin_args(["train", "--plugin", "a.b", "--x", "1", "--plugin=c.py"]) == \
        (["a.b", "c.py"], ["train", "--x", "1"])
    with pytest.raises(PL.PluginError, match="needs a module name"):
        PL.split_plugin_args(["--plugin"])
    monkeypatch.delenv(PL.ENV_VAR, raising=False)
    f = tmp_path / "my_methods.py"
    f.write_text("CALLS = globals().setdefault('CALLS', 0) + 1\n"
                 "import dataclasses\nfrom openrlhf_div.algorithms import get_method, register_method\n"
                 "register_method(dataclasses.replace(get_method('rloo'), name='tmp_plugin_rloo', summary='x'))\n")
    PL.load_plugins([str(f)])
    PL.load_plugins([str(f)])  # a second load is a no-op (re-registering would raise)
    assert os.environ[PL.ENV_VAR] == str(f)  # exported for child processes and Ray workers
    from openrlhf_div.algorithms import get_method
    from openrlhf_div.engines.openrlhf.jobs import job_runtime_env_vars

    assert get_method("tmp_plugin_rloo").estimator == "rloo"
    assert job_runtime_env_vars()[PL.ENV_VAR] == str(f)
    with pytest.raises(PL.PluginError, match="no module named 'no_such_pkg'.*PYTHONPATH"):
        PL.load_plugins(["no_such_pkg.methods"], export=False)
    with pytest.raises(PL.PluginError, match="no such file"):
        PL.load_plugins([str(tmp_path / "missing.py")], export=False)


def test_train_trains_a_plugin_method_in_a_fresh_process(tmp_path):
    from openrlhf_div.demo.warmup import VOCAB
    from openrlhf_div.tasks.demo import SplitSpec, write_splits

    write_splits(str(tmp_path / "data"), SplitSpec(seed=0, n_eval_regular=4))
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY.format(data=tmp_path / "data", vocab=VOCAB))
    cmd = [sys.executable, "-m", "openrlhf_div.cli.main", "train", "--config", str(cfg), f"output_dir={tmp_path / 'run'}"]
    # without the plug-in the method does not exist: the hook is what brings it
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "unknown method 'plugin_grpo'" in r.stderr, r.stderr[-2000:]
    r = subprocess.run(cmd[:4] + ["--plugin", FIXTURE] + cmd[4:], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [row["step"] for row in rows] == [1, 2]
    info = json.load(open(tmp_path / "run" / "run_info.json"))
    assert "plugin_grpo" in json.dumps(info)


def test_ray_driver_takes_the_plugin_before_parsing(capsys, monkeypatch):
    from openrlhf_div.engines.openrlhf import launch as L

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv(PL.ENV_VAR, "")
    base = ["--actor.model_name_or_path", "some/model", "--div.task", "math", "--rollout.n_samples_per_prompt",
            "4", "--rollout.batch_size", "8", "--train.batch_size", "32", "--dry-run"]
    assert L.main(["--plugin", FIXTURE, "--div.method", "plugin_grpo"] + base) == 0
    out = capsys.readouterr().out
    assert "plugin_grpo" in out and f"--plugin {FIXTURE}" in out  # the printed command keeps it
    assert os.environ[PL.ENV_VAR] == os.path.join(ROOT, FIXTURE)  # what the workers' runtime env carries


TASK_FIXTURE = os.path.join("tests", "fixtures", "plugins", "plugin_task.py")


def _forget_task(name):
    from openrlhf_div.tasks import base as TB

    TB._FACTORIES.pop(name, None)


def test_get_task_loads_the_plugins_of_the_environment(monkeypatch):
    from openrlhf_div.tasks import get_task, list_tasks

    monkeypatch.setenv(PL.ENV_VAR, os.path.join(ROOT, TASK_FIXTURE))
    try:
        assert "plugin_math" not in list_tasks()  # nothing imported it yet
        task = get_task("plugin_math", extract="lenient")  # a Ray reward worker's first call
        assert type(task).__name__ == "PluginMathTask" and task.reward("so 7", "7") == 1.0
    finally:
        _forget_task("plugin_math")
    monkeypatch.setenv(PL.ENV_VAR, "")
    with pytest.raises(ValueError, match="unknown task 'plugin_mth'"):
        get_task("plugin_mth")


def test_an_experiment_file_names_its_plugins_for_the_ray_driver(tmp_path, monkeypatch):
    """`plugins:` in an experiment file: a plug-in method and a plug-in task become --div.method /
    --div.task choices, the reward goes through reward_funcs/registered.py with OPENRLHF_DIV_TASK,
    and both reach the workers' runtime env; registered.py scores with the plug-in task."""
    from openrlhf_div.engines import flags as F
    from openrlhf_div.engines.openrlhf import launch as L
    from openrlhf_div.engines.openrlhf.jobs import job_runtime_env_vars

    monkeypatch.setenv(PL.ENV_VAR, "")
    monkeypatch.delenv(F.TASK_ENV, raising=False)
    cfg = tmp_path / "exp.yaml"
    cfg.write_text(f"extends: {ROOT}/configs/openrlhf/_tiny_cpu.yaml\nexperiment: plug\n"
                   f"plugins: [{os.path.join(ROOT, FIXTURE)}, {os.path.relpath(os.path.join(ROOT, TASK_FIXTURE), tmp_path)}]\n"
                   "method: {name: plugin_grpo}\ntask: plugin_math\n")
    try:
        p = L.plan(["--config", str(cfg), "--dry-run"])
        assert p.method.name == "plugin_grpo"
        assert p.args.reward.remote_url[0].endswith(os.path.join("reward_funcs", "registered.py"))
        env = job_runtime_env_vars()
        assert env[F.TASK_ENV] == "plugin_math" and TASK_FIXTURE in env[PL.ENV_VAR]
        from openrlhf_div.tasks.reward_funcs import registered

        monkeypatch.setenv("OPENRLHF_DIV_MATH_EXTRACT", "lenient")
        out = registered.reward_func(["1 + 2 = 3", "1 + 2 = 4"], ["1 + 2 =", "1 + 2 ="], ["3", "3"])
        assert out["rewards"].tolist() == [1.0, 0.0]
        assert F.reward_func_path("math").endswith(os.path.join("reward_funcs", "math.py"))  # its own file
    finally:
        _forget_task("plugin_math")
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"extends: {ROOT}/configs/openrlhf/_tiny_cpu.yaml\nplugins: {{a: 1}}\n")
    with pytest.raises(PL.PluginError, match="`plugins` takes a list"):
        L.plan(["--config", str(bad), "--dry-run"])


def test_a_local_config_names_its_plugins(tmp_path, monkeypatch):
    from openrlhf_div.engines.local.config import load_config

    monkeypatch.setenv(PL.ENV_VAR, "")
    cfg = tmp_path / "local.yaml"
    cfg.write_text(f"task: plugin_math\nplugins: [{os.path.relpath(os.path.join(ROOT, FIXTURE), tmp_path)}, "
                   f"{os.path.join(ROOT, TASK_FIXTURE)}]\nmethod: {{name: plugin_grpo}}\n")
    try:
        c = load_config(str(cfg))
        assert c.build_method().name == "plugin_grpo" and c.plugins[0] == os.path.join(ROOT, FIXTURE)
        from openrlhf_div.tasks import get_task

        assert type(get_task(c.task)).__name__ == "PluginMathTask"
    finally:
        _forget_task("plugin_math")
