"""The demo task: verifier, style parsing, labels, deliberate errors, deterministic splits."""
import json
import random

import pytest

from openrlhf_div.tasks import get_task, list_tasks
from openrlhf_div.tasks.demo import (
    STYLES,
    SplitSpec,
    evaluate,
    make_label,
    make_splits,
    mutate,
    parse_label,
    parse_prompt,
    render,
    style_of,
    write_splits,
)


@pytest.fixture(scope="module")
def task():
    return get_task("demo")


def test_registered_lazily():
    assert "demo" in list_tasks()


# Hand-written correct answers (not produced by render) for a few N.
CORRECT = {
    537: ["A537", "B530+7", "C540-3", "D500+37", "E1074/2"],
    530: ["A530", "B530+0", "C540-10", "D500+30", "E1060/2"],
    100: ["A100", "B100+0", "C110-10", "D100+0", "E200/2"],
    999: ["A999", "B990+9", "C1000-1", "D900+99", "E1998/2"],
    201: ["A201", "B200+1", "C210-9", "D200+1", "E402/2"],
}


@pytest.mark.parametrize("n", sorted(CORRECT))
def test_render_matches_hand_written(n):
    assert [render(n, s) for s in STYLES] == CORRECT[n]


@pytest.mark.parametrize("n", sorted(CORRECT))
def test_correct_answers_score_one_with_style(task, n):
    for s, text in zip(STYLES, CORRECT[n]):
        r = task.reward_result(text, str(n))
        assert (r.reward, r.correct, r.info["style"]) == (1.0, True, s), (text, r)
        # surrounding whitespace is tolerated
        assert task.reward(f"  {text} ", str(n)) == 1.0


WRONG = [
    # (response, label, expected style, why wrong)
    ("A538", "537", "A", "wrong value"),
    ("B520+17", "537", "B", "ones part out of range"),
    ("B537+0", "537", "B", "tens part not a multiple of ten"),
    ("C537-0", "537", "C", "gap must be 1..10"),
    ("C550-13", "537", "C", "gap out of range"),
    ("D400+137", "537", "D", "rest out of range"),
    ("D530+7", "537", "D", "not hundreds"),
    ("E1073/2", "537", "E", "odd numerator"),
    ("E1074/3", "537", "E", "not over 2"),
    ("E537", "537", "E", "malformed"),
    ("A0537", "537", "A", "leading zero"),
    ("A537 B530+7", "537", "A", "trailing text"),
    ("F537", "537", "other", "unknown style"),
    ("537", "537", "other", "no marker"),
    ("", "537", "other", "empty"),
    ("a537", "537", "other", "lower-case marker"),
]


@pytest.mark.parametrize("resp,label,style,why", WRONG)
def test_wrong_answers_score_zero(task, resp, label, style, why):
    r = task.reward_result(resp, label)
    assert r.reward == 0.0 and not r.correct, why
    assert r.info["style"] == style


def test_style_restricted_labels(task):
    # 539 on the rare split: only style E counts, even though A539 states the right value
    assert task.reward("A539", "539@E") == 0.0
    assert task.reward("E1078/2", "539@E") == 1.0
    assert task.reward("B530+9", "539@BE") == 1.0
    assert task.reward("D500+39", "539@BE") == 0.0
    assert task.reward_result("A539", "539@E").info["style"] == "A"


def test_label_round_trip_and_errors(task):
    assert parse_label("537") == (537, STYLES)
    assert parse_label("537@E") == (537, ("E",))
    assert parse_label(537) == (537, STYLES)
    assert make_label(537) == "537" and make_label(537, ["E"]) == "537@E"
    with pytest.raises(ValueError, match="537x"):
        parse_label("537x")
    # the reward never raises: a bad label is reward 0 with a reason
    r = task.reward_result("A537", "not-a-label")
    assert r.reward == 0.0 and "verifier error" in r.reason


def test_style_and_evaluate():
    assert style_of(" B530+7") == "B"
    assert style_of("Z1") == "other"
    assert evaluate("C540-3") == ("C", 537)
    assert evaluate("C540-3x") == ("C", None)


def test_prompt_round_trip(task):
    ex = {"prompt": "537 =", "label": "537"}
    assert task.prompt(ex) == "537 ="
    assert parse_prompt(task.prompt({"label": "412@E"})) == 412


def test_mutation_is_always_wrong(task):
    rng = random.Random(0)
    for n in range(100, 1000, 7):
        for s in STYLES:
            good = render(n, s)
            for _ in range(3):
                bad = mutate(good, rng)
                assert bad != good and len(bad) == len(good)
                assert sum(a != b for a, b in zip(bad, good)) == 1
                assert style_of(bad) == s
                assert task.reward(bad, str(n)) == 0.0, (good, bad)


def test_splits_are_deterministic_and_disjoint(tmp_path):
    spec = SplitSpec(seed=3, n_eval_regular=50)
    a, b = make_splits(spec), make_splits(spec)
    assert a == b
    assert make_splits(SplitSpec(seed=4, n_eval_regular=50))["train"] != a["train"]
    train_n = [parse_label(e["label"])[0] for e in a["train"]]
    ev = a["eval"]
    rare = [e for e in ev if e["source"] == "demo/rare"]
    regular = [e for e in ev if e["source"] == "demo/regular"]
    assert len(rare) == 90 and len(regular) == 50 and len(train_n) == 900 - 90 - 50
    assert all(n % 10 != 9 for n in train_n)  # rare-style problems never reach RL
    assert all(e["label"].endswith("@E") and parse_label(e["label"])[0] % 10 == 9 for e in rare)
    assert set(train_n).isdisjoint(parse_label(e["label"])[0] for e in ev)
    assert set(train_n) | {parse_label(e["label"])[0] for e in ev} == set(range(100, 1000))
    for e in a["train"] + ev:
        assert set(e) == {"prompt", "label", "source", "id"}
        assert parse_prompt(e["prompt"]) == parse_label(e["label"])[0]
    # files: byte-identical for the same spec
    p1 = write_splits(str(tmp_path / "x"), spec)
    p2 = write_splits(str(tmp_path / "y"), spec)
    for k in ("train", "eval"):
        assert open(p1[k]).read() == open(p2[k]).read()
        rows = [json.loads(line) for line in open(p1[k])]
        assert rows == a[k]


def test_split_spec_errors():
    with pytest.raises(ValueError, match="rare_styles"):
        make_splits(SplitSpec(rare_styles="X"))
    with pytest.raises(ValueError, match="n_eval_regular"):
        make_splits(SplitSpec(n_eval_regular=10_000))
