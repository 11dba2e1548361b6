"""Evaluate a model on the demo task (or any task whose RewardResult.info carries a style).

``n`` samples per problem from the local engine's sampler at the rollout temperature, each
scored by the task; the scored samples become the metric dict ``M``
(:func:`openrlhf_div.eval.results.model_metrics`) and the run directory's ``eval.json`` /
``samples.jsonl``. ``openrlhf-div compare`` reads those files back.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..eval.results import atomic_write_text, model_metrics, write_eval_json
from ..tasks import get_task


def sample_problems(model, tokenizer, examples: Sequence[Mapping[str, Any]], *, task: str = "demo",
                    n_samples: int = 16, temperature: float = 1.0, max_new_tokens: int = 10,
                    seed: int = 0, batch_size: int = 4096) -> List[Dict[str, Any]]:
    """Sample and score: one record per example, ``{id, source, label, responses, correct,
    styles, reasons}`` (``styles`` from ``RewardResult.info["style"]``, None when absent)."""
    from ..engines.local.generation import generate

    t = get_task(task)
    prompts = [t.prompt(dict(e)) for e in examples]
    gen = torch.Generator().manual_seed(int(seed))
    out = generate(model, tokenizer, prompts, n_samples=n_samples, max_new_tokens=max_new_tokens,
                   temperature=temperature, generator=gen, batch_size=batch_size)
    recs = []
    for i, e in enumerate(examples):
        texts = out.texts[i * n_samples:(i + 1) * n_samples]
        scored = [t.reward_result(x, e["label"]) for x in texts]
        styles = [r.info.get("style") for r in scored]
        recs.append({
            "id": str(e.get("id", i)), "source": str(e.get("source", "")), "label": e["label"],
            "responses": texts, "correct": [int(r.correct) for r in scored],
            "styles": styles if all(s is not None for s in styles) else None,
            "reasons": [r.reason for r in scored],
        })
    return recs


def evaluate_model(model, tokenizer, examples: Sequence[Mapping[str, Any]], *, base_problems=None,
                   is_base: bool = False, styles: Optional[Sequence[str]] = None,
                   **sample_kw) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """``(M, problems)``: sample, score and compute the metrics (keep / explore against
    ``base_problems``; ``is_base`` for the base itself)."""
    problems = sample_problems(model, tokenizer, examples, **sample_kw)
    M = model_metrics(problems, base=base_problems, is_base=is_base, styles=styles)
    return M, problems


def save_evaluation(run_dir: str, *, task: str, name: str, role: str, metrics: Mapping[str, Any],
                    problems: Sequence[Mapping[str, Any]], seed: Optional[int] = None,
                    settings: Optional[Mapping[str, Any]] = None) -> str:
    """Write ``eval.json`` and ``samples.jsonl`` (every sample's text, style and verdict)."""
    os.makedirs(run_dir, exist_ok=True)
    lines = []
    for p in problems:
        for j, text in enumerate(p["responses"]):
            lines.append(json.dumps({"id": p["id"], "source": p["source"], "label": p["label"], "sample": j,
                                     "response": text, "correct": p["correct"][j],
                                     "style": (p["styles"] or [None] * len(p["responses"]))[j],
                                     "reason": p["reasons"][j]}) + "\n")
    atomic_write_text(os.path.join(run_dir, "samples.jsonl"), "".join(lines))
    return write_eval_json(run_dir, task=task, name=name, role=role, metrics=metrics, problems=problems,
                           seed=seed, settings=settings)
