"""Countdown (TinyZero): reach a target with + - * / using every given number exactly once.

Label: ``{"target": int, "numbers": [int, ...]}``. The response puts its equation inside
``<answer>...</answer>`` (the last such tag counts). TinyZero's reward:

* ``1.0``: the equation uses every given number exactly once (as a multiset) and equals the
  target;
* ``0.1`` (``format_score``): an ``<answer>`` tag is present but the equation is wrong --
  wrong value, numbers missing or reused, characters other than digits, ``+ - * / ( )`` and
  spaces, division by zero, unbalanced parentheses;
* ``0.0``: no ``<answer>...</answer>`` at all.

The equation is the text between the last ``</answer>`` and the ``<answer>`` nearest before it,
found with two reverse searches (linear time whatever the response holds), in the last
:data:`~openrlhf_div.tasks.base.MAX_EXTRACT_CHARS` characters of the response.

The equation is parsed by a small recursive-descent parser over exact fractions -- no
``eval`` of model text. Differences from TinyZero's script, all on the safe side: ``**``,
decimals and ``=`` are rejected (TinyZero's character filter let ``**`` through to ``eval``),
values compare exactly (TinyZero: ``|v - target| < 1e-5`` on floats), and the tag is searched
in the whole response (TinyZero: only its last line).
"""
from __future__ import annotations

import itertools
import random
import re
from fractions import Fraction
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple, Union

from .base import RewardResult, Task, decode_label, extraction_window, register_task

__all__ = ["CountdownTask", "CountdownError", "evaluate_equation", "countdown_score", "generate_countdown",
           "solve_countdown", "COUNTDOWN_TEMPLATES"]

_TOKEN_RE = re.compile(r"\s*(?:(\d+)|([-+*/()]))")
MAX_EQUATION_CHARS = 256
MAX_DEPTH = 64


class CountdownError(ValueError):
    """The equation is not a valid arithmetic expression (message says why and where)."""


def _tokenize(expr: str) -> List[Union[int, str]]:
    if len(expr) > MAX_EQUATION_CHARS:
        raise CountdownError(f"equation longer than {MAX_EQUATION_CHARS} characters")
    tokens: List[Union[int, str]] = []
    pos = 0
    expr = expr.rstrip()
    while pos < len(expr):
        m = _TOKEN_RE.match(expr, pos)
        if not m:
            ch = expr[pos:].lstrip()[:1]
            raise CountdownError(f"unexpected character {ch!r} at position {pos}")
        if m.group(1) is not None:
            if len(m.group(1)) > 9:
                raise CountdownError(f"number too long at position {pos}")
            tokens.append(int(m.group(1)))
        else:
            op = m.group(2)
            if op == "*" and tokens and tokens[-1] == "*":
                raise CountdownError("'**' (power) is not allowed")
            tokens.append(op)
        pos = m.end()
    return tokens


class _Parser:
    """expr := term (('+'|'-') term)* ; term := unary (('*'|'/') unary)* ;
    unary := ('+'|'-') unary | primary ; primary := INT | '(' expr ')'."""

    def __init__(self, tokens):
        self.toks, self.i, self.numbers = tokens, 0, []

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self):
        t = self.peek()
        self.i += 1
        return t

    def expr(self, depth):
        if depth > MAX_DEPTH:
            raise CountdownError("expression nested too deeply")
        v = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            r = self.term(depth)
            v = v + r if op == "+" else v - r
        return v

    def term(self, depth):
        v = self.unary(depth)
        while self.peek() in ("*", "/"):
            op = self.take()
            r = self.unary(depth)
            if op == "*":
                v = v * r
            else:
                if r == 0:
                    raise CountdownError("division by zero")
                v = v / r
        return v

    def unary(self, depth):
        if depth > MAX_DEPTH:
            raise CountdownError("expression nested too deeply")
        t = self.peek()
        if t in ("+", "-"):
            self.take()
            v = self.unary(depth + 1)
            return -v if t == "-" else v
        return self.primary(depth)

    def primary(self, depth):
        t = self.take()
        if isinstance(t, int):
            self.numbers.append(t)
            return Fraction(t)
        if t == "(":
            v = self.expr(depth + 1)
            if self.take() != ")":
                raise CountdownError("missing ')'")
            return v
        raise CountdownError(f"unexpected {t!r}" if t is not None else "unexpected end of equation")


def evaluate_equation(expr: str) -> Tuple[Fraction, List[int]]:
    """``(exact value, number literals used)`` of an arithmetic expression over non-negative
    integers with ``+ - * /``, unary signs and parentheses. Raises :class:`CountdownError`."""
    tokens = _tokenize(expr)
    if not tokens:
        raise CountdownError("empty equation")
    p = _Parser(tokens)
    v = p.expr(0)
    if p.i != len(tokens):
        raise CountdownError(f"unexpected {tokens[p.i]!r} after a complete expression")
    return v, p.numbers


def _parse_label(label: Any) -> Tuple[int, List[int]]:
    label = decode_label(label, "countdown", '{"target", "numbers"}')
    nums = label.get("numbers", label.get("nums"))
    if "target" not in label or nums is None:
        raise ValueError(f"countdown label needs 'target' and 'numbers', got keys {sorted(label)}")
    return int(label["target"]), [int(x) for x in nums]


def last_answer_tag(text: str) -> Optional[str]:
    """The contents of the last complete ``<answer>...</answer>`` pair, or None."""
    text = extraction_window(text)
    end = text.rfind("</answer>")
    if end < 0:
        return None
    start = text.rfind("<answer>", 0, end)
    return None if start < 0 else text[start + len("<answer>"):end]


def countdown_score(response: str, target: int, numbers: Sequence[int], format_score: float = 0.1,
                    score: float = 1.0) -> Tuple[float, str, Optional[str]]:
    """``(reward, reason, equation)`` for one response (see the module docstring)."""
    eq = last_answer_tag(response or "")
    if eq is None:
        return 0.0, "no <answer> tag", None
    eq = eq.strip()
    try:
        value, used = evaluate_equation(eq)
    except CountdownError as exc:
        return format_score, f"invalid equation: {exc}", eq
    if sorted(used) != sorted(int(n) for n in numbers):
        return format_score, "numbers must each be used exactly once", eq
    if value != target:
        return format_score, "wrong value", eq
    return score, "ok", eq


# --------------------------------------------------------------------------- prompts
_INSTRUCTION = ("Using the numbers {numbers}, create an equation that equals {target}. You can use basic "
                "arithmetic operations (+, -, *, /) and each number can only be used once. Show your work in "
                "<think> </think> tags. And return the final answer in <answer> </answer> tags, for example "
                "<answer> (1 + 2) / 3 </answer>.")

#: "base": TinyZero's plain-text dialogue for base models (ends inside <think>);
#: "chat": the same instruction as a user message for instruct models.
COUNTDOWN_TEMPLATES = {
    "base": ("A conversation between User and Assistant. The user asks a question, and the Assistant solves "
             "it. The assistant first thinks about the reasoning process in the mind and then provides the user "
             "with the answer.\nUser: " + _INSTRUCTION + "\nAssistant: Let me solve this step by step.\n<think>"),
    "chat": _INSTRUCTION,
}


class CountdownTask(Task):
    """Countdown with TinyZero's reward. Options: ``template`` (``"chat"`` or ``"base"``),
    ``format_score`` (default 0.1)."""

    name = "countdown"

    def __init__(self, template: str = "chat", format_score: float = 0.1):
        if template not in COUNTDOWN_TEMPLATES:
            raise ValueError(f"unknown countdown template {template!r}; choose one of {sorted(COUNTDOWN_TEMPLATES)}")
        self.template = template
        self.format_score = float(format_score)

    def prompt(self, example: Dict[str, Any]) -> Union[str, List[Dict[str, str]]]:
        target, numbers = _parse_label(example["label"])
        text = COUNTDOWN_TEMPLATES[self.template].replace("{numbers}", str(list(numbers))).replace(
            "{target}", str(target))
        return text if self.template == "base" else [{"role": "user", "content": text}]

    def score(self, response: str, label: Any) -> RewardResult:
        target, numbers = _parse_label(label)
        reward, reason, eq = countdown_score(response, target, numbers, self.format_score)
        return RewardResult(reward, reason == "ok", reason, {"equation": eq})

    def solution_key(self, response: str, result: RewardResult) -> Hashable:
        eq = (result.info or {}).get("equation")
        return re.sub(r"\s+", "", eq) if eq else " ".join((response or "").split())


register_task("countdown", CountdownTask)


# --------------------------------------------------------------------------- instances
def solve_countdown(numbers: Sequence[int], target: int) -> Optional[str]:
    """A fully parenthesised equation using every number once that equals ``target``, or None.
    Exhaustive search over orders, operators and tree shapes (fine for up to 5 numbers)."""
    target = Fraction(target)

    def combos(items: Tuple[Tuple[Fraction, str], ...]):
        if len(items) == 1:
            yield items[0]
            return
        for i, j in itertools.permutations(range(len(items)), 2):
            (a, ea), (b, eb) = items[i], items[j]
            rest = tuple(x for k, x in enumerate(items) if k not in (i, j))
            cands = [(a + b, f"({ea} + {eb})"), (a - b, f"({ea} - {eb})"), (a * b, f"({ea} * {eb})")]
            if b != 0:
                cands.append((a / b, f"({ea} / {eb})"))
            for c in cands:
                yield from combos(rest + (c,))

    for v, e in combos(tuple((Fraction(n), str(n)) for n in numbers)):
        if v == target:
            return e[1:-1] if e.startswith("(") and e.endswith(")") else e
    return None


def generate_countdown(num_instances: int, seed: int = 0, n_numbers: Tuple[int, int] = (3, 4),
                       max_number: int = 100, target_range: Tuple[int, int] = (1, 1000)) -> List[Dict[str, Any]]:
    """New solvable instances ``{"target", "numbers", "solution"}``.

    For each instance: draw ``k`` in ``n_numbers`` (inclusive) and ``k`` numbers in
    ``[1, max_number]``; combine them in a random order with random operators (division only
    when exact, subtraction only when it stays positive) into a target; keep it if the target
    lies in ``target_range``. Deterministic for a given ``seed``.
    """
    if num_instances < 0:
        raise ValueError(f"num_instances must be >= 0, got {num_instances}")
    lo, hi = n_numbers
    if not 2 <= lo <= hi:
        raise ValueError(f"n_numbers must satisfy 2 <= min <= max, got {n_numbers}")
    rng = random.Random(seed)
    out: List[Dict[str, Any]] = []
    attempts = 0
    while len(out) < num_instances:
        attempts += 1
        if attempts > 1000 * max(1, num_instances):
            raise RuntimeError(f"could not generate {num_instances} instances in range {target_range}; widen it")
        k = rng.randint(lo, hi)
        nums = [rng.randint(1, max_number) for _ in range(k)]
        items = [(Fraction(n), str(n)) for n in nums]
        rng.shuffle(items)
        while len(items) > 1:
            a, b = items.pop(), items.pop()
            ops = ["+", "*"]
            if a[0] > b[0]:
                ops.append("-")
            if b[0] != 0 and (a[0] / b[0]).denominator == 1:
                ops.append("/")
            op = rng.choice(ops)
            val = {"+": a[0] + b[0], "-": a[0] - b[0], "*": a[0] * b[0], "/": a[0] / b[0] if b[0] else None}[op]
            items.insert(rng.randint(0, len(items)), (val, f"({a[1]} {op} {b[1]})"))
        value, expr = items[0]
        if value.denominator != 1 or not target_range[0] <= value <= target_range[1]:
            continue
        order = nums[:]
        rng.shuffle(order)
        out.append({"target": int(value), "numbers": order, "solution": expr[1:-1]})
    return out
