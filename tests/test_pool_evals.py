"""benchmarks/pool_evals.py (issue 40): two evaluations of one model that differ only in their
evaluation seed pool into one evaluation with their samples together (pass@k up to the pooled n);
anything else is refused in one line."""
import importlib.util
import json
import os

import pytest

from openrlhf_div.eval.results import model_metrics, pass_at_k, write_eval_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("pool_evals", os.path.join(ROOT, "benchmarks", "pool_evals.py"))
P = importlib.util.module_from_spec(spec)
spec.loader.exec_module(P)

SETTINGS = {"n": 4, "ks": [1, 2, 4], "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8, "model": "/m",
            "data": {"hash": "h"}}


def _eval(path, pattern, eval_seed, role="base", settings=SETTINGS, seed=None):
    probs = [{"id": f"p{i}", "source": "s", "correct": [int(c) for c in pat]} for i, pat in enumerate(pattern)]
    write_eval_json(str(path), task="math", name="m", role=role, metrics=model_metrics(probs, is_base=role == "base"),
                    problems=probs, settings=settings, seed=seed, info={"eval_seed": eval_seed})
    return str(path)


def test_two_seeds_pool_into_one_evaluation_and_mismatches_are_refused(tmp_path, capsys):
    """Mutations: the 'given twice' check removed -> a repeated seed pools (this test fails); the
    correct lists taken from the first input only -> pass@8 is not computed (fails)."""
    a = _eval(tmp_path / "a", ["1000", "0000"], 0)
    b = _eval(tmp_path / "b", ["0000", "0001"], 1)
    assert P.main(["--out", str(tmp_path / "ab"), a, b]) == 0
    e = json.load(open(tmp_path / "ab" / "eval.json"))
    assert e["settings"]["n"] == 8 and e["settings"]["ks"] == [1, 2, 4, 8]
    assert e["problems"][0]["correct"] == [1, 0, 0, 0, 0, 0, 0, 0] and e["problems"][1]["n_correct"] == 1
    assert e["metrics"]["pass@8"] == pytest.approx(1.0)
    assert e["metrics"]["pass@4"] == pytest.approx(pass_at_k(8, 1, 4))  # 0.5 each: one right of 8
    assert e["metrics"]["pass@4"] == pytest.approx(1 - 35 / 70)  # by hand: 1 - C(7,4)/C(8,4)
    assert [x["eval_seed"] for x in e["info"]["pooled_from"]] == [0, 1]
    capsys.readouterr()
    for bad, msg in (([a, _eval(tmp_path / "c", ["1111", "0000"], 0)], "evaluation seed 0 given twice"),
                     ([a, _eval(tmp_path / "d", ["0000", "0000"], 1, settings={**SETTINGS, "temperature": 0.7})],
                      "settings temperature differ"),
                     ([a, _eval(tmp_path / "e", ["0000", "0000"], 1, role="trained", seed=1)], "role 'trained' differs")):
        assert P.main(["--out", str(tmp_path / "x"), *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "x").exists()  # a refusal writes nothing


def test_coverage_names_the_lost_and_gained_problems(tmp_path, capsys):
    """benchmarks/coverage.py: lost = the base solves it in >= min-base-rate of its samples and the model
    never; a base one-off (below the rate) is not lost; gained = the base never, the model at least once.
    Mutation: the rate condition dropped -> the one-off problem counts as lost (fails)."""
    spec2 = importlib.util.spec_from_file_location("coverage", os.path.join(ROOT, "benchmarks", "coverage.py"))
    C = importlib.util.module_from_spec(spec2)
    spec2.loader.exec_module(C)
    base = _eval(tmp_path / "b", ["1100", "1000", "0000", "1111"], 0)  # rates 0.5, 0.25, 0, 1
    model = _eval(tmp_path / "m", ["0000", "0000", "0100", "1111"], 0, role="trained", seed=1)
    c = C.coverage(C._load(base), C._load(model), min_base_rate=0.3)
    assert c["lost"] == ["p0"] and c["gained"] == ["p2"] and (c["base_solved"], c["model_solved"]) == (3, 2)
    assert C.main([base, model, "--min-base-rate", "0.3"]) == 0
    assert "| m (seed 1) | 4 / 4 | 3 of 4 | 2 | 1 | 0.500 | 1 |" in capsys.readouterr().out


def test_a_report_of_different_sample_counts_says_both(tmp_path):
    """compare --allow-mismatch of a pooled base (8 samples) and a model (4): the report's first line said
    "x 8 samples each"; it names both counts now. Mutation: `ns` forced empty -> "8 samples each" (fails)."""
    from openrlhf_div.eval.report import compare_runs

    a = _eval(tmp_path / "a", ["1000", "0000"], 0)
    b = _eval(tmp_path / "b", ["0000", "0001"], 1)
    assert P.main(["--out", str(tmp_path / "base"), a, b]) == 0
    m = _eval(tmp_path / "m", ["1100", "0000"], 0, role="trained", seed=1)
    md = open(compare_runs([str(tmp_path / "base"), m], str(tmp_path / "out"), allow_mismatch=True)["report"]).read()
    assert "2 evaluation problems x 8 samples (base) / 4 (methods) each;" in md, md[:600]
