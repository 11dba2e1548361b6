"""End to end: `openrlhf-div demo` on a tiny budget (2 methods, a few steps) writes a
metrics.json of the documented schema, the report and both plots; `compare` rebuilds
the same metrics from the run directories."""
import json
import os

import pytest

from openrlhf_div.cli.main import main

from helpers import DEMO_TINY as TINY  # noqa: E402 (tests/helpers.py)


@pytest.mark.slow
def test_demo_tiny_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = main(["demo", "--quick", "--out", str(out), "--methods", "grpo", "dph_f", "--seeds", "0",
               "--cache-dir", str(tmp_path / "cache"), "--no-progress", "--set", *TINY])
    assert rc == 0
    log = capsys.readouterr().out
    for stage in ("[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"):
        assert stage in log
    m = json.load(open(out / "metrics.json"))
    assert m["task"] == "demo"
    assert set(m["methods"]) == {"grpo", "dph_f"}
    keys = ("pass@1", "pass@8", "pass@16", "mean_styles", "keep_rate", "explore_rate")
    for M in [m["base"]] + list(m["methods"].values()):
        for k in keys:
            assert k in M, k
        assert 0.0 <= M["pass@1"] <= M["pass@8"] <= M["pass@16"] <= 1.0
        assert M["n_samples"] == 16 and M["n_problems"] == 20 + 90
        assert set(M["splits"]) == {"demo/regular", "demo/rare"}
        assert 0.0 <= M["mean_styles"] <= 5.0
    assert (m["base"]["keep_rate"], m["base"]["explore_rate"]) == (1.0, 0.0)
    for name in ("grpo", "dph_f"):
        assert m["methods"][name]["n_seeds"] == 1
        assert os.path.isfile(out / "runs" / name / "seed0" / "eval.json")
        assert os.path.isdir(out / "runs" / name / "seed0" / "final_model")
    for f in ("report.md", "passk.png", "styles.png"):
        assert os.path.getsize(out / f) > 0
    assert os.path.isfile(out / "presample" / "d_pef.jsonl")
    md = open(out / "report.md").read()
    assert "| dph_f |" in md and "Settings used" in md
    # the report states the form each method ran in (the demo keeps the spec's clean form)
    assert "`mode=the spec's clean form: " in md and "anchor_weighting=token_mean" in md

    # the eval.json files reproduce the demo's metrics through `compare`
    runs = [str(out / "runs" / "base")] + [str(out / "runs" / n / "seed0") for n in ("grpo", "dph_f")]
    assert main(["compare", *runs, "--out", str(tmp_path / "cmp")]) == 0
    c = json.load(open(tmp_path / "cmp" / "metrics.json"))
    for name in ("grpo", "dph_f"):
        for k in keys:
            assert c["methods"][name][k] == pytest.approx(m["methods"][name][k])

    # a second demo run reuses the base model and every finished run
    rc = main(["demo", "--quick", "--out", str(out), "--methods", "grpo", "dph_f", "--seeds", "0",
               "--cache-dir", str(tmp_path / "cache"), "--no-progress", "--set", *TINY])
    log = capsys.readouterr().out
    assert rc == 0 and "base model: cached" in log and log.count("reused") >= 3
