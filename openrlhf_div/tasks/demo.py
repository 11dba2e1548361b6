"""The demo task: write a number in one of five marked solution styles.

A toy in the spirit of DPH-RL's Appendix A (five SQL styles): a verifiable task with
several *distinct valid solution styles*, each marked by the response's first character so
the style of a sample can be read off it. The prompt is ``"N ="`` with ``N`` in 100..999;
a correct response writes an expression equal to ``N`` in one of five styles::

    style  meaning                              N = 537        N = 530
    A      the number itself                    A537           A530
    B      tens  + ones      (x % 10 == 0, 0<=y<=9)   B530+7     B530+0
    C      next ten - gap    (x % 10 == 0, 1<=y<=10)  C540-3     C540-10
    D      hundreds + rest   (x % 100 == 0, 0<=y<=99) D500+37    D500+30
    E      double / 2        (x == 2N)              E1074/2        E1060/2

The verifier checks the style's structure *and* its value, so each style has exactly one
correct string per ``N``; anything else (a wrong digit, a mixed or unknown prefix) scores 0.
The style of any response is the first character when it is one of ``A``-``E`` and
``"other"`` otherwise (DPH App. A counts unknown prefixes as an extra "Others" style).

**Labels.** A label is ``"537"`` (any style counts) or ``"537@E"`` (only the listed
styles count). The second form makes the *rare-style split*: problems only a rare style can
solve. Without it every method reaches pass@16 = 1 on this task and pass@k cannot move (the
prototype's finding); with it pass@k measures whether the rare mode survived RL.

**Splits** (:func:`make_splits`, deterministic from a seed): all ``N`` ending in
``rare_digit`` (default 9) form the *rare* split, labelled ``"N@E"``; they are **kept out of
RL training** and appear only in evaluation, so no method is ever rewarded for style E on
them: their pass@k is the rate at which a policy still produces the rare style correctly,
the toy analogue of "problems the base could solve that RL forgot" (DPH 6.2). Of the other
``N``, ``n_eval_regular`` are held out for evaluation and the rest form the RL training set.

Reward: 1.0 for a correct response in an allowed style, 0.0 otherwise;
``RewardResult.info = {"style": s}`` always (also for wrong answers).
"""
from __future__ import annotations

import json
import os
import random
import re
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from .base import RewardResult, Task, register_task
from openrlhf_div.io import atomic_write_text

STYLES: Tuple[str, ...] = ("A", "B", "C", "D", "E")
OTHER = "other"
N_MIN, N_MAX = 100, 999
STYLE_NAMES = {
    "A": "the number",
    "B": "tens + ones",
    "C": "next ten - gap",
    "D": "hundreds + rest",
    "E": "double / 2",
}

_PATTERNS = {
    "A": re.compile(r"A(\d+)"),
    "B": re.compile(r"B(\d+)\+(\d+)"),
    "C": re.compile(r"C(\d+)-(\d+)"),
    "D": re.compile(r"D(\d+)\+(\d+)"),
    "E": re.compile(r"E(\d+)/2"),
}
_LABEL = re.compile(r"\s*(\d+)\s*(?:@\s*([A-Ea-e]+))?\s*")
_PROMPT = re.compile(r"\s*(\d+)\s*=\s*")


# ------------------------------------------------------------------ styles
def render(n: int, style: str) -> str:
    """The unique correct response for ``n`` in ``style`` (see the module table)."""
    n = int(n)
    if style == "A":
        return f"A{n}"
    if style == "B":
        return f"B{n - n % 10}+{n % 10}"
    if style == "C":
        up = n - n % 10 + 10
        return f"C{up}-{up - n}"
    if style == "D":
        return f"D{n - n % 100}+{n % 100}"
    if style == "E":
        return f"E{2 * n}/2"
    raise ValueError(f"unknown demo style {style!r}; valid styles: {', '.join(STYLES)}")


def style_of(response: str) -> str:
    """The style of a response: its first non-space character if in ``A``-``E``, else ``"other"``."""
    s = response.strip()
    return s[0] if s and s[0] in STYLES else OTHER


def evaluate(response: str) -> Tuple[str, Optional[int]]:
    """``(style, value)``: the value a response states in its own style's structure, or
    ``None`` when the response does not follow that structure (trailing text, a tens part
    that is not a multiple of ten, a ones part out of range, ...)."""
    s = response.strip()
    style = style_of(s)
    if style == OTHER:
        return style, None
    m = _PATTERNS[style].fullmatch(s)
    if m is None:
        return style, None
    nums = [int(g) for g in m.groups()]
    if any(len(g) > 1 and g[0] == "0" for g in m.groups()):  # no leading zeros: one string per N
        return style, None
    if style == "A":
        return style, nums[0]
    x, y = nums[0], (nums[1] if len(nums) > 1 else None)
    if style == "B":
        return style, (x + y if x % 10 == 0 and 0 <= y <= 9 else None)
    if style == "C":
        return style, (x - y if x % 10 == 0 and 1 <= y <= 10 else None)
    if style == "D":
        return style, (x + y if x % 100 == 0 and 0 <= y <= 99 else None)
    # E
    return style, (x // 2 if x % 2 == 0 else None)


def parse_label(label: Any) -> Tuple[int, Tuple[str, ...]]:
    """``"537"`` -> ``(537, all styles)``; ``"537@E"`` -> ``(537, ("E",))``; ints accepted."""
    if isinstance(label, int):
        return label, STYLES
    if isinstance(label, dict):
        return int(label["n"]), tuple(label.get("styles", STYLES))
    m = _LABEL.fullmatch(str(label))
    if m is None:
        raise ValueError(f"demo label {label!r} is not 'N' or 'N@STYLES' (e.g. '537' or '537@E')")
    styles = tuple(m.group(2).upper()) if m.group(2) else STYLES
    return int(m.group(1)), styles


def make_label(n: int, styles: Sequence[str] = STYLES) -> str:
    styles = tuple(styles)
    return str(int(n)) if styles == STYLES else f"{int(n)}@{''.join(styles)}"


def prompt_text(n: int) -> str:
    return f"{int(n)} ="


def parse_prompt(prompt: str) -> int:
    m = _PROMPT.fullmatch(prompt)
    if m is None:
        raise ValueError(f"demo prompt {prompt!r} is not of the form 'N ='")
    return int(m.group(1))


def mutate(response: str, rng: random.Random) -> str:
    """A wrong answer: change one digit of one operand (never the ``/2`` of style E).

    A single-digit change always changes the stated value (or breaks the style's structure),
    so the result is always scored wrong; a leading digit is never changed to 0.
    """
    end = len(response) - 2 if response.startswith("E") else len(response)
    pos = [i for i in range(1, end) if response[i].isdigit()]
    i = rng.choice(pos)
    lead = i == 1 or not response[i - 1].isdigit()
    choices = [d for d in "0123456789" if d != response[i] and not (lead and d == "0")]
    return response[:i] + rng.choice(choices) + response[i + 1:]


# ------------------------------------------------------------------ the task
class DemoTask(Task):
    """Score a response against a demo label; ``info["style"]`` is the response's style."""

    name = "demo"
    eval_max_new_tokens = 16  # a style prefix and a number (the demo's own evaluation uses 10)

    def prompt(self, example: Dict[str, Any]) -> str:
        if example.get("prompt"):
            return str(example["prompt"])
        n, _ = parse_label(example["label"])
        return prompt_text(n)

    def score(self, response: str, label: Any) -> RewardResult:
        n, allowed = parse_label(label)
        style, value = evaluate(response)
        info = {"style": style}
        if style == OTHER:
            return RewardResult(0.0, False, "no style marker (A-E)", info)
        if value is None:
            return RewardResult(0.0, False, f"not a well-formed style-{style} answer", info)
        if value != n:
            return RewardResult(0.0, False, f"wrong value {value} (expected {n})", info)
        if style not in allowed:
            return RewardResult(0.0, False, f"style {style} does not solve this problem "
                                            f"(allowed: {''.join(allowed)})", info)
        return RewardResult(1.0, True, "ok", info)


@register_task("demo")
def _make_demo(**options) -> DemoTask:
    if options:
        raise ValueError(f"task 'demo' takes no options, got {sorted(options)}")
    return DemoTask()


# ------------------------------------------------------------------ data
@dataclass(frozen=True)
class SplitSpec:
    """How the ``N`` in 100..999 are split (see the module docstring)."""

    seed: int = 0
    rare_digit: int = 9          # N % 10 == rare_digit -> rare split (eval only)
    rare_styles: str = "E"       # the styles that solve a rare problem
    n_eval_regular: int = 100    # regular N held out for evaluation

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def make_splits(spec: SplitSpec = SplitSpec()) -> Dict[str, List[Dict[str, Any]]]:
    """``{"train": [...], "eval": [...]}`` of examples ``{prompt, label, source, id}``.

    ``train``: regular N not held out (RL training prompts, shuffled by ``seed``);
    ``eval``: the held-out regular N (``source = "demo/regular"``) then every rare N
    (``source = "demo/rare"``, label ``"N@E"``), each sorted by N. Deterministic in ``spec``.
    """
    if not 0 <= spec.rare_digit <= 9:
        raise ValueError(f"rare_digit must be a digit 0..9, got {spec.rare_digit}")
    bad = [s for s in spec.rare_styles if s not in STYLES]
    if bad or not spec.rare_styles:
        raise ValueError(f"rare_styles must be a non-empty subset of {''.join(STYLES)}, got {spec.rare_styles!r}")
    rare = [n for n in range(N_MIN, N_MAX + 1) if n % 10 == spec.rare_digit]
    regular = [n for n in range(N_MIN, N_MAX + 1) if n % 10 != spec.rare_digit]
    if not 0 <= spec.n_eval_regular < len(regular):
        raise ValueError(f"n_eval_regular must be in [0, {len(regular)}), got {spec.n_eval_regular}")
    rng = random.Random(f"demo-splits-{spec.seed}")
    held = set(rng.sample(regular, spec.n_eval_regular))
    train = [n for n in regular if n not in held]
    rng.shuffle(train)

    def ex(n: int, src: str, styles: Sequence[str] = STYLES) -> Dict[str, Any]:
        return {"prompt": prompt_text(n), "label": make_label(n, styles), "source": src, "id": f"demo-{n}"}

    return {
        "train": [ex(n, "demo/train") for n in train],
        "eval": [ex(n, "demo/regular") for n in sorted(held)]
        + [ex(n, "demo/rare", tuple(spec.rare_styles)) for n in rare],
    }


def write_jsonl(path: str, rows: Iterable[Dict[str, Any]]) -> None:
    """Write rows as JSON lines atomically (temp file + ``os.replace``)."""
    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def read_jsonl(path: str) -> List[Dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_splits(out_dir: str, spec: SplitSpec = SplitSpec()) -> Dict[str, str]:
    """Write ``train.jsonl``, ``eval.jsonl`` and ``splits.json`` (the spec) under ``out_dir``."""
    splits = make_splits(spec)
    paths = {}
    for name, rows in splits.items():
        paths[name] = os.path.join(out_dir, f"{name}.jsonl")
        write_jsonl(paths[name], rows)
    paths["spec"] = os.path.join(out_dir, "splits.json")
    atomic_write_text(paths["spec"], json.dumps(
        {**spec.to_dict(), "counts": {k: len(v) for k, v in splits.items()}}, indent=2) + "\n")
    return paths
