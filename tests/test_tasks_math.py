"""Math task: answer extraction, equivalence (fast path and math-verify), time limits, prompts."""
import threading

import pytest

from openrlhf_div.tasks import get_task, list_tasks, render_prompt
from openrlhf_div.tasks.math import MATH_TEMPLATES, MathVerifier, extract_answer, find_boxed, gold_answer, quick_equal


@pytest.fixture(scope="module")
def task():
    # verdict tests: a limit far above any verification, so a slow or loaded machine gives the
    # same verdicts (2 s timed out sympy checks at load average 20); the timeout tests below set
    # their own short limits on inputs that hang
    return get_task("math", timeout=30.0, num_workers=2)


# ------------------------------------------------------------------ extraction
@pytest.mark.parametrize("text, expected, method", [
    (r"so the result is \boxed{\frac{1}{2}}.", r"\frac{1}{2}", "boxed"),
    (r"\boxed{\frac{\sqrt{3}}{2}} and later \boxed{7}", "7", "boxed"),  # the last box wins
    (r"nested \boxed{\left\{1, \{2\}\right\}} here", r"\left\{1, \{2\}\right\}", "boxed"),
    (r"\boxed{a^{b^{c}}}", "a^{b^{c}}", "boxed"),
    (r"fbox: \fbox{42}", "42", "boxed"),
    (r"brace-less \boxed 5 done", "5", "boxed"),
    ("The answer is $\\frac{3}{4}$.", r"\frac{3}{4}", "phrase"),
    ("Therefore, the final answer is: $17$. I hope it is correct.", "17", "phrase"),
    ("blah blah\nAnswer: 34", "34", "phrase"),
    ("We get 3 apples, then 12 pears, total 15", "15", "last_number"),
    ("The total is 1,234,567 dollars", "1,234,567", "last_number"),
    ("value -2.5 end", "-2.5", "last_number"),
    ("no digits at all", None, "none"),
    ("", None, "none"),
])
def test_extract_answer(text, expected, method):
    assert extract_answer(text) == (expected, method)


def test_find_boxed_skips_unclosed_box():
    assert find_boxed(r"\boxed{1} then \boxed{2") == ["1"]


def test_gold_answer_forms():
    assert gold_answer(r"The solution gives $\boxed{\frac{5}{6}}$.") == r"\frac{5}{6}"
    assert gold_answer(27) == "27"
    assert gold_answer(["2", "-2"]) == "2, -2"
    assert gold_answer({"answer": "$4$"}) == "4"


# ------------------------------------------------------------------ equivalence
@pytest.mark.parametrize("pred, gold, expected", [
    ("42", "42", True), ("42.0", "42", True), ("41", "42", False),
    ("1,000", "1000", True), ("0.5", r"\frac{1}{2}", True), (r"\dfrac{1}{2}", "1/2", True),
    ("3/4", "0.75", True), ("-3", "3", False), (r"90^\circ", "90", True),
    (r"x+1", r"1+x", None),  # not plain numbers: needs math-verify
    ("1100", "1, 100", None),  # a two-answer list, not a thousands separator
])
def test_quick_equal(pred, gold, expected):
    assert quick_equal(pred, gold) is expected


@pytest.mark.parametrize("response, gold, correct", [
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", True),   # radicals
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", True),
    (r"\boxed{50\%}", "0.5", True),                                    # percentages
    (r"\boxed{(1, 2]}", "(1,2]", True),                                # intervals
    (r"\boxed{[1, 2)}", "(1,2]", False),
    (r"\boxed{(-1, 1)}", r"(-1,1)", True),
    (r"\boxed{\{3, 1, 2\}}", r"\{1,2,3\}", True),                      # sets, any order
    (r"\boxed{3, 2}", "2, 3", True),
    (r"\boxed{x = 3}", "3", True),                                     # equation vs value
    (r"\boxed{x^2 + 2x + 1}", "(x+1)^2", True),                        # LaTeX vs plain, symbolic
    (r"\boxed{x^2 + 2x + 2}", "(x+1)^2", False),
    (r"\boxed{\pi/2}", r"\frac{\pi}{2}", True),
    (r"\boxed{3.14}", r"\pi", False),
])
def test_math_verify_equivalences(task, response, gold, correct):
    r = task.reward_result(response, gold)
    assert r.correct is correct, r
    assert r.reward == (1.0 if correct else 0.0)
    assert r.reason == ("ok" if correct else "wrong answer")


def test_no_answer_and_long_answer(task):
    r = task.reward_result("I don't know.", "5")
    assert (r.reward, r.reason) == (0.0, "no answer found")
    r = task.reward_result(r"\boxed{" + "1+" * 600 + "1}", "1201")
    assert (r.reward, r.reason) == (0.0, "answer too long")


def test_reward_never_raises_on_bad_label(task):
    r = task.reward_result(r"\boxed{1}", {"no_answer_key": 1})
    assert r.reward == 0.0 and r.reason.startswith("verifier error")
    assert task.reward(r"\boxed{1}", None) == 0.0  # None -> gold "None": a wrong answer, not a crash


def test_pathological_answers_hit_the_time_limit():
    """A tower of powers makes sympy compute a gigantic integer; the check is stopped and
    scored 0 with reason 'timeout', and the verifier keeps working afterwards."""
    task = get_task("math", timeout=1.0, num_workers=2)  # same shared pool, shorter limit
    res = task.reward_results([r"\boxed{10^{10^{10^{10}}}}", r"\boxed{9^{9^{9^{9}}}}", r"\boxed{\frac{1}{3}}"],
                              ["5", "7", "0.3333333333"])
    assert [r.reason for r in res[:2]] == ["timeout", "timeout"]
    assert res[0].reward == res[1].reward == 0.0
    assert res[2].correct  # the pool recovered
    assert task.reward(r"\boxed{\sqrt{4}}", "2") == 1.0


def test_works_from_a_non_main_thread():
    """OpenRLHF calls reward_func through asyncio.to_thread: no signals there, so the
    process pool must carry the time limit."""
    task = get_task("math", timeout=1.0, num_workers=2)
    out = {}

    def work():
        out["r"] = task.reward_results([r"\boxed{\frac{2}{4}}", r"\boxed{10^{10^{10^{10}}}}"], ["1/2", "1"])

    th = threading.Thread(target=work)
    th.start()
    th.join(60)
    assert [r.correct for r in out["r"]] == [True, False]
    assert out["r"][1].reason == "timeout"


def test_inline_mode_matches_process_mode(task):
    inline = get_task("math", timeout=30.0, timeout_mode="inline")
    cases = [(r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}"), (r"\boxed{x+1}", "x+2"), (r"\boxed{(0,1)}", "(0,1)")]
    a = [r.correct for r in inline.reward_results([c[0] for c in cases], [c[1] for c in cases])]
    b = [r.correct for r in task.reward_results([c[0] for c in cases], [c[1] for c in cases])]
    assert a == b == [True, False, True]


def test_verifier_rejects_bad_options():
    with pytest.raises(ValueError, match="mode"):
        MathVerifier(mode="threads")
    with pytest.raises(ValueError, match="timeout"):
        MathVerifier(timeout=0)
    with pytest.raises(ValueError, match="template"):
        get_task("math", template="nope")


# ------------------------------------------------------------------ prompts
class _ChatTok:
    chat_template = "fake"

    def apply_chat_template(self, msgs, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in msgs) + "<assistant>"


def test_prompt_templates():
    ex = {"prompt": "What is 1+1?", "label": "2", "source": "s", "id": "0"}
    qwen = get_task("math", template="qwen-math").prompt(ex)
    assert qwen[0] == {"role": "system", "content": MATH_TEMPLATES["qwen-math"][0]}
    assert qwen[1] == {"role": "user", "content": "What is 1+1?"}
    llama = get_task("math", template="llama3").prompt(ex)
    assert len(llama) == 1 and llama[0]["content"].endswith("Problem: What is 1+1?")
    assert r"$\boxed{answer}$" in llama[0]["content"]
    text = render_prompt(qwen, _ChatTok())
    assert text == f"<system>{MATH_TEMPLATES['qwen-math'][0]}</system><user>What is 1+1?</user><assistant>"
    # no chat template: contents joined
    assert render_prompt(qwen, None) == MATH_TEMPLATES["qwen-math"][0] + "\n\nWhat is 1+1?\n"


def test_registered():
    assert {"math", "sql", "countdown"} <= set(list_tasks())


def test_verifier_dedupes_and_caches_definite_results():
    v = MathVerifier(timeout=2.0, num_workers=2)
    seen = []
    outcomes = {("a", "g"): (True, "ok"), ("b", "g"): (False, "ok"), ("c", "g"): (False, "timeout")}

    def fake(pairs):
        seen.append(list(pairs))
        return [outcomes[p] for p in pairs]

    v._check_uncached = fake
    pairs = [("a", "g"), ("b", "g"), ("a", "g"), ("c", "g"), ("c", "g")]
    expected = [(True, "ok"), (False, "ok"), (True, "ok"), (False, "timeout"), (False, "timeout")]
    assert v.check_many(pairs) == expected
    assert seen == [[("a", "g"), ("b", "g"), ("c", "g")]]  # each distinct pair once
    assert v.check_many(pairs) == expected
    assert seen[1] == [("c", "g")]  # definite results cached; the timeout is retried
