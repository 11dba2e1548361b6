"""Per-model metrics, eval.json, metrics.json / report.md / plots and `compare`, checked
against independent computations on synthetic per-model results."""
import json
import math
import os
import random
import statistics

import pytest

from openrlhf_div.eval.report import aggregate_seeds, build_metrics, compare_runs, write_report
from openrlhf_div.eval.results import model_metrics, read_eval_json, write_eval_json

STYLES = ("A", "B", "C", "D", "E")
SETTINGS = {"n": 16, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 10, "keep_k": 8, "grading": "demo",
            "data": {"hash": "abc"}}


def passk_ref(n, c, k):
    """Independent unbiased pass@k: 1 - C(n-c, k) / C(n, k) with exact integers."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def fake_problems(seed, n=16, n_problems=12, style_w=(35, 25, 20, 12, 8, 1), acc=0.6):
    rng = random.Random(seed)
    out = []
    for i in range(n_problems):
        src = "demo/rare" if i % 3 == 0 else "demo/regular"
        styles = [rng.choices(list(STYLES) + ["other"], weights=style_w)[0] for _ in range(n)]
        correct = [int(s != "other" and (src != "demo/rare" or s == "E") and rng.random() < acc) for s in styles]
        out.append({"id": f"p{i}", "source": src, "correct": correct, "styles": styles,
                    "responses": [f"{s}{i}{j % 3}" for j, s in enumerate(styles)]})
    return out


def test_small_hand_example():
    # 2 problems x 4 samples, computed by hand
    probs = [
        {"id": "a", "source": "s", "correct": [1, 1, 0, 0], "styles": ["A", "B", "A", "other"],
         "responses": ["A1", "B1", "A2", "x"]},
        {"id": "b", "source": "s", "correct": [0, 0, 0, 1], "styles": ["C", "C", "C", "C"],
         "responses": ["C1", "C1", "C1", "C2"]},
    ]
    M = model_metrics(probs, is_base=True, styles=STYLES)
    assert M["pass@1"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert "pass@8" not in M  # k > n is skipped
    assert M["pass_at_k"]["2"] == pytest.approx((passk_ref(4, 2, 2) + passk_ref(4, 1, 2)) / 2)
    assert M["mean_styles"] == pytest.approx((2 + 1) / 2)
    assert M["styles_hist"]["1"] == 0.5 and M["styles_hist"]["2"] == 0.5 and M["styles_hist"]["0"] == 0.0
    assert M["style_mix"] == pytest.approx({"A": 1 / 3, "B": 1 / 3, "C": 1 / 3, "D": 0.0, "E": 0.0})
    assert M["sample_style_mix"]["C"] == pytest.approx(4 / 8) and M["sample_style_mix"]["other"] == pytest.approx(1 / 8)
    assert M["style_accuracy"]["A"] == pytest.approx(1 / 2) and M["style_accuracy"]["C"] == pytest.approx(1 / 4)
    assert M["style_accuracy"]["D"] is None
    assert M["unique_frac"] == pytest.approx((4 / 4 + 2 / 4) / 2)
    # dist-2 over characters: problem a: "A1","B1","A2","x" -> bigrams A1,B1,A2 (3 distinct / 3)
    # problem b: C1,C1,C1,C2 -> 2 distinct / 4
    assert M["dist-2"] == pytest.approx((3 / 3 + 2 / 4) / 2)
    assert (M["keep_rate"], M["explore_rate"]) == (1.0, 0.0)


def test_metrics_against_independent_computation():
    n = 16
    base = fake_problems(0, n=n)
    model = fake_problems(1, n=n, style_w=(80, 10, 5, 5, 0, 0), acc=0.9)
    M = model_metrics(model, base=base, styles=STYLES)
    cs = [sum(p["correct"]) for p in model]
    for k in (1, 8, 16):
        assert M[f"pass@{k}"] == pytest.approx(statistics.mean(passk_ref(n, c, k) for c in cs), abs=1e-12)
    for k in range(1, n + 1):
        assert M["pass_at_k"][str(k)] == pytest.approx(statistics.mean(passk_ref(n, c, k) for c in cs), abs=1e-12)
    assert M["mean_styles"] == pytest.approx(statistics.mean(
        len({s for s, ok in zip(p["styles"], p["correct"]) if ok}) for p in model))
    # keep / explore from the first 8 samples
    b8 = {p["id"]: any(p["correct"][:8]) for p in base}
    m8 = {p["id"]: any(p["correct"][:8]) for p in model}
    solved = [i for i in b8 if b8[i]]
    unsolved = [i for i in b8 if not b8[i]]
    assert M["keep_rate"] == pytest.approx(sum(m8[i] for i in solved) / len(solved))
    if unsolved:
        assert M["explore_rate"] == pytest.approx(sum(m8[i] for i in unsolved) / len(unsolved))
    # per-split numbers
    rare = [p for p in model if p["source"] == "demo/rare"]
    assert M["splits"]["demo/rare"]["pass@16"] == pytest.approx(
        statistics.mean(passk_ref(n, sum(p["correct"]), 16) for p in rare))
    assert M["splits"]["demo/rare"]["n_problems"] == len(rare)


def test_metrics_input_errors():
    with pytest.raises(ValueError, match="same number of samples"):
        model_metrics([{"id": 1, "correct": [1]}, {"id": 2, "correct": [1, 0]}])
    with pytest.raises(ValueError, match="no problems"):
        model_metrics([])


def test_aggregate_seeds_mean_sd_and_per_seed():
    per_seed = {0: {"pass@1": 0.5, "style_mix": {"A": 0.2}, "keep_rate": None},
                1: {"pass@1": 0.7, "style_mix": {"A": 0.4}, "keep_rate": 0.9},
                2: {"pass@1": 0.9, "style_mix": {"A": 0.9}, "keep_rate": 0.7}}
    M = aggregate_seeds(per_seed)
    assert M["pass@1"] == pytest.approx(0.7)
    assert M["sd"]["pass@1"] == pytest.approx(statistics.stdev([0.5, 0.7, 0.9]))
    assert M["style_mix"]["A"] == pytest.approx(0.5)
    assert M["sd"]["style_mix"]["A"] == pytest.approx(statistics.stdev([0.2, 0.4, 0.9]))
    assert M["keep_rate"] == pytest.approx(0.8)  # None values are skipped
    assert M["n_seeds"] == 3 and M["seeds"] == [0, 1, 2]
    assert M["per_seed"]["1"]["pass@1"] == 0.7
    assert "sd" not in aggregate_seeds({0: {"pass@1": 0.5}})


def _write_runs(root):
    base = fake_problems(0)
    write_eval_json(str(root / "base"), task="demo", name="base", role="base",
                    metrics=model_metrics(base, is_base=True, styles=STYLES), problems=base, settings=SETTINGS)
    truth = {}
    for name, w, acc in (("grpo", (90, 10, 0, 0, 0, 0), 0.95), ("dph_f", (35, 25, 20, 12, 8, 0), 0.8)):
        for seed in (0, 1, 2):
            probs = fake_problems(100 * seed + len(name), style_w=w, acc=acc)
            # eval.json written WITHOUT keep/explore: compare must recompute them against the base
            M = model_metrics(probs, styles=STYLES)
            write_eval_json(str(root / name / f"seed{seed}"), task="demo", name=name, role="method", metrics=M,
                            problems=probs, seed=seed, settings=SETTINGS)
            truth[(name, seed)] = model_metrics(probs, base=base, styles=STYLES)
    return base, truth


def test_report_files_and_schema(tmp_path):
    base, truth = _write_runs(tmp_path / "runs")
    out = tmp_path / "report"
    dirs = [str(tmp_path / "runs" / "base")] + [str(tmp_path / "runs" / m / f"seed{s}")
                                                 for m in ("grpo", "dph_f") for s in (0, 1, 2)]
    paths = compare_runs(dirs, str(out))
    for key in ("metrics", "report", "passk_plot", "styles_plot"):
        assert os.path.getsize(paths[key]) > 0
    with open(out / "passk.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    m = json.load(open(out / "metrics.json"))
    assert m["task"] == "demo" and set(m["methods"]) == {"grpo", "dph_f"}
    for M in [m["base"]] + list(m["methods"].values()):
        for key in ("pass@1", "pass@8", "pass@16", "mean_styles", "keep_rate", "explore_rate"):
            assert key in M
    assert (m["base"]["keep_rate"], m["base"]["explore_rate"]) == (1.0, 0.0)
    g = m["methods"]["grpo"]
    assert g["n_seeds"] == 3
    for key in ("pass@1", "pass@16", "keep_rate", "mean_styles"):
        vals = [truth[("grpo", s)][key] for s in (0, 1, 2)]
        assert g[key] == pytest.approx(statistics.mean(vals))
        assert g["sd"][key] == pytest.approx(statistics.stdev(vals))
        assert g["per_seed"]["1"][key] == pytest.approx(truth[("grpo", 1)][key])
    md = open(out / "report.md").read()
    assert "| grpo |" in md and "| dph_f |" in md and "passk.png" in md and "styles.png" in md
    # a rerun of compare gives the same metrics.json
    compare_runs(dirs, str(tmp_path / "again"))
    assert json.load(open(tmp_path / "again" / "metrics.json")) == m


def test_compare_errors(tmp_path):
    _write_runs(tmp_path / "runs")
    with pytest.raises(ValueError, match="no base run and none of the runs holds a step-0 evaluation"):
        compare_runs([str(tmp_path / "runs" / "grpo" / "seed0")], str(tmp_path / "o"))
    with pytest.raises(FileNotFoundError, match="eval.json"):
        read_eval_json(str(tmp_path / "nothing"))
    write_eval_json(str(tmp_path / "other"), task="math", name="base", role="base",
                    metrics={"pass@1": 0.1}, problems=[], settings=SETTINGS)
    with pytest.raises(ValueError, match="different tasks"):
        compare_runs([str(tmp_path / "other"), str(tmp_path / "runs" / "grpo" / "seed0")], str(tmp_path / "o"))


def test_write_report_prediction_checks(tmp_path):
    base = model_metrics(fake_problems(0), is_base=True, styles=STYLES)
    methods = {"grpo": {s: model_metrics(fake_problems(10 + s, style_w=(95, 5, 0, 0, 0, 0), acc=0.95),
                                         base=fake_problems(0), styles=STYLES) for s in range(3)}}
    metrics = build_metrics("demo", base, methods)
    write_report(str(tmp_path), metrics)
    md = open(tmp_path / "report.md").read()
    assert "RL raises pass@1 over the base — grpo" in md
    assert "grpo narrows the styles" in md


def test_compare_refuses_runs_evaluated_differently(tmp_path):
    """Runs with other n / max_new_tokens / data / keep_k > n are an error listing the
    differences; --allow-mismatch compares them and the report says so."""
    _write_runs(tmp_path / "runs")
    probs = fake_problems(7)
    other = {**SETTINGS, "max_new_tokens": 64, "data": {"hash": "zzz"}}
    write_eval_json(str(tmp_path / "runs" / "rkl" / "seed0"), task="demo", name="rkl", role="method",
                    metrics=model_metrics(probs, styles=STYLES), problems=probs, seed=0, settings=other)
    dirs = [str(tmp_path / "runs" / "base"), str(tmp_path / "runs" / "grpo" / "seed0"),
            str(tmp_path / "runs" / "rkl" / "seed0")]
    with pytest.raises(ValueError) as err:
        compare_runs(dirs, str(tmp_path / "o"))
    msg = str(err.value)
    assert "max_new_tokens: base=10, grpo/seed0=10, rkl/seed0=64" in msg
    assert "data_hash" in msg and "--allow-mismatch" in msg and "temperature" not in msg
    paths = compare_runs(dirs, str(tmp_path / "o"), allow_mismatch=True)
    md = open(paths["report"]).read()
    assert "evaluated with different settings" in md and "max_new_tokens" in md
    assert json.load(open(paths["metrics"]))["settings_mismatch"]
    # keep_k > n is a difference on its own
    write_eval_json(str(tmp_path / "runs" / "rkl" / "seed0"), task="demo", name="rkl", role="method",
                    metrics=model_metrics(probs, styles=STYLES), problems=probs, seed=0,
                    settings={**SETTINGS, "n": 4, "keep_k": 8})
    with pytest.raises(ValueError, match=r"keep_k > n: rkl/seed0 has keep_k=8 but n=4"):
        compare_runs(dirs, str(tmp_path / "o"))


def test_old_formats_are_refused_with_a_way_out(tmp_path):
    os.makedirs(tmp_path / "old")
    json.dump({"format": "openrlhf-div.eval/1", "task": "demo"}, open(tmp_path / "old" / "eval.json", "w"))
    with pytest.raises(ValueError, match="openrlhf-div eval"):
        read_eval_json(str(tmp_path / "old"))


def test_compare_without_a_base_run_uses_the_step0_evaluation(tmp_path, capsys):
    """Issue 30: `compare` needs no separate base run; a run folder's eval_step0.json (both engines
    write it: the initial model, before any step) is the base, and the report says so."""
    base_problems = fake_problems(0)
    run = tmp_path / "grpo"
    write_eval_json(str(run), task="demo", name="grpo", role="method", seed=0,
                    metrics=model_metrics(fake_problems(11, acc=0.9), base=base_problems, styles=STYLES),
                    problems=fake_problems(11, acc=0.9), settings=SETTINGS)
    step0 = tmp_path / "step0"
    write_eval_json(str(step0), task="demo", name="grpo", role="method", seed=0,
                    metrics=model_metrics(base_problems, styles=STYLES), problems=base_problems, settings=SETTINGS)
    os.replace(step0 / "eval.json", run / "eval_step0.json")
    out = tmp_path / "cmp"
    compare_runs([str(run)], str(out))
    m = json.load(open(out / "metrics.json"))
    assert m["base"]["pass@1"] == pytest.approx(model_metrics(base_problems)["pass@1"])
    assert m["methods"]["grpo"]["keep_rate"] == pytest.approx(
        model_metrics(fake_problems(11, acc=0.9), base=base_problems)["keep_rate"])
    md = open(out / "report.md").read()
    assert "step-0 evaluation" in md and "eval_step0.json" in md
    assert "step-0 evaluation" in capsys.readouterr().err
