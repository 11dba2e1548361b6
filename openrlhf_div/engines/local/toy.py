"""``toy_copy``: a tiny task for smoke tests and the example config of the local engine.

Prompt: a short string of letters ending in ``=`` (``"abca="``); the response is correct
when its first character is the prompt's last letter (``"a..."``). A freshly initialised
character-level model gets it right about once per vocabulary size, so RL has signal from
step 0 and a 2-layer model learns it within tens of steps. Not the demo task.
"""
from __future__ import annotations

import random
from typing import Any, Dict, List

from openrlhf_div.tasks import RewardResult, Task, register_task

LETTERS = "abcdef"
VOCAB = LETTERS + "="


class ToyCopyTask(Task):
    name = "toy_copy"

    def prompt(self, example: Dict[str, Any]) -> str:
        return str(example["prompt"])

    def score(self, response: str, label: Any) -> RewardResult:
        ok = len(response) > 0 and response[0] == str(label)
        return RewardResult(1.0 if ok else 0.0, ok, "ok" if ok else "wrong first character")


def make_examples(n: int, seed: int = 0, min_len: int = 2, max_len: int = 5) -> List[Dict[str, Any]]:
    """``n`` examples ``{"prompt": "abca=", "label": "a", "source": "toy_copy", "id": ...}``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        s = "".join(rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len)))
        out.append({"prompt": s + "=", "label": s[-1], "source": "toy_copy", "id": f"toy-{seed}-{i}"})
    return out


register_task("toy_copy", lambda **kw: ToyCopyTask())
