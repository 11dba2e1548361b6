"""Evaluate a model in the demo: the project's one evaluation
(:func:`openrlhf_div.eval.evaluate.evaluate`) with the local engine's sampler.

``n`` samples per problem at the evaluation temperature, each scored by the task (the demo's
``RewardResult.info`` carries the style, so the metrics hold the style counts); the result is
written with :func:`openrlhf_div.eval.results.write_eval` (``eval.json``, ``samples.jsonl``,
``results.md``), which ``openrlhf-div compare`` reads back.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

import torch

from ..eval.evaluate import evaluate
from ..engines.local.sampler_registry import open_sampler
from ..engines.local.samplers import local_generate_fn
from ..tasks import get_task


def evaluate_model(model, tokenizer, examples: Sequence[Mapping[str, Any]], *, base_problems=None,
                   is_base: bool = False, styles: Optional[Sequence[str]] = None, task: str = "demo",
                   n_samples: int = 16, temperature: float = 1.0, max_new_tokens: int = 10, seed: int = 0,
                   keep_k: int = 8) -> Dict[str, Any]:
    """Sample ``n_samples`` per example (one generator seeded ``seed``, all prompts in one
    batch), score and summarise; keep / explore against ``base_problems`` (``is_base`` for
    the base itself). Returns the :func:`~openrlhf_div.eval.evaluate.evaluate` result."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(int(seed))
    generate_fn = local_generate_fn(open_sampler("hf", model, tokenizer, None, device=gen.device, seed=int(seed)), gen)

    was_training = model.training
    model.eval()
    try:
        return evaluate(get_task(task), [dict(e) for e in examples], generate_fn, n=n_samples,
                        ks=[k for k in (1, 8, 16) if k <= n_samples], temperature=temperature,
                        max_new_tokens=max_new_tokens, tokenizer=tokenizer, keep_k=min(keep_k, n_samples),
                        base_results={"problems": base_problems} if base_problems else None, is_base=is_base,
                        styles=styles, batch_size=max(1, len(examples)), progress=False)
    finally:
        if was_training:
            model.train()
