"""openrlhf_div.config, the one loader of the local engine, the demo and the OpenRLHF/Megatron
drivers: extends (chains, relative paths, cycles), overrides, ${VAR:-default}, duplicate keys,
and malformed YAML reported as one line naming file:line:column, also through the real CLIs."""
import os
import subprocess
import sys

import pytest

from openrlhf_div.config import ConfigError, deep_merge, expand_env, expand_tree, load, parse_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _w(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_extends_chain_relative_paths_and_list_replacement(tmp_path):
    _w(tmp_path / "base" / "root.yaml", "a: 1\nb: {x: 1, y: 2}\nl: [1, 2]\n")
    _w(tmp_path / "base" / "mid.yaml", "extends: root.yaml\nb: {y: 3}\n")            # relative to base/
    leaf = _w(tmp_path / "exp" / "leaf.yaml", "extends: ../base/mid.yaml\nl: [9]\nc: z\n")
    assert load(leaf) == {"a": 1, "b": {"x": 1, "y": 3}, "l": [9], "c": "z"}
    # several parents merge in order, the file itself last
    _w(tmp_path / "exp" / "other.yaml", "a: 2\nd: 4\n")
    multi = _w(tmp_path / "exp" / "multi.yaml", "extends: [../base/mid.yaml, other.yaml]\nd: 5\n")
    assert load(multi) == {"a": 2, "b": {"x": 1, "y": 3}, "l": [1, 2], "d": 5}


def test_extends_cycle_and_missing_parent_are_reported(tmp_path):
    a = _w(tmp_path / "a.yaml", "extends: b.yaml\n")
    _w(tmp_path / "b.yaml", "extends: a.yaml\n")
    with pytest.raises(ConfigError, match=r"`extends` cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load(a)
    c = _w(tmp_path / "c.yaml", "extends: nothere.yaml\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: extends .*nothere\.yaml.*does not exist"):
        load(c)
    with pytest.raises(ConfigError, match="does not exist"):
        load(str(tmp_path / "missing.yaml"))


def test_overrides_parse_as_yaml_and_merge(tmp_path):
    p = _w(tmp_path / "c.yaml", "train: {optim: {steps: 10, lr: 1}}\nk: [1]\n")
    cfg = load(p, ["train.optim.steps=50", "k=[1, 4]", "flag=true", "x.y=1e-3", "n=null"])
    assert cfg == {"train": {"optim": {"steps": 50, "lr": 1}}, "k": [1, 4], "flag": True,
                   "x": {"y": 0.001}, "n": None}
    assert parse_overrides(["a.b=1", "a.c=x"]) == {"a": {"b": 1, "c": "x"}}
    with pytest.raises(ConfigError, match="must look like key=value"):
        parse_overrides(["novalue"])
    with pytest.raises(ConfigError, match="conflicts"):
        parse_overrides(["a=1", "a.b=2"])
    assert deep_merge({"a": {"b": 1}}, {"a": {"c": 2}}) == {"a": {"b": 1, "c": 2}}


def test_yaml_12_floats_are_floats_in_files_and_overrides(tmp_path, monkeypatch):
    """PyYAML (YAML 1.1) reads `1e-3` as the string "1e-3"; the one loader reads YAML 1.2's floats
    as floats in every file and every key=value override, and a method hyperparameter given so is
    the float 0.001 in the local TrainConfig (its section and its built method) and on the Ray
    driver (the namespace the loader filled, and the method built from it)."""
    from openrlhf_div.engines import experiment as E
    from openrlhf_div.engines.flags import method_from_args
    from openrlhf_div.engines.local.config import config_from_dict, load_config
    from openrlhf_div.engines.openrlhf import launch as L

    p = _w(tmp_path / "c.yaml", "lr: 1e-3\nbig: 1E+5\nneg: -2e3\nhalf: -.5\nkeep: '1e3'\nold: 1.5e-3\nname: e5\n")
    cfg = load(p, ["o=2e-5"])
    assert cfg == {"lr": 0.001, "big": 100000.0, "neg": -2000.0, "half": -0.5, "keep": "1e3", "old": 0.0015,
                   "name": "e5", "o": 2e-5}
    assert type(cfg["lr"]) is float and type(cfg["o"]) is float
    local = _w(tmp_path / "l.yaml", "task: countdown\nmethod: {name: dph_js}\noptim: {learning_rate: 1e-3}\n")
    tc = load_config(local, ["method.anchor_eta=1e-3"])
    assert tc.optim.learning_rate == 0.001
    assert type(tc.method["anchor_eta"]) is float and tc.method["anchor_eta"] == 0.001
    assert tc.build_method().hparams["anchor_eta"] == 0.001
    # a quoted number reaches the section as the string; the one coercion makes it the float
    assert config_from_dict({"task": "countdown", "method": {"name": "dph_js", "anchor_eta": "1e-3"}}
                            ).method["anchor_eta"] == 0.001
    for var in ("DATA_DIR", "RUN_DIR", "PRESAMPLE_DIR", "SEED", "TINY_MODEL"):
        monkeypatch.delenv(var, raising=False)
    exp = E.find_experiment("tiny_cpu_dph_js")
    plan = L.plan(["--config", exp, "method.anchor_eta=1e-3", "--dry-run"])
    assert type(plan.args.div.anchor_eta) is float and plan.args.div.anchor_eta == 0.001  # the loader's value
    assert method_from_args(plan.args).hparams["anchor_eta"] == 0.001 == plan.method.hparams["anchor_eta"]


def test_variables(monkeypatch):
    monkeypatch.setenv("OPENRLHF_DIV_T", "/abs")
    monkeypatch.delenv("OPENRLHF_DIV_U", raising=False)
    assert expand_env("${OPENRLHF_DIV_T}/x ${OPENRLHF_DIV_U:-dflt}") == "/abs/x dflt"
    assert expand_tree({"a": ["${OPENRLHF_DIV_T}", 3], "b": {"c": "${OPENRLHF_DIV_U:-d}"}}) == \
        {"a": ["/abs", 3], "b": {"c": "d"}}
    with pytest.raises(ConfigError, match=r"\$\{OPENRLHF_DIV_U\}, which is not set"):
        expand_env("${OPENRLHF_DIV_U}")


@pytest.mark.parametrize("text,line,col,problem", [
    ("a: 1\nb: [1, 2\nc: 3\n", 3, 2, "expected ',' or ']'"),
    ("a: 1\n  b: 2\n", 2, 4, "mapping values are not allowed here"),
    ("a:\n  x: 1\n  x: 2\n", 3, 3, "duplicate key 'x' (first at line 2)"),
    ("- 1\n- 2\n", 1, 1, "holds a YAML mapping"),
])
def test_malformed_yaml_is_one_line_with_file_line_column(tmp_path, text, line, col, problem):
    p = _w(tmp_path / "bad.yaml", text)
    with pytest.raises(ConfigError) as e:
        load(p)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{p}:{line}:{col}: ") and problem in msg, msg


def test_the_engines_read_through_the_one_loader(tmp_path):
    """extends works for every kind of config, and a malformed file fails the same way in each."""
    from openrlhf_div.demo.pipeline import load_demo_config
    from openrlhf_div.engines.local.config import load_config
    from openrlhf_div.engines.openrlhf import launch

    base = _w(tmp_path / "local_base.yaml", "task: test_copy_last\nmethod: {name: dph_js, anchor_eta: 0.05}\n")
    child = _w(tmp_path / "local.yaml", f"extends: {os.path.basename(base)}\nmethod: {{name: grpo}}\nseed: 3\n")
    cfg = load_config(child, ["optim.steps=2"])
    assert cfg.method == {"name": "grpo"} and cfg.seed == 3 and cfg.optim.steps == 2   # switching drops anchor_eta
    demo = _w(tmp_path / "demo.yaml", f"extends: {os.path.join(ROOT, 'configs', 'demo.yaml')}\nseeds: [5]\n")
    assert load_demo_config(demo)["seeds"] == [5]
    exp = _w(tmp_path / "exp.yaml", f"extends: {os.path.join(ROOT, 'configs', 'openrlhf', 'tiny_cpu_grpo.yaml')}\n"
                                   "method: {name: rkl}\n")
    assert launch.load_config(exp)["method"] == {"name": "rkl"} and launch.load_config(exp)["task"] == "math"
    old = _w(tmp_path / "old.yaml", f"extends: {os.path.join(ROOT, 'configs', 'openrlhf', 'tiny_cpu_grpo.yaml')}\n"
                                   "div: {method: rkl}\n")  # the old spelling over a base in the new one
    with pytest.raises(ValueError, match="div.method=rkl and method.name=grpo"):
        launch.config_argv(launch.load_config(old))
    typo = _w(tmp_path / "typo.yaml", "opnerlhf: {}\n")
    with pytest.raises(ConfigError, match="Did you mean 'openrlhf'"):
        launch.load_config(typo)
    bad = _w(tmp_path / "bad.yaml", "task: x\nmethod: {name: grpo\n")
    for fn in (lambda: load_config(bad), lambda: load_demo_config(bad), lambda: launch.load_config(bad)):
        with pytest.raises(ConfigError, match=r"bad\.yaml:3:1: malformed YAML"):
            fn()


@pytest.mark.parametrize("argv", [
    [sys.executable, "-m", "openrlhf_div.cli.main", "train", "--config", "{bad}"],
    [sys.executable, "-m", "openrlhf_div.cli.main", "demo", "--config", "{bad}", "--out", "{tmp}/demo"],
    [sys.executable, "-m", "openrlhf_div.cli.train_ppo_ray", "--config", "{bad}", "--dry-run"],
], ids=["train", "demo", "train_ppo_ray"])
def test_cli_prints_one_line_and_exits_2_on_malformed_yaml(tmp_path, argv):
    bad = _w(tmp_path / "bad.yaml", "task: x\nrollout:\n  group_size: 4\n   temperature: 1.0\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([a.format(bad=bad, tmp=tmp_path) for a in argv], capture_output=True, text=True,
                       env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert f"{bad}:4:" in lines[0] and "malformed YAML" in lines[0], lines[0]
    assert "Traceback" not in r.stderr


def test_launchers_ask_the_loader_for_the_presample_stage(tmp_path):
    """_common.sh's has_presample resolves extends (the stage may sit in a family base) and stops
    the launcher when the config cannot be read, instead of silently skipping the stage."""
    from openrlhf_div.config import NO_SECTION, main

    assert main(["--section", "presample", os.path.join(ROOT, "configs", "openrlhf", "tiny_cpu_dph_js.yaml")]) == 0
    assert main(["--section", "presample", os.path.join(ROOT, "configs", "openrlhf", "tiny_cpu_grpo.yaml")]) == NO_SECTION
    _w(tmp_path / "_base.yaml", "presample: {n_pre: 4}\n")
    child = _w(tmp_path / "child.yaml", "extends: _base.yaml\n")
    common = os.path.join(ROOT, "examples", "scripts", "_common.sh")

    def has(path, python=sys.executable):
        return subprocess.run(["bash", "-c", f'source "{common}"; if has_presample "$1"; then echo yes; else echo no; fi',
                               "_", path], capture_output=True, text=True, env=dict(os.environ, PYTHON=python))
    assert has(child).stdout.strip() == "yes"
    assert has(os.path.join(ROOT, "configs", "openrlhf", "tiny_cpu_grpo.yaml")).stdout.strip() == "no"
    bad = has(_w(tmp_path / "bad.yaml", "a: [1\n"))
    assert bad.returncode == 2 and "bad.yaml:2:1: malformed YAML" in bad.stderr and "yes" not in bad.stdout
    assert has(child, python="/nonexistent/python").returncode == 2
