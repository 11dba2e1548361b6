"""GSM8K-style arithmetic word problems for the SmolLM2 experiment family (``configs/openrlhf/_smollm2_arith.yaml``)
and for its sizing measurements (docs/real_model.md, "Sizing measurements").

Every row is ``{"id", "prompt", "answer"}``; ``prompt`` is the whole user message (the question and a one-line
instruction to end with the number), so every engine renders it the same way (the chat template over one user
turn; SmolLM2's template adds its own default system line), and ``answer`` ends in GSM8K's ``#### N`` (the loader keeps ``N`` as the label). The
``math`` task grades it with ``extract: lenient`` (the last ``\\boxed{}``, else a final-answer phrase, else the
last number of the response).

    python examples/real_model/make_data.py --level add2 --n 64 --seed 1 --out examples/data/smollm2_arith/train.jsonl
    python examples/real_model/make_data.py --level add2 --n 32 --seed 2 --exclude examples/data/smollm2_arith/train.jsonl \
        --out examples/data/smollm2_arith/eval.jsonl

Levels (the operands are drawn uniformly; the answer is never negative):

* ``add1``: ``a + b`` or ``a - b``, 2 <= a, b <= 9 (one-digit)
* ``add2``: ``a + b`` or ``a - b``, 2 <= a, b <= 30 (examples/real_model/arith.py's range)
* ``add3``: ``a + b - c``, 2 <= a, b, c <= 20 (two steps)
* ``mul1``: ``a * b``, 2 <= a, b <= 9
* ``mul2``: ``a * b``, 2 <= a <= 12, 11 <= b <= 25

The same ``(level, n, seed)`` gives the same rows (``random.Random(seed)``); training and held-out files use
different seeds, and :func:`make_rows` drops from a file any question another file of the family already holds
when given ``exclude``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
from typing import Any, Dict, Iterable, List, Optional, Set

NAMES = ["Tom", "Ann", "Sam", "Mia", "Lee", "Ava", "Ben", "Zoe"]
ITEMS = ["apples", "books", "coins", "cards", "stamps", "shells", "pencils", "marbles"]
INSTRUCTION = "Give the final answer as a number at the end."
LEVELS = ("add1", "add2", "add3", "mul1", "mul2")


def _problem(level: str, rng: random.Random):
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    if level in ("add1", "add2"):
        hi = 9 if level == "add1" else 30
        a, b = rng.randint(2, hi), rng.randint(2, hi)
        if rng.random() < 0.5:
            return (f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
                    f"{a}+{b}", a + b)
        a, b = max(a, b), min(a, b)
        return (f"{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?",
                f"{a}-{b}", a - b)
    if level == "add3":
        a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(2, 20)
        c = min(c, a + b)
        return (f"{name} has {a} {item}, gets {b} more and then gives away {c}. How many {item} does {name} "
                f"have left?", f"{a}+{b}-{c}", a + b - c)
    if level in ("mul1", "mul2"):
        a, b = (rng.randint(2, 9), rng.randint(2, 9)) if level == "mul1" else (rng.randint(2, 12), rng.randint(11, 25))
        return (f"{name} has {a} boxes with {b} {item} in each box. How many {item} does {name} have?",
                f"{a}*{b}", a * b)
    raise ValueError(f"unknown level {level!r}; choose one of {', '.join(LEVELS)}")


def make_rows(level: str, n: int, seed: int, exclude: Optional[Iterable[str]] = None) -> List[Dict[str, Any]]:
    """``n`` distinct rows of ``level`` (none whose question is in ``exclude``)."""
    rng = random.Random(seed)
    seen: Set[str] = set(exclude or ())
    rows: List[Dict[str, Any]] = []
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 100 * n + 1000:
            raise ValueError(f"level {level}: fewer than {n} distinct questions outside `exclude`")
        q, expr, ans = _problem(level, rng)
        if q in seen:
            continue
        seen.add(q)
        rows.append({"id": f"{level}-s{seed}-{len(rows)}", "prompt": f"{q}\n{INSTRUCTION}",
                     "answer": f"{expr} = <<{expr}={ans}>>{ans}\n#### {ans}"})
    return rows


def write_jsonl(path: str, rows: Iterable[Dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def questions(path: str) -> Set[str]:
    with open(path, encoding="utf-8") as f:
        return {json.loads(line)["prompt"] for line in f if line.strip()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--level", required=True, choices=LEVELS)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--exclude", action="append", default=[], help="a JSONL whose questions this file must not repeat")
    a = p.parse_args(argv)
    ex: Set[str] = set()
    for path in a.exclude:
        ex |= questions(path)
    write_jsonl(a.out, make_rows(a.level, a.n, a.seed, ex))
    print(f"wrote {a.n} rows of level {a.level} (seed {a.seed}) to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
