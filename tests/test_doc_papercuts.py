"""Issue 43 item 6: what the docs and error lines told a newcomer to run, and what it did.
Each test fails on the behaviour the issue reports (df993e0)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_toy_refusal_proposes_a_command_that_runs(capsys):
    """`run llama8b_bird_dph_js --toy` (Ray) proposed `--engine local --toy` for it, which the local
    engine refuses (an anchor method on the SQL toy); the proposal is now a math experiment's."""
    from openrlhf_div.cli.main import main

    assert main(["run", "llama8b_bird_dph_js", "--toy"]) == 2
    err = capsys.readouterr().err
    local = re.search(r"`openrlhf-div run (\S+) --engine local --toy`", err)
    assert local and local.group(1) != "llama8b_bird_dph_js", err
    assert main(["run", local.group(1), "--engine", "local", "--toy", "--dry-run"]) == 0, capsys.readouterr().err


def test_a_presample_dir_one_level_off_names_the_setting(tmp_path):
    from openrlhf_div.engines.local.config import config_from_dict
    from openrlhf_div.engines.local.trainer import Trainer

    (tmp_path / "presample").mkdir()
    for f in ("d_pef.jsonl", "d_exp.jsonl"):
        (tmp_path / "presample" / f).write_text("")
    cfg = config_from_dict({"task": "toy_copy", "method": {"name": "dph_js"}, "model": {"tiny_vocab": "ab"},
                            "data": {"train": "x.jsonl", "presample_dir": str(tmp_path)}})
    me = SimpleNamespace(cfg=cfg, needs=SimpleNamespace(anchor_batch=True), method=SimpleNamespace(name="dph_js"))
    with pytest.raises(ValueError, match=rf"data.presample_dir={re.escape(str(tmp_path))}: no d_pef.jsonl there.*"
                                         rf"did you mean data.presample_dir={re.escape(str(tmp_path / 'presample'))}\?"):
        Trainer._data_paths(me)
    cfg.data.presample_dir = str(tmp_path / "presample")
    assert Trainer._data_paths(me) == (str(tmp_path / "presample" / "d_exp.jsonl"),
                                       str(tmp_path / "presample" / "d_pef.jsonl"))


def test_the_report_says_the_keep_k_it_used(tmp_path):
    from openrlhf_div.eval.report import build_metrics, write_report
    from openrlhf_div.eval.results import model_metrics

    problems = [{"id": f"p{i}", "source": "s", "correct": [i % 2, 1, 0, 0], "responses": ["a", "b", "c", "d"]}
                for i in range(4)]
    metrics = build_metrics("math", model_metrics(problems, is_base=True), {})
    write_report(str(tmp_path), metrics, keep_k=4)
    md = open(tmp_path / "report.md").read()
    assert "first 4 samples of each problem (one pass@4 draw)" in md and "first 8 samples" not in md


def test_run_help_has_no_stray_usage_line():
    env = dict(os.environ, COLUMNS="80", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "openrlhf_div.cli.main", "run", "--help"], env=env,
                         capture_output=True, text=True, timeout=120).stdout
    assert not [ln for ln in out.splitlines() if ln.strip() == "[--dry-run]"], out


def test_the_sql_toy_model_holds_its_prompts():
    """configs/toy/sql.yaml fed ~1,500-token prompts to a 512-position tiny model (its
    max_prompt_tokens: 2048 switched the context check off); the model now has the positions."""
    from openrlhf_div.engines import experiment as E
    from openrlhf_div.engines.local.config import config_from_dict

    cfg = E.load(E.find_experiment("llama8b_bird_grpo"), toy=True)
    data, _ = E.to_local(cfg, run_dir="/tmp/x", toy=True)
    data.pop("toy_sql_scripts", None)
    tc = config_from_dict(data)
    assert tc.data.max_prompt_tokens is None  # the model's context decides (max_prompt_tokens in data.py)
    longest = max(len(line) for line in open(tc.data.train))  # characters >= tokens of a character vocabulary
    assert tc.model.tiny_max_positions >= min(longest, 1600) + tc.rollout.max_new_tokens


def test_run_on_the_local_engine_outside_the_checkout_finds_the_tiny_model(tmp_path, capsys, monkeypatch):
    """`run tiny_cpu_grpo --engine local` looked for runs/tiny_cpu/model under the working directory."""
    from openrlhf_div.cli.main import main

    monkeypatch.chdir(tmp_path)
    for var in ("TINY_MODEL", "DATA_DIR", "RUN_DIR"):
        monkeypatch.delenv(var, raising=False)
    assert main(["run", "tiny_cpu_grpo", "--engine", "local", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"path: {os.path.join(ROOT, 'runs', 'tiny_cpu', 'model')}" in out, out


def test_algorithms_md_names_the_measurement_script_where_it_is():
    text = open(os.path.join(ROOT, "docs", "ALGORITHMS.md")).read()
    assert "scripts/measure_authors_diffs.py" not in text.replace("benchmarks/measure_authors_diffs.py", "")
    assert os.path.isfile(os.path.join(ROOT, "benchmarks", "measure_authors_diffs.py"))


def test_plugins_md_names_configs_that_exist():
    text = open(os.path.join(ROOT, "docs", "plugins.md")).read()
    for path in re.findall(r"configs/[\w./-]+\.yaml", text):
        assert os.path.isfile(os.path.join(ROOT, path)), path
