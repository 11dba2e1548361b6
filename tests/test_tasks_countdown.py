"""Countdown: TinyZero's reward, the safe arithmetic parser, the instance generator."""
import json
from fractions import Fraction

import pytest

from openrlhf_div.tasks import get_task, render_prompt
from openrlhf_div.tasks.countdown import (CountdownError, countdown_score, evaluate_equation, generate_countdown,
                                          solve_countdown)


@pytest.fixture(scope="module")
def task():
    return get_task("countdown")


def ans(eq):
    return f"<think>trying things</think>\n<answer>{eq}</answer>"


LABEL = {"target": 24, "numbers": [4, 6, 1]}


@pytest.mark.parametrize("response, reward, reason", [
    (ans("4 * 6 * 1"), 1.0, "ok"),
    (ans("(6 - 1 - 1) * 6"), 0.1, "numbers must each be used exactly once"),   # reused / missing numbers
    (ans("4 * 6"), 0.1, "numbers must each be used exactly once"),             # 1 unused
    (ans("4 * 6 * 1 * 1"), 0.1, "numbers must each be used exactly once"),     # 1 used twice
    (ans("4 + 6 + 1"), 0.1, "wrong value"),
    (ans("4 * 6 / (1 - 1)"), 0.1, "invalid equation: division by zero"),
    (ans("6 / (1 - 1) * 4"), 0.1, "invalid equation: division by zero"),
    (ans("__import__('os').system('rm -rf /')"), 0.1, None),                  # injection: rejected, not run
    (ans("4**6*1"), 0.1, None),                                               # no power operator
    (ans("4 * 6 * 1 = 24"), 0.1, None),
    (ans("4.0 * 6 * 1"), 0.1, None),
    (ans("(4 * 6 * 1"), 0.1, "invalid equation: missing ')'"),
    (ans(""), 0.1, "invalid equation: empty equation"),
    ("4 * 6 * 1", 0.0, "no <answer> tag"),
    ("<answer>4 * 6 * 1", 0.0, "no <answer> tag"),
    (ans("4 + 6 + 1") + "\nwait, better:\n" + ans("1 * 4 * 6"), 1.0, "ok"),  # the last tag counts
    (ans("-(1 - 4) * (6 + 1) + 3") , 0.1, None),
])
def test_rewards(task, response, reward, reason):
    r = task.reward_result(response, LABEL)
    assert r.reward == pytest.approx(reward), r
    if reason is not None:
        assert r.reason == reason
    assert r.correct is (reward == 1.0)


def test_division_by_zero_with_valid_numbers():
    assert countdown_score(ans("5 / (3 - 3)"), 1, [5, 3, 3]) == (0.1, "invalid equation: division by zero",
                                                                 "5 / (3 - 3)")


def test_fractional_intermediate_is_exact():
    # 8 / (3 - 8/3) = 24 only in exact arithmetic
    assert countdown_score(ans("8 / (3 - 8 / 3)"), 24, [8, 3, 8, 3])[0] == 1.0


def test_parser_values_match_python_on_safe_expressions():
    for expr in ["1 + 2 * 3", "(1 + 2) * 3", "10 / 4", "-3 + 5", "2 * -3", "100 - 7 * (3 + 2) / 5", "--4"]:
        v, _ = evaluate_equation(expr)
        assert v == Fraction(eval(expr)).limit_denominator(10**6), expr  # noqa: S307 - trusted test strings


@pytest.mark.parametrize("bad", ["1 +", "* 2", "()", "1 2", "(((1)", "abs(1)", "1e3", "0x10", "1_000",
                                 "2 ** 3", "(" * 100 + "1" + ")" * 100, "-" * 300 + "1"])
def test_parser_rejects(bad):
    with pytest.raises(CountdownError):
        evaluate_equation(bad)


def test_labels_as_json_strings(task):
    assert task.reward(ans("4 * 6 * 1"), json.dumps(LABEL)) == 1.0
    assert task.reward(ans("4 * 6 * 1"), json.dumps({"target": 24, "nums": [1, 4, 6]})) == 1.0
    r = task.reward_result(ans("1"), "{broken")
    assert r.reward == 0.0 and "not valid JSON" in r.reason


def test_generator_instances_are_solvable_and_deterministic():
    a = generate_countdown(30, seed=3)
    assert a == generate_countdown(30, seed=3)
    assert a != generate_countdown(30, seed=4)
    for inst in a:
        assert 3 <= len(inst["numbers"]) <= 4
        assert all(1 <= x <= 100 for x in inst["numbers"])
        assert 1 <= inst["target"] <= 1000
        # the stored solution earns full reward, and an independent search agrees it is solvable
        assert countdown_score(ans(inst["solution"]), inst["target"], inst["numbers"])[0] == 1.0
        found = solve_countdown(inst["numbers"], inst["target"])
        assert found is not None
        assert countdown_score(ans(found), inst["target"], inst["numbers"])[0] == 1.0


def test_solver_finds_none_when_impossible():
    assert solve_countdown([1, 1, 1], 100) is None


def test_prompts():
    ex = {"prompt": "", "label": LABEL, "source": "c", "id": "0"}
    chat = get_task("countdown").prompt(ex)
    assert chat[0]["role"] == "user" and "[4, 6, 1]" in chat[0]["content"] and "equals 24" in chat[0]["content"]
    base = get_task("countdown", template="base").prompt(ex)
    assert isinstance(base, str) and base.endswith("<think>") and render_prompt(base) == base


def test_solution_key(task):
    r = task.reward_result(ans(" 4 *6* 1 "), LABEL)
    assert task.solution_key("", r) == "4*6*1"
