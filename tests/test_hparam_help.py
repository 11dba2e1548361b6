"""Every method hyperparameter declares one line of help and its source where its component is
registered; ``--help``, ``openrlhf-div methods NAME`` and docs/hyperparameters.md read it there."""
from __future__ import annotations

import argparse
import os

import pytest

from openrlhf_div.algorithms import get_method, list_methods
from openrlhf_div.algorithms.registry import hparam_help, register_policy_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_builtin_hyperparameter_has_help_and_a_source():
    helps = hparam_help(builtin_only=True)
    assert {"anchor_eta", "eps_high", "lad_eta", "gamma_p", "micro_batch_seqs"} <= set(helps)
    for k, h in helps.items():
        assert h["help"].strip() and h["source"].strip(), f"{k} ({h['owners']}) declares no help or source"
        assert "\n" not in h["help"] + h["source"]
    builtin = [n for n in list_methods() if all(
        getattr(c.fn, "__module__", "").startswith("openrlhf_div.") for c in get_method(n).components())]
    assert len(builtin) >= 30
    for name in builtin:
        assert set(get_method(name).hparams) <= set(helps), name


def test_a_registration_checks_its_help():
    with pytest.raises(ValueError, match="help for 'epz', which is not one of its hyperparameters"):
        register_policy_loss("w31_bad_help", defaults={"eps": 0.2}, help={"epz": ("x", "y")})
    with pytest.raises(ValueError, match=r"help\['eps'\] takes \(one line of help, its source\)"):
        register_policy_loss("w31_bad_help", defaults={"eps": 0.2}, help={"eps": "only a line"})


def test_flag_help_and_methods_read_the_declaration(capsys):
    from openrlhf_div.cli.main import main
    from openrlhf_div.engines.flags import add_div_arguments

    p = argparse.ArgumentParser()
    add_div_arguments(p)
    text = " ".join(p.format_help().split())
    h = hparam_help()["anchor_eta"]
    assert h["help"] in text and h["source"] in text
    assert main(["methods", "dph_js"]) == 0
    out = capsys.readouterr().out
    assert '"hyperparameters"' in out and h["source"] in out


def test_docs_table_is_the_registry_output():
    from openrlhf_div.cli.methods import hparam_markdown

    with open(os.path.join(ROOT, "docs", "hyperparameters.md")) as fh:
        assert fh.read() == hparam_markdown(), "regenerate: openrlhf-div methods --hparams > docs/hyperparameters.md"
