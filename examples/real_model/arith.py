"""The example's task: arithmetic word problems in GSM8K's layout (``question``, ``answer`` ending
in ``#### N``), graded on the last integer of the response.

The grader is deliberately the simple "last number" rule (the ``math`` task's strict mode
wants ``\\boxed{}`` or an explicit final-answer phrase, which a 135M model rarely writes, so
RL would see almost no reward); the prompt asks for the number at the end.
"""
from __future__ import annotations

import json
import random
import re
from typing import Any, Dict, List

from openrlhf_div.tasks import RewardResult, Task, register_task

NAMES = ["Tom", "Ann", "Sam", "Mia", "Lee", "Ava"]
ITEMS = ["apples", "books", "coins", "cards", "stamps", "shells"]


def make_problems(n: int, seed: int) -> List[Dict[str, Any]]:
    """``n`` GSM8K-style rows: ``a + b`` or ``a - b`` with 2 <= a, b <= 30 (no negative answers)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        if rng.random() < 0.5:
            q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
            ans, expr = a + b, f"{a}+{b}"
        else:
            a, b = max(a, b), min(a, b)
            q = f"{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?"
            ans, expr = a - b, f"{a}-{b}"
        rows.append({"id": f"s{seed}-{i}", "question": q,
                     "answer": f"{name} has {expr} = <<{expr}={ans}>>{ans} {item}.\n#### {ans}"})
    return rows


def write_jsonl(path: str, rows) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


_INT = re.compile(r"-?\d+")


class ArithTask(Task):
    name = "arith"

    def prompt(self, example: Dict[str, Any]):
        return [{"role": "user", "content": f"{example['prompt']}\nGive the final answer as a number at the end."}]

    def score(self, response: str, label: Any) -> RewardResult:
        nums = _INT.findall((response or "").replace(",", ""))
        if not nums:
            return RewardResult(0.0, False, "no number", {"answer": None})
        ok = int(nums[-1]) == int(str(label).strip())
        return RewardResult(float(ok), ok, "ok" if ok else "wrong answer", {"answer": nums[-1]})


register_task("arith", lambda **kw: ArithTask())
