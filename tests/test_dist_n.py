"""dist-n has one definition (issue 30): ``eval.json``'s top-level metrics, its per-source
metrics, ``results.md`` and ``compare`` all read :func:`openrlhf_div.eval.diversity.distinct_n`
(character n-grams). Before, the top level counted characters and ``by_source`` whitespace words,
so one-word answers had dist-2 0.377 at the top and 0.0 per source."""
import pytest

from openrlhf_div.eval.diversity import distinct_n, mean_distinct_n
from openrlhf_div.eval.evaluate import evaluate
from openrlhf_div.eval.results import model_metrics
from openrlhf_div.tasks import get_task

# hand-computed: "ab a" -> ab, "b ", " a"; "ab" -> ab: 3 distinct of 4 bigrams
CASE = ["ab a", "ab"]
# one-word answers (the tiny math model's): "12" -> 12; "7" -> none; "12" -> 12: 1 distinct of 2
ONE_WORD = ["12", "7", "12"]


def test_distinct_n_by_hand():
    assert distinct_n(CASE, 2) == pytest.approx(3 / 4)
    assert distinct_n(CASE, 1) == pytest.approx(3 / 6)  # a, b, " ", a, a, b -> {a, b, " "}
    assert distinct_n(ONE_WORD, 2) == pytest.approx(1 / 2)
    assert distinct_n(["7"], 2) == 0.0
    assert mean_distinct_n([CASE, ONE_WORD], 2) == pytest.approx((3 / 4 + 1 / 2) / 2)
    with pytest.raises(ValueError):
        distinct_n(CASE, 0)


class _Sums:
    """The math task, answering from a script per prompt."""

    def __init__(self):
        self.inner = get_task("math")
        self.name = "math"

    def render_prompt(self, ex, tokenizer=None):
        return ex["prompt"]

    def reward_results(self, responses, labels):
        return self.inner.reward_results(responses, labels)

    def solution_key(self, response, result):
        return response


def test_top_level_and_per_source_agree_with_the_hand_value():
    examples = [{"prompt": "p1", "label": "12", "source": "s", "id": "1"},
                {"prompt": "p2", "label": "3", "source": "s", "id": "2"}]
    script = {"p1": ONE_WORD, "p2": CASE + ["ab"]}

    def gen(prompts, n, temperature, top_p, max_new_tokens, greedy):
        return [script[p][:n] for p in prompts]

    res = evaluate(_Sums(), examples, gen, n=3, ks=(1, 3), dist_ns=(2,), progress=False)
    # p2's samples "ab a", "ab", "ab": bigrams ab, "b ", " a", ab, ab -> 3 distinct / 5
    want = (1 / 2 + 3 / 5) / 2
    assert res["metrics"]["dist-2"] == pytest.approx(want)
    assert res["by_source"]["s"]["dist-2"] == pytest.approx(want)
    problems = [{"correct": [False] * 3, "responses": script[e["prompt"]], "source": "s", "id": e["id"]}
                for e in examples]
    assert model_metrics(problems)["dist-2"] == pytest.approx(want)
