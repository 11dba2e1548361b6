"""`compare` groups runs by what they ran (issue 39, defect 1): method, engine and the resolved
settings a run folder's run_info.json records (seed aside); real seeds only; a repeated seed is
refused; what makes rows not comparable is flagged; every row says what produced it."""
import json
import os

import pytest

from openrlhf_div.cli.main import main
from openrlhf_div.eval.report import compare_runs
from openrlhf_div.eval.results import model_metrics, write_eval_json

SETTINGS = {"n": 4, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8, "keep_k": 4, "grading": "math",
            "data": {"hash": "h1"}}
TRAIN = {"method.name": "dph_js", "method.anchor_eta": 0.1, "model.path": "/m", "train.steps": 2,
         "rollout.prompts_per_step": 8, "rollout.n_samples_per_prompt": 4, "rollout.max_new_tokens": 8,
         "rollout.temperature": 1.0, "optim.lr": 1e-5, "data.train": "/d/train.jsonl", "data.prompt_field": "prompt",
         "data.template": "raw", "task.name": "math", "task.options": {"extract": "strict"},
         "eval.data": "/d/eval.jsonl", "eval.every": 0, "eval.n_samples": 4, "eval.max_new_tokens": 8}


def problems(acc_pattern):
    return [{"id": f"p{i}", "source": "s", "correct": [int(c) for c in pat]} for i, pat in enumerate(acc_pattern)]


BASE = problems(["0000", "1000", "0000"])


def run_folder(path, name, *, seed, settings=TRAIN, engine="openrlhf", pattern=("1100", "1000", "0000"),
               eval_seed="same", run_info=True):
    probs = problems(pattern)
    write_eval_json(str(path), task="math", name=name, role="trained", metrics=model_metrics(probs), problems=probs,
                    settings=SETTINGS, seed=seed if eval_seed == "same" else eval_seed,
                    info={"source": "train", "step": 2})
    if run_info:
        info = {"seed": seed, "engine": engine, "experiment": f"tiny_cpu_{name}", "actor_backend": "deepspeed"}
        if settings is not None:
            info["settings"] = {**settings, "method.name": name}
        (path / "run_info.json").write_text(json.dumps(info))
    return str(path)


@pytest.fixture
def base(tmp_path):
    write_eval_json(str(tmp_path / "base"), task="math", name="base", role="base",
                    metrics=model_metrics(BASE, is_base=True), problems=BASE, settings=SETTINGS)
    return str(tmp_path / "base")


def test_a_differing_setting_is_its_own_row_and_seeds_are_the_runs_own(tmp_path, base):
    """The issue's repro: two tiny_cpu_dph_js runs, one with method.anchor_eta=0.3, both seed 0,
    were `dph_js 0.172 +- 0.022` over 2 seeds with `seeds: [0, 1]`."""
    a = run_folder(tmp_path / "a", "dph_js", seed=0)
    b = run_folder(tmp_path / "b", "dph_js", seed=0, settings={**TRAIN, "method.anchor_eta": 0.3},
                   pattern=("1111", "1100", "0000"))
    paths = compare_runs([base, a, b], str(tmp_path / "out"))
    m = json.load(open(paths["metrics"]))
    assert list(m["methods"]) == ["dph_js [method.anchor_eta=0.1]", "dph_js [method.anchor_eta=0.3]"]
    for label, M in m["methods"].items():
        assert M["n_seeds"] == 1 and M["seeds"] == [0] and "sd" not in M
        p = M["provenance"]
        assert p["engine"] == "openrlhf" and p["seeds"] == [0] and p["settings_known"]
        assert p["settings"]["method.anchor_eta"] == (0.1 if "0.1" in label else 0.3)
        assert p["experiment"] == ["tiny_cpu_dph_js"] and len(p["runs"]) == 1
    assert m["methods"]["dph_js [method.anchor_eta=0.3]"]["pass@1"] == pytest.approx(
        model_metrics(problems(("1111", "1100", "0000")))["pass@1"])
    md = open(paths["report"]).read()
    assert "±" not in md.split("## Comparison")[1].split("##")[0]  # one seed each: no spread
    assert "| dph_js [method.anchor_eta=0.3] | openrlhf | 0 |" in md
    assert "## What produced each row" in md and "`method.anchor_eta=0.3`" in md and "`data.template=raw`" in md
    assert m["flags"] == []


def test_two_seeds_average_and_a_repeated_seed_is_refused(tmp_path, base, capsys):
    s3 = run_folder(tmp_path / "s3", "grpo", seed=3)
    s7 = run_folder(tmp_path / "s7", "grpo", seed=7, pattern=("1111", "0000", "0000"))
    m = json.load(open(compare_runs([base, s3, s7], str(tmp_path / "out"))["metrics"]))
    assert list(m["methods"]) == ["grpo"] and m["methods"]["grpo"]["seeds"] == [3, 7]
    assert m["methods"]["grpo"]["n_seeds"] == 2 and set(m["methods"]["grpo"]["per_seed"]) == {"3", "7"}
    # two identical seed-0 runs are one run twice, not "+- 0.000 over 2 seeds": refused, naming both
    r1 = run_folder(tmp_path / "r1", "grpo", seed=0)
    r2 = run_folder(tmp_path / "r2", "grpo", seed=0)
    with pytest.raises(ValueError, match=r"both grpo seed 0 with the same settings .*a repeat is not a second seed"):
        compare_runs([base, r1, r2], str(tmp_path / "o2"))
    capsys.readouterr()
    assert main(["compare", base, r1, r2, "--out", str(tmp_path / "o3")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and str(tmp_path / "r1") in err[-1] and str(tmp_path / "r2") in err[-1]  # base line + 1


def test_no_seed_is_invented(tmp_path, base):
    """A folder named seed1 without a seed in run_info.json / eval.json is seed `unknown`, and an
    older `eval` output's seed (its sampling seed) is not a training seed."""
    d = tmp_path / "grpo" / "seed1"
    run_folder(d, "grpo", seed=None, run_info=False)
    m = json.load(open(compare_runs([base, str(d)], str(tmp_path / "out"))["metrics"]))
    assert m["methods"]["grpo"]["seeds"] == ["unknown"] and m["methods"]["grpo"]["provenance"]["engine"] == "unknown"
    assert any("unknown seed" in f for f in m["flags"]) and any("settings unknown" in f for f in m["flags"])
    old = tmp_path / "old_eval"
    probs = problems(("1100", "1000", "0000"))
    write_eval_json(str(old), task="math", name="grpo", role="method", metrics=model_metrics(probs), problems=probs,
                    settings=SETTINGS, seed=0, info={"source": "eval"})
    m = json.load(open(compare_runs([base, str(old)], str(tmp_path / "out2"))["metrics"]))
    assert m["methods"]["grpo"]["seeds"] == ["unknown"]


def test_runs_that_ran_something_else_are_flagged_not_averaged(tmp_path, base, capsys):
    """Another prompt template for one method, another engine, and a run folder without settings:
    rows of their own, each difference flagged at the top of the report."""
    g = run_folder(tmp_path / "g", "grpo", seed=1)
    d = run_folder(tmp_path / "d", "dph_js", seed=1, settings={**TRAIN, "data.template": "math",
                                                               "presample.tau": 8})  # a DPH-only key
    loc = run_folder(tmp_path / "loc", "grpo", seed=1, engine="local")
    old = run_folder(tmp_path / "old", "grpo", seed=2, settings=None)
    paths = compare_runs([base, g, d, loc, old], str(tmp_path / "out"))
    m = json.load(open(paths["metrics"]))
    assert set(m["methods"]) == {"grpo [engine=openrlhf]", "grpo [engine=local]",
                                 "grpo [engine=openrlhf, settings unknown]", "dph_js"}
    flags = "\n".join(m["flags"])
    assert "`data.template` differs between rows" in flags and "dph_js=math" in flags
    assert "settings unknown for grpo [engine=openrlhf, settings unknown]" in flags
    assert "method.name" not in flags  # methods differ by their own settings by design
    assert "presample.tau" not in flags  # nor by the keys only their method has
    md = open(paths["report"]).read()
    assert "the rows did not all run the same setup" in md and "`data.template` differs" in md
    assert "- **grpo [engine=openrlhf, settings unknown]**: settings unknown" in md
    assert "data.template" in capsys.readouterr().err


def test_learning_curves_mean_and_sd_over_seeds(tmp_path, base):
    """Issue 40: `compare` shows held-out pass@k against training steps from the runs' eval.jsonl, mean
    and sd over a row's seeds at the steps every seed evaluated; a row without periodic evaluations
    has no curve. Mutation: sd over ddof=0 -> the sd value fails; steps as the union -> the step list fails."""
    import numpy as np

    a = run_folder(tmp_path / "a", "grpo", seed=1)
    b = run_folder(tmp_path / "b", "grpo", seed=2)
    c = run_folder(tmp_path / "c", "dph_js", seed=1)  # no eval.jsonl: no curve
    for d, rows in ((a, [(0, 0.1, 0.5), (8, 0.3, 0.7), (16, 0.5, 0.8)]),
                    (b, [(0, 0.1, 0.5), (8, 0.5, 0.9), (12, 0.6, 0.9), (16, 0.7, 0.9)])):
        with open(os.path.join(d, "eval.jsonl"), "w") as fh:
            for st, p1, p4 in rows:
                fh.write(json.dumps({"step": st, "pass@1": p1, "pass@4": p4, "n_samples": 4}) + "\n")
            fh.write('{"step": 24, "pass@1"')  # a line cut by a crash
    paths = compare_runs([base, a, b, c], str(tmp_path / "out"))
    m = json.load(open(paths["metrics"]))
    cur = m["curves"]
    assert list(cur) == ["grpo"]
    g = cur["grpo"]
    assert g["steps"] == [0, 8, 16] and g["n_seeds"] == 2
    assert g["mean"]["pass@1"] == pytest.approx([0.1, 0.4, 0.6])
    assert g["sd"]["pass@1"][1] == pytest.approx(float(np.std([0.3, 0.5], ddof=1)))
    md = open(paths["report"]).read()
    assert "## Held-out pass@k against training steps" in md and "| 8 | 0.400 ± 0.141 | 0.800 ± 0.141 |" in md
    assert os.path.isfile(paths["curves_plot"]) and "![held-out pass@k against training steps](curves.png)" in md


def test_predictions_say_what_was_measured_without_a_rare_split(tmp_path, base):
    """Without a rare split the report has no "pass@16 (rare)" line (it repeated the all-problems pass@16
    under another label), and one seed is not called "sd 0.000". Mutations: the old fallback of `rare`
    to pass@16 -> the (rare) line is back; the price line's sd wording -> "larger seed sd 0.000"."""
    g = run_folder(tmp_path / "g", "grpo", seed=1, pattern=("1" * 16, "1" + "0" * 15, "0" * 16))
    d = run_folder(tmp_path / "d", "dph_js", seed=1, pattern=("1" * 16, "11" + "0" * 14, "1" + "0" * 15))
    md = open(compare_runs([base, g, d], str(tmp_path / "out"), allow_mismatch=True)["report"]).read()
    assert "- dph_js keeps more pass@16 than grpo: 1.000 vs 0.667" in md
    assert "(rare)" not in md and "larger seed sd 0.000" not in md
    assert "(the price) dph_js vs grpo, pass@1:" in md and "single seed, spread unknown)" in md


def test_pass_at_k_past_16_gets_its_table(tmp_path):
    """An evaluation with k up to 32 (the real-model study's is 64): the report has every evaluated k
    in a table, mean ± sd over seeds (the comparison table stops at pass@16: pass@32 / 64 were in the
    plot only); an evaluation that stops at 16 gets no such table. Mutation: passk_markdown returning []
    -> this test fails."""
    s32 = {**SETTINGS, "n": 32, "ks": [1, 2, 4, 8, 16, 32]}
    base_p = problems(["1" + "0" * 31, "0" * 32, "0" * 32])
    write_eval_json(str(tmp_path / "base"), task="math", name="base", role="base",
                    metrics=model_metrics(base_p, is_base=True), problems=base_p, settings=s32)
    runs = []
    for seed, pat in ((1, ("1" * 32, "1" + "0" * 31, "0" * 32)), (2, ("1" * 32, "0" * 32, "0" * 32))):
        probs = problems(pat)
        d = tmp_path / f"s{seed}"
        write_eval_json(str(d), task="math", name="grpo", role="trained", metrics=model_metrics(probs),
                        problems=probs, settings=s32, seed=seed, info={"source": "train", "step": 2})
        (d / "run_info.json").write_text(json.dumps({"seed": seed, "engine": "local", "experiment": "x_grpo",
                                                     "settings": {**TRAIN, "method.name": "grpo"}}))
        runs.append(str(d))
    md = open(compare_runs([str(tmp_path / "base"), *runs], str(tmp_path / "out"))["report"]).read()
    table = md.split("## pass@k against k")[1].split("##")[0]
    assert "| model | pass@1 | pass@2 | pass@4 | pass@8 | pass@16 | pass@32 |" in table
    # base: 1 of 32 samples right on one problem of 3 -> pass@32 = 1/3; grpo: 2/3 and 1/3 -> 0.5 ± 0.236
    assert "| base | 0.010 |" in table and table.split("| base |")[1].split("\n")[0].strip().endswith("0.333 |")
    assert table.split("| grpo |")[1].split("\n")[0].strip().endswith("0.500 ± 0.236 |"), table
    short = run_folder(tmp_path / "short", "grpo", seed=1)
    write_eval_json(str(tmp_path / "b4"), task="math", name="base", role="base",
                    metrics=model_metrics(BASE, is_base=True), problems=BASE, settings={**SETTINGS, "ks": [1, 2, 4]})
    assert "## pass@k against k" not in open(compare_runs([str(tmp_path / "b4"), short],
                                                          str(tmp_path / "o4"))["report"]).read()


def test_a_method_has_one_colour_in_both_figures(tmp_path, base):
    """passk.png drew the methods from the second colour on (the base took the first index) and curves.png
    from the first, so GRPO was orange in one and blue in the other; and a row without a curve shifted
    the colours after it. Now a method's colour and marker are its row's in both. Mutation: passk's
    `j = i - 1` back to `i` -> the colours differ (this test fails)."""
    from openrlhf_div.eval.report import curves_figure, passk_figure

    c = run_folder(tmp_path / "c", "dph_js", seed=1)  # first row, no eval.jsonl: no curve
    a = run_folder(tmp_path / "a", "grpo", seed=1)
    with open(os.path.join(a, "eval.jsonl"), "w") as fh:
        for st in (0, 8):
            fh.write(json.dumps({"step": st, "pass@1": 0.1 + st / 100, "pass@4": 0.5, "n_samples": 4}) + "\n")
    m = json.load(open(compare_runs([base, c, a], str(tmp_path / "out"))["metrics"]))
    assert list(m["methods"]) == ["dph_js", "grpo"] and list(m["curves"]) == ["grpo"]

    def colours(fig):
        return {ln.get_label().split(" (")[0]: (ln.get_color(), ln.get_marker()) for ln in fig.axes[0].get_lines()}

    pk, cv = colours(passk_figure(m)), colours(curves_figure(m["curves"], "math", list(m["methods"])))
    assert cv["grpo"] == pk["grpo"] and pk["grpo"] != pk["dph_js"]
