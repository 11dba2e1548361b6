"""Micro-batch layout (``layout:``; openrlhf_div/engines/layout.py): step_layout and micro_batch_tokens
are the engines', not the method's; one default, one planner call site, the old ``div:`` spelling
read with a one-line deprecation, the section's old name ``engine:`` read as ``layout:`` with one
stderr line, and the local engine refusing what it cannot honour by name."""
from __future__ import annotations

import argparse
import inspect
import os

import pytest

from openrlhf_div.algorithms import get_method
from openrlhf_div.algorithms.authors import plan_micro_batches
from openrlhf_div.engines.flags import add_div_arguments
from openrlhf_div.engines.layout import LAYOUT_KEYS, EngineLayout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parser():
    p = argparse.ArgumentParser()
    add_div_arguments(p)
    return p


def test_one_default_for_the_layout():
    """The planner's own default, the layout's and the flag help agree (they disagreed: the
    planner said "authors", the registry "spread"; docs/ALGORITHMS.md section 9: spread)."""
    sig = inspect.signature(plan_micro_batches).parameters
    assert sig["step_layout"].default == EngineLayout().step_layout == LAYOUT_KEYS["step_layout"][0] == "spread"
    assert sig["micro_batch_tokens"].default is EngineLayout().micro_batch_tokens is None
    assert EngineLayout.from_args(_parser().parse_args([])) == EngineLayout()


def test_a_method_refuses_layout_keys_naming_the_layout_key():
    for key, value in (("step_layout", "authors"), ("micro_batch_tokens", 64)):
        with pytest.raises(ValueError, match=rf"{key} is micro-batch layout.*layout\.{key}"):
            get_method("dph_f", **{key: value})
        assert key not in get_method("dph_f").hparams


def test_layout_flags_and_the_deprecated_div_spelling(capsys):
    a = _parser().parse_args(["--engine.step_layout", "authors", "--engine.micro_batch_tokens", "300"])
    assert EngineLayout.from_args(a) == EngineLayout("authors", 300)
    a = _parser().parse_args(["--layout.step_layout", "authors", "--layout.micro_batch_tokens", "300"])
    assert EngineLayout.from_args(a) == EngineLayout("authors", 300)  # the new spelling, same namespace
    assert capsys.readouterr().err == ""
    a = _parser().parse_args(["--div.step_layout", "authors", "--div.micro_batch_tokens", "none"])
    assert EngineLayout.from_args(a) == EngineLayout("authors", None)
    err = capsys.readouterr().err
    assert "`--div.step_layout` is deprecated" in err and "write `--layout.step_layout`" in err
    with pytest.raises(SystemExit):
        _parser().parse_args(["--engine.step_layout", "three"])


def test_config_layout_section_and_old_div_keys(capsys):
    from openrlhf_div.engines.openrlhf.launch import config_argv

    new = config_argv({"method": {"name": "dph_f"}, "layout": {"step_layout": "authors", "micro_batch_tokens": 64}})
    assert capsys.readouterr().err == ""  # the new spelling: no deprecation
    old = config_argv({"div": {"method": "dph_f", "step_layout": "authors", "micro_batch_tokens": 64}})
    err = capsys.readouterr().err.splitlines()
    assert err == ["openrlhf-div: `div.method` is deprecated and will be refused in the next release; write `method.name`",
                   "openrlhf-div: `div.step_layout` is deprecated and will be refused in the next release; write "
                   "`layout.step_layout`",
                   "openrlhf-div: `div.micro_batch_tokens` is deprecated and will be refused in the next release; write "
                   "`layout.micro_batch_tokens`"]
    for argv in (new, old):
        a = _parser().parse_args(argv)
        assert EngineLayout.from_args(a) == EngineLayout("authors", 64)
    assert "--div.step_layout" not in old
    with pytest.raises(ValueError, match=r"config section `layout`: unknown key\(s\) \['step_layouts'\]"):
        config_argv({"layout": {"step_layouts": "authors"}})


def test_layout_reaches_the_planner_of_both_engines(monkeypatch):
    """The OpenRLHF actor's and the Megatron actor's planners are one call site
    (EngineLayout.plan) reading the run's layout, not the method's hyperparameters."""
    import torch

    from openrlhf_div.engines.layout import EngineLayout as EL

    seen = []
    real = EL.plan

    def spy(self, method, is_anchor, tokens=None, **kw):
        seen.append(self)
        return real(self, method, is_anchor, tokens, **kw)

    monkeypatch.setattr(EL, "plan", spy)
    method = get_method("dph_f", aggregation="micro-batch-token-mean", anchor_weighting="microbatch_share")
    layout = EngineLayout("authors", None)
    from openrlhf_div.engines.megatron.actor import authors_steps

    rows = [dict(sequences=torch.ones(4, dtype=torch.long), attention_mask=torch.ones(4, dtype=torch.long),
                 action_mask=torch.ones(3), is_anchor=torch.tensor(i >= 4)) for i in range(6)]
    steps = authors_steps(rows, method, 4, layout=layout)
    assert [len(s) for s in steps] == [2, 1]  # authors: rollouts, then the anchors in a step of their own
    assert seen == [layout]
    steps = authors_steps(rows, method, 4, layout=EngineLayout())
    assert [len(s) for s in steps] == [3]  # spread: one step with both kinds
    pytest.importorskip("openrlhf")
    from openrlhf_div.engines.openrlhf.loss import authors_micro_batches

    seen.clear()
    out = list(authors_micro_batches(list(range(6)), method, layout, mini_batch_rows=4, gas=2,
                                     collate=lambda items: items, anchor_fn=lambda i: i >= 4, tokens_fn=lambda i: 4))
    assert seen == [layout] and [mb for mb, _ in out] == [[0, 1], [2, 3], [4, 5]]


def test_uses_authors_layout_has_one_definition():
    hits = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "openrlhf_div")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f)) as fh:
                    if "def uses_authors_layout" in fh.read():
                        hits.append(f)
    assert hits == ["layout.py"]


def test_local_engine_refuses_a_layout_by_name():
    from openrlhf_div.engines.local.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="layout.micro_batch_tokens=64: the local engine cannot honour"):
        config_from_dict({"task": "demo", "method": {"name": "grpo"}, "layout": {"micro_batch_tokens": 64}})
    with pytest.raises(ConfigError, match="unknown layout.step_layout 'three'|unknown layout.step_layout"):
        config_from_dict({"task": "demo", "method": {"name": "grpo"}, "layout": {"step_layout": "three"}})
    assert config_from_dict({"task": "demo", "method": {"name": "grpo"}}).layout.to_layout() == EngineLayout()


def test_the_old_section_name_engine_still_loads_as_layout(tmp_path, monkeypatch, capsys):
    """"engine" is the trainer (`run --engine`, run_info.json's engine); the micro-batch layout is
    `layout:`. An experiment file, a saved local config and a key=value override in the old spelling
    `engine:` load as `layout:`, with one stderr line naming the new key, once per process; the Ray
    driver's command line is the same as from the new spelling (`--engine.*` flags, as printed before)."""
    from openrlhf_div import config as C
    from openrlhf_div.engines import experiment as E
    from openrlhf_div.engines.local.config import config_from_dict, load_config
    from openrlhf_div.engines.openrlhf import launch as L

    monkeypatch.setattr(C, "_TOLD", set())  # this process has not been told yet
    for var in ("DATA_DIR", "RUN_DIR", "PRESAMPLE_DIR", "SEED", "TINY_MODEL"):
        monkeypatch.delenv(var, raising=False)
    base = E.find_experiment("tiny_cpu_dph_js")
    old = tmp_path / "old.yaml"
    old.write_text(f"extends: {base}\nengine:\n  step_layout: authors\n  micro_batch_tokens: 64\n")
    new = tmp_path / "new.yaml"
    new.write_text(f"extends: {base}\nlayout:\n  step_layout: authors\n  micro_batch_tokens: 64\n")
    cfg = E.load(str(old))
    assert "engine" not in cfg and cfg["layout"] == {"step_layout": "authors", "micro_batch_tokens": 64}
    assert capsys.readouterr().err == "config section engine: is now layout: (same keys)\n"
    assert cfg == E.load(str(new))
    p_old, p_new = (L.plan(["--config", str(f), "--dry-run"]) for f in (old, new))
    assert p_old.argv == p_new.argv and "--engine.step_layout" in p_old.argv
    over = L.plan(["--config", base, "engine.step_layout=authors", "engine.micro_batch_tokens=64", "--dry-run"])
    assert over.argv == L.plan(["--config", base, "layout.step_layout=authors", "layout.micro_batch_tokens=64",
                                "--dry-run"]).argv
    assert E.load(base, ["engine.step_layout=authors"])["layout"] == {"step_layout": "authors"}
    with pytest.raises(C.ConfigError, match="unknown config key 'layout.step_layot'"):  # judged as the new key
        E.load(base, ["engine.step_layot=authors"])
    # the local engine: a saved config.yaml of an earlier release, a file and an override in the old spelling
    assert config_from_dict({"task": "demo", "method": {"name": "grpo"},
                             "engine": {"mixed_micro_batches": "separate"}}).layout.to_layout() == EngineLayout()
    local = tmp_path / "local.yaml"
    local.write_text("task: demo\nmethod: {name: grpo}\nengine: {step_layout: spread}\n")
    assert load_config(str(local), ["engine.micro_batch_tokens=null"]).layout.to_layout() == EngineLayout()
    assert capsys.readouterr().err == ""  # told once per process
    # the new spelling beside the old one in one mapping: the new wins
    assert C.renamed_sections({"engine": {"step_layout": "authors", "micro_batch_tokens": 8},
                               "layout": {"step_layout": "spread"}}) == {
        "layout": {"step_layout": "spread", "micro_batch_tokens": 8}}
