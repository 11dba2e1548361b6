"""Engine layout (``engine:``; openrlhf_div/engines/layout.py): step_layout and micro_batch_tokens
are the engines', not the method's; one default, one planner call site, the old ``div:`` spelling
read with a one-line deprecation, and the local engine refusing what it cannot honour by name."""
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


def test_a_method_refuses_layout_keys_naming_the_engine_key():
    for key, value in (("step_layout", "authors"), ("micro_batch_tokens", 64)):
        with pytest.raises(ValueError, match=rf"{key} is engine layout.*engine\.{key}"):
            get_method("dph_f", **{key: value})
        assert key not in get_method("dph_f").hparams


def test_engine_flags_and_the_deprecated_div_spelling(capsys):
    a = _parser().parse_args(["--engine.step_layout", "authors", "--engine.micro_batch_tokens", "300"])
    assert EngineLayout.from_args(a) == EngineLayout("authors", 300)
    assert capsys.readouterr().err == ""
    a = _parser().parse_args(["--div.step_layout", "authors", "--div.micro_batch_tokens", "none"])
    assert EngineLayout.from_args(a) == EngineLayout("authors", None)
    err = capsys.readouterr().err
    assert "`--div.step_layout` is deprecated" in err and "write `--engine.step_layout`" in err
    with pytest.raises(SystemExit):
        _parser().parse_args(["--engine.step_layout", "three"])


def test_config_engine_section_and_old_div_keys(capsys):
    from openrlhf_div.engines.openrlhf.launch import config_argv

    new = config_argv({"method": {"name": "dph_f"}, "engine": {"step_layout": "authors", "micro_batch_tokens": 64}})
    assert capsys.readouterr().err == ""  # the new spelling: no deprecation
    old = config_argv({"div": {"method": "dph_f", "step_layout": "authors", "micro_batch_tokens": 64}})
    err = capsys.readouterr().err.splitlines()
    assert err == ["openrlhf-div: `div.method` is deprecated and will be refused in the next release; write `method.name`",
                   "openrlhf-div: `div.step_layout` is deprecated and will be refused in the next release; write "
                   "`engine.step_layout`",
                   "openrlhf-div: `div.micro_batch_tokens` is deprecated and will be refused in the next release; write "
                   "`engine.micro_batch_tokens`"]
    for argv in (new, old):
        a = _parser().parse_args(argv)
        assert EngineLayout.from_args(a) == EngineLayout("authors", 64)
    assert "--div.step_layout" not in old
    with pytest.raises(ValueError, match=r"config section `engine`: unknown key\(s\) \['step_layouts'\]"):
        config_argv({"engine": {"step_layouts": "authors"}})


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

    with pytest.raises(ConfigError, match="engine.micro_batch_tokens=64: the local engine cannot honour"):
        config_from_dict({"task": "demo", "method": {"name": "grpo"}, "engine": {"micro_batch_tokens": 64}})
    with pytest.raises(ConfigError, match="unknown engine.step_layout 'three'|unknown engine.step_layout"):
        config_from_dict({"task": "demo", "method": {"name": "grpo"}, "engine": {"step_layout": "three"}})
    assert config_from_dict({"task": "demo", "method": {"name": "grpo"}}).engine.layout() == EngineLayout()
