"""The evaluation sampling contract, engine-free.

A ``generate_fn(prompts, n=, temperature=, top_p=, max_new_tokens=, greedy=)`` returns, for each
``prompts[i]``, the list of ``n`` decoded completions (prompt removed, special tokens skipped),
each a :class:`Completion` (a ``str`` that also carries ``truncated``: the response hit
``max_new_tokens`` without an end token). :func:`openrlhf_div.eval.evaluate.evaluate` takes any
such function, so any engine can be plugged in. The functions that bind a model to it live with
the engines that own models: :mod:`openrlhf_div.engines.local.samplers` (the local engine's
KV-cache sampler, Hugging Face ``model.generate``, vLLM; ``make_generate_fn`` loads a model
folder for ``openrlhf-div eval``) and :mod:`openrlhf_div.engines.openrlhf.evaluate` (the Ray
driver's vLLM engines).
"""
from __future__ import annotations

import importlib.util
from typing import Callable, List, Optional

__all__ = ["Completion", "GenerateFn", "vllm_available"]

GenerateFn = Callable[..., List[List[str]]]


class Completion(str):
    """A decoded completion that remembers whether it was cut at ``max_new_tokens``."""

    truncated: Optional[bool] = None

    def __new__(cls, text: str, truncated: Optional[bool] = None):
        obj = super().__new__(cls, text)
        obj.truncated = truncated
        return obj


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None
