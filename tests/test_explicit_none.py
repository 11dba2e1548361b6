"""An explicit ``none`` / ``null`` reaches the method as ``None`` on every engine (issue 23,
item 2): the hyperparameters whose value in the authors' code -- or in the spec, where a paper
config sets the authors' non-None value -- is None (docs/ALGORITHMS.md section 9).

Paths: the OpenRLHF / Megatron driver's ``--div.<name> none`` flag and a config's ``div:
<name>: null`` (both engines build the method with ``flags.method_from_args``; the Megatron actor
through ``resolve_method``), the Megatron actor's ``div.hparams`` list, and the local engine's
``method:`` section and ``method.<name>=none`` override. Cheap: argparse and the registry only.
"""
from __future__ import annotations

import argparse
import types

import pytest
import torch

from openrlhf_div.algorithms.registry import get_method
from openrlhf_div.engines.local.config import config_from_dict
from openrlhf_div.engines.megatron.actor import resolve_method
from openrlhf_div.engines.openrlhf import launch as L
from openrlhf_div.engines.flags import add_div_arguments, method_from_args

# (method, hyperparameter, a non-None value a config may have set first). dual_clip and
# flowrl_max_weight: the authors' value is None (Clip-Cov / CISPO without dual clip, FlowRL's
# unclipped weight); js_def_clamp, lad_clip, overlong_max_len: the spec's value is None, the
# authors' not (a paper config sets it; `none` takes it back).
OPTIONS = [
    ("clip_cov", "dual_clip", 3.0),
    ("grpo", "dual_clip", 3.0),
    ("flowrl", "flowrl_max_weight", 10.0),
    ("dph_js_def", "js_def_clamp", 10.0),
    ("lad_js", "lad_clip", (0.2, 0.28)),
    ("dapo", "overlong_max_len", 4096),
]


def _flags(value) -> list:
    return [str(x) for x in value] if isinstance(value, tuple) else [str(value)]


def _parse(argv):
    p = argparse.ArgumentParser()
    add_div_arguments(p)
    return p.parse_args(argv)


@pytest.mark.parametrize("method,name,value", OPTIONS, ids=[f"{m}-{n}" for m, n, _ in OPTIONS])
def test_explicit_none_reaches_the_method_on_every_engine(method, name, value, tmp_path):
    # the non-None value first goes through, so None below is the override, not a default
    set_args = _parse(["--div.method", method, f"--div.{name}", *_flags(value)])
    assert method_from_args(set_args).hparams[name] == value
    if method != "dapo":
        assert get_method(method).hparams[name] is None or get_method(method).hparams[name] == value

    # OpenRLHF / Megatron driver flags
    for word in ("none", "null", "None"):
        args = _parse(["--div.method", method, f"--div.{name}", word])
        assert method_from_args(args).hparams[name] is None, word
        assert resolve_method(args).hparams[name] is None  # the Megatron actor, same namespace

    # a config: a family base sets the value, the experiment sets null
    base = tmp_path / "_base.yaml"
    base.write_text(f"div:\n  method: {method}\n  {name}: {list(value) if isinstance(value, tuple) else value}\n")
    exp = tmp_path / "exp.yaml"
    exp.write_text(f"extends: _base.yaml\ndiv:\n  {name}: null\n")
    argv = L.config_argv(L.load_config(str(exp)))
    assert argv[argv.index(f"--div.{name}") + 1] == "none"
    assert method_from_args(_parse(argv)).hparams[name] is None
    assert method_from_args(_parse(L.config_argv(L.load_config(str(base))))).hparams[name] == value

    # the Megatron actor's own override list (key=value, YAML-parsed)
    div = types.SimpleNamespace(method=method, hparams=[f"{name}=none"])
    assert resolve_method(types.SimpleNamespace(div=div)).hparams[name] is None
    div = types.SimpleNamespace(method=method, hparams=[f"{name}=null"])
    assert resolve_method(types.SimpleNamespace(div=div)).hparams[name] is None

    # the local engine: the method section and a key=value override
    v = list(value) if isinstance(value, tuple) else value
    cfg = config_from_dict({"task": "demo", "method": {"name": method, name: v}}, [f"method.{name}=none"])
    assert cfg.build_method().hparams[name] is None
    cfg = config_from_dict({"task": "demo", "method": {"name": method, name: None}})
    assert cfg.build_method().hparams[name] is None


def test_none_changes_the_loss_dual_clip_and_flowrl_weight():
    """The None reaches the loss: no dual clip (a negative advantage at ratio e^2 keeps its
    full gradient) and FlowRL's unclipped importance weight."""
    lp = torch.tensor([[2.0]], requires_grad=True)
    old, adv, mask = torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1)
    from openrlhf_div.algorithms.registry import LossInputs

    def grad(m):
        lp.grad = None
        loss, _ = m.loss(online=LossInputs(log_probs=lp, old_log_probs=old, advantages=adv, mask=mask))
        loss.backward()
        return float(lp.grad)

    args = _parse(["--div.method", "clip_cov", "--div.dual_clip", "none", "--div.eps_low", "1",
                   "--div.eps_high", "1", "--div.clip_cov_ratio", "0"])
    no_dual = grad(method_from_args(args))
    with_dual = grad(method_from_args(_parse(["--div.method", "clip_cov", "--div.eps_low", "1",
                                              "--div.eps_high", "1", "--div.clip_cov_ratio", "0"])))
    assert with_dual == 0.0  # ratio e^2 > 3 with A < 0: the dual clip's constant
    assert no_dual == pytest.approx(float(torch.exp(torch.tensor(2.0))), rel=1e-6)  # -A r d(log r)

    m = method_from_args(_parse(["--div.method", "flowrl", "--div.flowrl_max_weight", "null"]))
    assert m.hparams["flowrl_max_weight"] is None


def test_lad_clip_flag_rejects_one_number():
    with pytest.raises(ValueError, match="two numbers"):
        method_from_args(_parse(["--div.method", "lad_js", "--div.lad_clip", "0.2"]))
