"""No silent prompt truncation (docs/ALGORITHMS.md section 9 row 12).

OpenRLHF's agent (``openrlhf.utils.agent``) cuts a prompt longer than ``data.max_len -
rollout.max_new_tokens`` tokens from the left, with one log line per prompt on the vLLM actor.
:func:`check_prompt_budget` counts those prompts before a run starts (training and pre-sampling
alike) and stops with the count and the fix unless the config asks for the truncation
(``div.truncate_prompts: true``) or for the authors' way (``div.drop_long_prompts: true``: the
DPH-RL fork's ``filter_overlong_prompts`` drops them from the data set; the count goes to the log
and to the run's ``run_info.json``, :func:`record_dropped`).
"""
from __future__ import annotations

from typing import Callable, Sequence


class PromptBudgetError(ValueError):
    """Prompts longer than the prompt budget, and truncation not asked for."""


def prompt_budget(max_len: int, max_new_tokens) -> int:
    """Tokens a prompt may have: ``data.max_len - rollout.max_new_tokens`` (OpenRLHF's agent)."""
    if max_new_tokens is None:
        return int(max_len) - 1  # dynamic max_tokens: the prompt keeps at least one token of room
    return int(max_len) - int(max_new_tokens)


def check_prompt_budget(prompts: Sequence[str], count_tokens: Callable[[str], int], *, max_len: int,
                        max_new_tokens, truncate: bool = False, drop: bool = False,
                        what: str = "data.prompt_dataset") -> dict:
    """``{"prompts", "over", "longest", "budget", "keep"}`` for ``prompts`` (rendered as the engine
    sends them; ``count_tokens`` is the tokenizer's count without special tokens; ``keep``: the
    indices of the prompts within budget). Raises :class:`PromptBudgetError` when some prompt is
    over budget and neither ``truncate`` nor ``drop`` is set, or when ``drop`` would leave none."""
    if truncate and drop:
        raise PromptBudgetError("div.truncate_prompts and div.drop_long_prompts are both true: choose one "
                                "(cut long prompts, or drop them as the DPH-RL authors do)")
    budget = prompt_budget(max_len, max_new_tokens)
    lengths = [int(count_tokens(p)) for p in prompts]
    over = sum(1 for n in lengths if n > budget)
    longest = max(lengths, default=0)
    out = {"prompts": len(lengths), "over": over, "longest": longest, "budget": budget,
           "keep": [i for i, n in enumerate(lengths) if n <= budget]}
    if drop:
        if over == len(lengths) and over:
            raise PromptBudgetError(
                f"{what}: all {over} prompts are longer than the prompt budget of {budget} tokens (data.max_len "
                f"{max_len} - rollout.max_new_tokens {max_new_tokens}); div.drop_long_prompts would leave none: "
                f"raise data.max_len to at least {longest + max_len - budget}")
        print(f"[openrlhf-div] {what}: dropped {over} of {len(lengths)} prompts longer than the prompt budget of "
              f"{budget} tokens (div.drop_long_prompts: true, as the DPH-RL authors' filter_overlong_prompts)",
              flush=True)
        return out
    if over and not truncate:
        raise PromptBudgetError(
            f"{what}: {over} of {len(lengths)} prompts are longer than the prompt budget of {budget} tokens "
            f"(data.max_len {max_len} - rollout.max_new_tokens {max_new_tokens}; the longest has {longest}): "
            f"OpenRLHF would cut them from the left. Raise data.max_len to at least {longest + max_len - budget}, "
            "or set div.drop_long_prompts: true to drop them (the DPH-RL authors' way) or div.truncate_prompts: "
            "true to train on the cut prompts")
    if over:
        print(f"[openrlhf-div] {what}: {over} of {len(lengths)} prompts are cut from the left to {budget} tokens "
              "(div.truncate_prompts: true)", flush=True)
    return out


def tokenizer_counter(tokenizer) -> Callable[[str], int]:
    """The token count OpenRLHF's agent uses (``add_special_tokens=False``)."""
    return lambda text: len(tokenizer(text=text, add_special_tokens=False)["input_ids"])


def keep_rows(dataset, keep: Sequence[int]) -> None:
    """Keep only the rows ``keep`` of an OpenRLHF ``PromptDataset`` (its parallel per-row lists)."""
    for attr in ("prompts", "labels", "images", "datasources"):
        rows = getattr(dataset, attr, None)
        if isinstance(rows, list):
            setattr(dataset, attr, [rows[i] for i in keep])


def record_dropped(run_dir: str, what: str, summary: dict) -> None:
    """``run_info.json``'s ``"dropped_long_prompts"``: ``{what: {"dropped", "of", "budget"}}`` (the
    driver writes the file before the trainer starts; a missing file is left alone)."""
    import json
    import os

    from openrlhf_div.io import atomic_write_json

    path = os.path.join(run_dir, "run_info.json")
    if not os.path.isfile(path):
        return
    with open(path) as fh:
        info = json.load(fh)
    info.setdefault("dropped_long_prompts", {})[what] = {
        "dropped": summary["over"], "of": summary["prompts"], "budget": summary["budget"]}
    atomic_write_json(path, info, default=str)
