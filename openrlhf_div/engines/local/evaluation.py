"""The local engine's evaluation: the project's one evaluation
(:func:`openrlhf_div.eval.evaluate.evaluate`) with the training engine's KV-cache sampler.

* :func:`evaluate_policy` -- what :class:`~.trainer.Trainer` runs before, during and after
  training: ``n`` samples per held-out prompt at the ``eval.*`` settings, written to the run
  directory's ``eval.json`` / ``samples.jsonl`` / ``results.md`` (the latest evaluation) and
  returned for ``eval.jsonl`` / TensorBoard;
* :func:`evaluate_run_dir` -- the same for a finished (or interrupted) ``train`` run directory
  that holds no ``eval.json``: its final model (or latest checkpoint) on its config's
  ``data.eval`` (``openrlhf-div compare`` calls it).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Sequence

import torch

from openrlhf_div.eval.evaluate import evaluate
from openrlhf_div.eval.results import write_eval
from openrlhf_div.tasks.datasets import render_example

from .sampler_registry import open_sampler
from .samplers import local_generate_fn

EVAL_SEED_OFFSET = 12345  # evaluation samples with its own stream: seed + this


def eval_settings(cfg) -> Dict[str, Any]:
    """``n``, ``ks`` (those ``<= n``), ``temperature``, ``top_p``, ``max_new_tokens`` of a
    :class:`~.config.TrainConfig`'s ``eval`` section (falling back on ``rollout``)."""
    e, r = cfg.eval, cfg.rollout
    n = int(e.n_samples)
    return {"n": n, "ks": [k for k in e.k if 1 <= k <= n] or [1],
            "temperature": float(r.temperature if e.temperature is None else e.temperature),
            "top_p": float(r.top_p if e.top_p is None else e.top_p), "max_new_tokens": int(e.max_new_tokens or r.max_new_tokens)}


def openrlhf_rendering(task, tokenizer, data_cfg):
    """``(prompt_template, system_prompt, render)`` for :func:`openrlhf_div.eval.evaluate.evaluate`:
    OpenRLHF's two renderings (the raw prompt text; the prompt as the user message through the chat
    template, no system message -- what ``openrlhf-div run --engine local`` sets from an experiment
    file) go as a ``render`` function with no template recorded, as the Ray engine's evaluation
    records them, so that the two engines' ``eval.json`` settings agree; any other rendering as
    its template."""
    pt, sp = data_cfg.prompt_template, data_cfg.system_prompt
    if not data_cfg.chat_template:
        return (None if pt in (None, "{prompt}") else pt), None, (
            lambda ex: render_example(task, tokenizer, ex, pt, None, chat_template=False))
    if pt == "{prompt}" and sp == "":
        return None, None, lambda ex: render_example(task, tokenizer, ex, pt, sp)
    return pt, sp, None


@torch.no_grad()
def evaluate_policy(model, tokenizer, task, examples: Sequence[Dict[str, Any]], cfg, *, run_dir: str,
                    name: str, step: int, sampler, model_path: Optional[str] = None) -> Dict[str, Any]:
    """Evaluate ``model`` on ``examples`` with the settings of ``cfg`` (:func:`eval_settings`,
    ``data.prompt_template`` / ``data.system_prompt``), write ``run_dir/eval.json`` (+ samples,
    table) and return the result. Sampling uses its own generator seeded ``seed + 12345``, so
    every evaluation of a run draws the same random numbers. ``sampler``: a :mod:`.sampler_registry`
    sampler holding ``model``'s current weights (the trainer's own)."""
    s = eval_settings(cfg)
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(int(cfg.seed) + EVAL_SEED_OFFSET)
    generate_fn = local_generate_fn(sampler, gen)

    pt, sp, render = openrlhf_rendering(task, tokenizer, cfg.data)
    was_training = model.training
    model.eval()
    try:
        res = evaluate(task, examples, generate_fn, n=s["n"], ks=s["ks"], temperature=s["temperature"],
                       top_p=s["top_p"], max_new_tokens=s["max_new_tokens"], tokenizer=tokenizer,
                       keep_k=min(8, s["n"]), batch_size=max(1, len(examples)), progress=False,
                       prompt_template=pt, system_prompt=sp, render=render)
    finally:
        if was_training:
            model.train()
    write_eval(run_dir, res, name=name, role="method", seed=cfg.seed, info={"source": "train", "step": int(step)},
               model=model_path or cfg.model.path, engine="local", data_paths=[cfg.data.eval])
    return res


def evaluate_run_dir(run_dir: str) -> str:
    """Evaluate a ``train`` run directory's final model (``final_model``, else its latest
    checkpoint) on its config's ``data.eval``; writes and returns ``run_dir/eval.json``."""
    from openrlhf_div.tasks import get_task

    from .checkpoint import resume_checkpoint
    from .config import load_config
    from .data import load_task_examples
    from .models import build_policy, resolve_device

    cfg_path = os.path.join(run_dir, "config.yaml")
    cfg = load_config(cfg_path)
    if not cfg.data.eval:
        raise ValueError(f"{run_dir}: a train run without evaluation data (data.eval is unset in {cfg_path}) and "
                         f"no eval.json; evaluate its model with `openrlhf-div eval --model "
                         f"{os.path.join(run_dir, 'final_model')} ... --role trained --out {run_dir}`")
    final = os.path.join(run_dir, "final_model")
    step = None
    if os.path.isdir(final):
        path = final
    else:
        ckpt = resume_checkpoint(os.path.join(run_dir, "checkpoints"))
        if ckpt is None:
            raise FileNotFoundError(f"{run_dir}: neither final_model/ nor a checkpoint to evaluate")
        path = os.path.join(ckpt, "model")
        step = int(os.path.basename(ckpt).split("_")[-1])
    device = resolve_device(cfg.device)
    model, tok = build_policy(cfg, device, path)
    task = get_task(cfg.task, **(cfg.task_options or {}))
    examples, _ = load_task_examples(cfg, cfg.data.eval, split=cfg.data.eval_split)
    if cfg.eval.max_prompts is not None:
        examples = examples[:cfg.eval.max_prompts]
    if step is None:
        step = cfg.optim.steps
    # the KV-cache sampler, as before the registry: starting a vLLM engine costs more than this evaluation
    sampler = open_sampler("hf", model, tok, cfg.rollout, device=device, seed=cfg.seed)
    evaluate_policy(model, tok, task, examples, cfg, run_dir=run_dir, name=str(cfg.method.get("name")),
                    step=step, model_path=path, sampler=sampler)
    return os.path.join(run_dir, "eval.json")


def eval_row(step: int, result: Dict[str, Any]) -> Dict[str, Any]:
    """One ``eval.jsonl`` row from an :func:`evaluate_policy` result: ``step``, ``n_prompts``,
    ``n_samples``, ``reward_mean``, ``pass@k`` for the configured ``k`` and the whole
    ``pass_at_k`` curve (``{"1": .., .., "n": ..}``)."""
    M, ks = result["metrics"], result["settings"]["ks"]
    row: Dict[str, Any] = {"step": int(step), "n_prompts": M["n_problems"], "n_samples": M["n_samples"],
                           "reward_mean": M.get("mean_reward", 0.0)}
    for k in ks:
        row[f"pass@{k}"] = M["pass_at_k"][str(k)]
    row["pass_at_k"] = dict(M["pass_at_k"])
    return row
