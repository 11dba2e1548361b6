"""Shared plumbing for the OpenRLHF reward files.

OpenRLHF decodes the whole sequence with ``skip_special_tokens=False`` and passes it as the
query, with the prompt text alongside: the response is the query minus the prompt, with
trailing end-of-sequence / padding markers removed. Labels arrive as strings (JSON for ``sql``
and ``countdown``; the tasks decode them).

Returned per response: ``rewards`` (the task reward), ``scores`` (1.0 if correct else 0.0,
what dynamic filtering should look at; for Countdown the 0.1 format reward is a reward, not a
success) and ``extra_logs`` with 0/1 flags ``correct``, ``no_answer``, ``verifier_timeout``,
``verifier_error``.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, Dict, Sequence, Tuple

_END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<｜end▁of▁sentence｜>",
                "<|end|>", "<eos>", "<pad>", "<|finetune_right_pad_id|>")

_TASKS: Dict[Tuple[str, Tuple], Any] = {}
_LOCK = threading.Lock()


def response_from_query(query: str, prompt: str) -> str:
    """``query`` minus its ``prompt`` prefix, without trailing end/padding markers. If the
    decoded query does not start with the prompt text (a tokenizer round-trip changed it), the
    text after the prompt's last occurrence is used, else the whole query."""
    if prompt and query.startswith(prompt):
        resp = query[len(prompt):]
    elif prompt and prompt in query:
        resp = query[query.rfind(prompt) + len(prompt):]
    else:
        resp = query
    changed = True
    while changed:
        changed = False
        stripped = resp.rstrip()
        for m in _END_MARKERS:
            if stripped.endswith(m):
                resp = stripped[: -len(m)]
                changed = True
                break
    return resp


def env_options(spec: Dict[str, Tuple[str, Callable[[str], Any]]], environ=None) -> Dict[str, Any]:
    """``{option: (ENV_VAR, cast)}`` -> the options whose variables are set (in ``environ``, default
    this process's environment)."""
    environ = os.environ if environ is None else environ
    out = {}
    for opt, (var, cast) in spec.items():
        val = environ.get(var)
        if val not in (None, ""):
            try:
                out[opt] = cast(val)
            except ValueError as exc:
                raise ValueError(f"environment variable {var}={val!r} is not a valid {opt}: {exc}") from None
    return out


def cached_task(name: str, options: Dict[str, Any]):
    """One task object per (name, options) per process (its worker pool is reused)."""
    from openrlhf_div.tasks import get_task

    key = (name, tuple(sorted(options.items())))
    with _LOCK:
        task = _TASKS.get(key)
        if task is None:
            task = _TASKS[key] = get_task(name, **options)
        return task


_NO_ANSWER = ("no answer found", "no SQL found", "no <answer> tag")


def compute(task, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]) -> Dict[str, Any]:
    import torch

    if not (len(queries) == len(prompts) == len(labels)):
        raise ValueError(f"reward_func: got {len(queries)} queries, {len(prompts)} prompts and {len(labels)} labels")
    responses = [response_from_query(q, p) for q, p in zip(queries, prompts)]
    results = task.reward_results(responses, list(labels))
    rewards = torch.tensor([float(r.reward) for r in results], dtype=torch.float32)
    correct = torch.tensor([1.0 if r.correct else 0.0 for r in results], dtype=torch.float32)

    def flag(pred):
        return torch.tensor([1.0 if pred(r.reason) else 0.0 for r in results], dtype=torch.float32)

    return {
        "rewards": rewards,
        "scores": correct,
        "extra_logs": {
            "correct": correct,
            "no_answer": flag(lambda s: s in _NO_ANSWER),
            "verifier_timeout": flag(lambda s: "timeout" in s),
            "verifier_error": flag(lambda s: s.startswith(("verifier error", "sandbox", "database not found"))
                                   or "crash" in s),
        },
    }
