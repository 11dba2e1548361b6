"""No silent prompt truncation (docs/ALGORITHMS.md section 9 row 12).

OpenRLHF's agent (``openrlhf.utils.agent``) cuts a prompt longer than ``data.max_len -
rollout.max_new_tokens`` tokens from the left, with one log line per prompt on the vLLM actor.
:func:`check_prompt_budget` counts those prompts before a run starts (training and pre-sampling
alike) and stops with the count and the fix unless the config asks for the truncation
(``div.truncate_prompts: true``).
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
                        max_new_tokens, truncate: bool = False, what: str = "data.prompt_dataset") -> dict:
    """``{"prompts", "over", "longest", "budget"}`` for ``prompts`` (rendered as the engine sends
    them; ``count_tokens`` is the tokenizer's count without special tokens). Raises
    :class:`PromptBudgetError` when some prompt is over budget and ``truncate`` is false."""
    budget = prompt_budget(max_len, max_new_tokens)
    lengths = [int(count_tokens(p)) for p in prompts]
    over = sum(1 for n in lengths if n > budget)
    longest = max(lengths, default=0)
    out = {"prompts": len(lengths), "over": over, "longest": longest, "budget": budget}
    if over and not truncate:
        raise PromptBudgetError(
            f"{what}: {over} of {len(lengths)} prompts are longer than the prompt budget of {budget} tokens "
            f"(data.max_len {max_len} - rollout.max_new_tokens {max_new_tokens}; the longest has {longest}): "
            f"OpenRLHF would cut them from the left. Raise data.max_len to at least {longest + max_len - budget}, "
            "or set div.truncate_prompts: true to train on the cut prompts")
    if over:
        print(f"[openrlhf-div] {what}: {over} of {len(lengths)} prompts are cut from the left to {budget} tokens "
              "(div.truncate_prompts: true)", flush=True)
    return out


def tokenizer_counter(tokenizer) -> Callable[[str], int]:
    """The token count OpenRLHF's agent uses (``add_special_tokens=False``)."""
    return lambda text: len(tokenizer(text=text, add_special_tokens=False)["input_ids"])
