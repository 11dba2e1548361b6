"""Package-level checks: the public API surface, import hygiene, the CLI entry point."""
import inspect
import json
import subprocess
import sys

import pytest

from openrlhf_div.cli.main import main


def test_public_api_names_and_signatures():
    """ALGORITHMS.md section 8: exactly these names with these parameters and defaults."""
    import openrlhf_div.algorithms as A
    from openrlhf_div.eval import pass_at_k

    expected = {
        "f_divergence": ["name", "log_u", "alpha=None"],
        "dph_anchor_loss": ["log_probs", "ref_log_probs", "mask", "divergence='forward_kl'", "alpha=0.5"],
        "lad_loss": ["log_probs", "old_log_probs", "advantages", "mask", "divergence='js'", "eta=0.25"],
        "ds_reshape_advantages": ["advantages", "correct", "old_log_probs", "mask", "gamma_p=0.01",
                                  "gamma_n=0.01", "granularity='token'"],
        "group_advantages": ["rewards", "group_size", "estimator='grpo'"],
        "passk_advantages": ["rewards", "group_size", "k=4"],
        "unlikeliness_rewards": ["rewards", "seq_mean_log_probs", "group_size", "beta=0.25"],
    }
    for name, params in expected.items():
        sig = inspect.signature(getattr(A, name))
        got = [str(p).split(":")[0].replace(" ", "") if p.default is inspect.Parameter.empty
               else f"{p.name}={p.default!r}" for p in sig.parameters.values()]
        # extra keyword-only options may follow the specified ones
        assert got[: len(params)] == params, (name, got)
    assert [p for p in inspect.signature(pass_at_k).parameters] == ["n", "c", "k"]


def test_algorithms_import_without_heavy_stacks():
    """The algorithm library must import without Ray, vLLM or OpenRLHF (run in a clean process)."""
    code = (
        "import sys, openrlhf_div.algorithms, openrlhf_div.eval;"
        "bad=[m for m in ('ray','vllm','openrlhf','deepspeed','transformers') if m in sys.modules];"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"heavy modules imported: {out.stdout}"


def test_cli_methods_json_lists_every_preset(capsys):
    from openrlhf_div.algorithms import list_methods

    assert main(["methods", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert sorted(table) == sorted(list_methods())
    assert table["dph_f"]["needs"]["anchor_batch"] is True
    assert table["dph_f"]["needs"]["ref_log_probs"] is False


def test_cli_unknown_method_names_valid_ones(capsys):
    assert main(["methods", "dph_jss"]) == 2
    err = capsys.readouterr().err
    assert "unknown method 'dph_jss'" in err and "dph_js" in err


def test_cli_without_command_prints_help(capsys):
    assert main([]) == 2
    assert "methods" in capsys.readouterr().out
