"""evaluate(): metrics checked against independent computations with a scripted generate_fn."""
import json
from math import comb

import pytest

from openrlhf_div.eval.evaluate import evaluate, results_markdown
from openrlhf_div.eval.results import read_eval_json, write_eval
from openrlhf_div.tasks import get_task

LABEL = {"target": 24, "numbers": [4, 6, 1]}
RIGHT = ["<answer>4*6*1</answer>", "<answer>6*4*1</answer>"]
WRONG = "<answer>4+6+1</answer> extra words here"

EXAMPLES = [
    {"prompt": "A", "label": LABEL, "source": "s1", "id": "a"},
    {"prompt": "B", "label": LABEL, "source": "s1", "id": "b"},
    {"prompt": "C", "label": LABEL, "source": "s2", "id": "c"},
]
# sampled responses per problem: a has 2/4 correct (two distinct solutions), b 0/4, c 4/4 (one solution)
SAMPLES = {
    "A": [WRONG, RIGHT[0], WRONG, RIGHT[1]],
    "B": [WRONG] * 4,
    "C": [RIGHT[0]] * 4,
}
GREEDY = {"A": RIGHT[0], "B": WRONG, "C": WRONG}


class ScriptedGen:
    def __init__(self):
        self.calls = []

    def __call__(self, prompts, n, temperature, top_p, max_new_tokens, greedy):
        self.calls.append(dict(n=n, temperature=temperature, top_p=top_p, greedy=greedy, k=len(prompts)))
        key = [p.split("equals")[0] for p in prompts]  # rendered prompt -> which example
        out = []
        for p in prompts:
            name = next(x for x in "ABC" if f"[[{x}]]" in p)
            out.append([GREEDY[name]] * n if greedy else SAMPLES[name][:n])
        assert key  # silence linters
        return out


class MarkedCountdown:
    """The countdown task with the example's name marked in the prompt, so the scripted
    generator knows which problem it is answering."""

    def __init__(self):
        self.inner = get_task("countdown")
        self.name = "countdown"

    def render_prompt(self, ex, tokenizer=None):
        return f"[[{ex['prompt']}]] " + self.inner.render_prompt(ex, tokenizer)

    def reward_results(self, responses, labels):
        return self.inner.reward_results(responses, labels)

    def solution_key(self, response, result):
        return self.inner.solution_key(response, result)


def passk(n, c, k):
    return 1.0 - comb(n - c, k) / comb(n, k)


def dist(texts, m):  # character m-grams: the project's one dist-n (tests/test_dist_n.py)
    grams = [t[i:i + m] for t in texts for i in range(len(t) - m + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0  # no m-grams: 0 by convention


@pytest.fixture(scope="module")
def result():
    gen = ScriptedGen()
    base = {"problems": [
        {"source": "s1", "id": "a", "correct": [False, False, True, False]},   # base solved a
        {"source": "s1", "id": "b", "correct": [True, False, False, False]},   # base solved b
        {"source": "s2", "id": "c", "correct": [False] * 4},                   # base missed c
    ]}
    res = evaluate(MarkedCountdown(), EXAMPLES, gen, n=4, ks=[1, 2, 4], greedy=True, temperature=0.7, top_p=0.9,
                   max_new_tokens=64, base_results=base, keep_k=4, batch_size=2, progress=False)
    res["_calls"] = gen.calls
    return res


def test_pass_at_k_and_mean(result):
    s1, s2, allm = result["by_source"]["s1"], result["by_source"]["s2"], result["by_source"]["all"]
    for k in (1, 2, 4):
        assert s1[f"pass@{k}"] == pytest.approx((passk(4, 2, k) + passk(4, 0, k)) / 2)
        assert s2[f"pass@{k}"] == pytest.approx(1.0)
        assert allm[f"pass@{k}"] == pytest.approx((passk(4, 2, k) + 0 + 1) / 3)
    assert s1["pass@2"] == pytest.approx(5 / 12)
    assert s1["mean@4"] == pytest.approx(0.25) and s2["mean@4"] == 1.0
    assert s1["mean_reward"] == pytest.approx((2 * 1.0 + 6 * 0.1) / 8)  # countdown's 0.1 format reward
    assert s1["problems"] == 2 and s2["problems"] == 1


def test_greedy(result):
    assert result["by_source"]["s1"]["greedy"] == 0.5 and result["by_source"]["s2"]["greedy"] == 0.0
    assert [p["greedy_correct"] for p in result["problems"]] == [True, False, False]


def test_diversity(result):
    s1, s2 = result["by_source"]["s1"], result["by_source"]["s2"]
    assert s1["distinct_correct"] == pytest.approx((2 + 0) / 2)  # a: 4*6*1 and 6*4*1; b: none
    assert s2["distinct_correct"] == 1.0
    assert s1["share_ge_3_distinct_correct"] == 0.0
    for m in (1, 2):
        assert s1[f"dist-{m}"] == pytest.approx((dist(SAMPLES["A"], m) + dist(SAMPLES["B"], m)) / 2)
        assert s2[f"dist-{m}"] == pytest.approx(dist(SAMPLES["C"], m))


def test_keep_and_explore(result):
    s1, s2 = result["by_source"]["s1"], result["by_source"]["s2"]
    assert s1["keep_rate"] == 0.5           # a kept, b lost
    assert s1["explore_rate"] is None       # no base-unsolved problem in s1
    assert s2["keep_rate"] is None and s2["explore_rate"] == 1.0
    assert result["by_source"]["all"]["keep_rate"] == 0.5 and result["by_source"]["all"]["explore_rate"] == 1.0


def test_generate_calls_and_records(result):
    calls = result["_calls"]
    sampling = [c for c in calls if not c["greedy"]]
    greedy = [c for c in calls if c["greedy"]]
    assert [c["k"] for c in sampling] == [2, 1] and [c["k"] for c in greedy] == [2, 1]  # batch_size=2
    assert all(c["n"] == 4 and c["temperature"] == 0.7 and c["top_p"] == 0.9 for c in sampling)
    assert all(c["n"] == 1 for c in greedy)
    a = result["problems"][0]
    assert a["correct"] == [False, True, False, True] and a["n_correct"] == 2
    assert a["rewards"] == pytest.approx([0.1, 1.0, 0.1, 1.0]) and a["reasons"][1] == "ok"
    assert a["responses"] == SAMPLES["A"]


def test_write_and_reload(result, tmp_path):
    res = {k: v for k, v in result.items() if k != "_calls"}
    paths = write_eval(str(tmp_path / "out"), res, name="fake", model="fake")
    data = json.load(open(paths["json"]))
    assert data["settings"]["model"] == "fake" and data["by_source"]["s1"]["pass@2"] == pytest.approx(5 / 12)
    st = data["settings"]
    assert (st["n"], st["ks"], st["temperature"], st["top_p"], st["max_new_tokens"], st["keep_k"]) == \
        (4, [1, 2, 4], 0.7, 0.9, 64, 4)
    assert len(st["data"]["hash"]) == 16 and st["data"]["problems"] == 3
    # the overall metrics: pass@k curve over all problems, structured
    assert data["metrics"]["pass_at_k"]["2"] == pytest.approx((passk(4, 2, 2) + 0 + 1) / 3)
    assert data["metrics"]["splits"]["s2"]["pass@1"] == 1.0
    assert "responses" not in data["problems"][0]
    samples = [json.loads(line) for line in open(paths["samples"])]
    assert samples[0]["responses"] == SAMPLES["A"]
    md = open(paths["markdown"]).read()
    assert "| s1 | 2 | 25.0 | 41.7 | 50.0 | 25.0 | 50.0 |" in md
    assert md == results_markdown(res)
    assert read_eval_json(paths["json"])["problems"][2]["correct"] == [1] * 4


def test_bad_arguments():
    gen = ScriptedGen()
    with pytest.raises(ValueError, match=r"k must be in \[1, n=4\]"):
        evaluate(MarkedCountdown(), EXAMPLES, gen, n=4, ks=[1, 8], progress=False)
    with pytest.raises(ValueError, match="no examples"):
        evaluate(MarkedCountdown(), [], gen, n=4, ks=[1], progress=False)

    def short(prompts, n, **kw):
        return [["<answer>1</answer>"] * (n - 1) for _ in prompts]

    with pytest.raises(ValueError, match="must return 4 strings per prompt"):
        evaluate(MarkedCountdown(), EXAMPLES, short, n=4, ks=[1], progress=False)


def test_with_the_math_task():
    """The real math task through the runner (math-verify path included)."""
    ex = [{"prompt": "half?", "label": "\\frac{1}{2}", "source": "m", "id": "0"}]

    def gen(prompts, n, **kw):
        return [["\\boxed{0.5}", "\\boxed{1/2}", "\\boxed{\\frac{\\sqrt{4}}{4}}", "\\boxed{2}"][:n] for _ in prompts]

    res = evaluate(get_task("math", timeout=2.0, num_workers=2), ex, gen, n=4, ks=[1, 4], progress=False)
    m = res["by_source"]["m"]
    assert m["pass@1"] == pytest.approx(0.75) and m["pass@4"] == 1.0
    assert m["distinct_correct"] == 3.0  # three different correct responses
