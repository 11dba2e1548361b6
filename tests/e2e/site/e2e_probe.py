"""Test instrumentation for the CPU end-to-end runs: the Ray head of ``tests/e2e/ray_harness``
(``probe=True``) sets ``OPENRLHF_DIV_SITE_HOOKS`` to this file, and the package's CPU-layer
``sitecustomize`` imports it (as module ``e2e_probe``) in every worker process at start-up; never
production code. It registers its patch through :func:`openrlhf_div.compat.cpu_seams.add_hook`.

After every ``broadcast_to_vllm`` of OpenRLHF's controller (``BasePPOTrainer``, the base of our
``DivPPOTrainer``), it scores one fixed token sequence twice: with the policy actor's own forward
(``PolicyModelActor.forward``, the DeepSpeed model that was just trained) and with vLLM's
``prompt_logprobs`` on the first rollout engine (the weights just received). Both lists go
to ``$RUN_DIR/e2e_probe.jsonl`` with the controller's step counter; the test compares them.
Nothing is changed in what the trainer does.
"""
from __future__ import annotations

import json
import os
import time

PROBE_TEXT = "1 + 2 = 3 4 + 4 = 8 2 + 2 = 4"


def _out_path() -> str:
    root = os.environ.get("RUN_DIR") or "."
    os.makedirs(root, exist_ok=True)
    return os.path.join(root, "e2e_probe.jsonl")


def compare_after_sync(trainer) -> dict:
    import ray
    import torch
    from vllm import SamplingParams

    ids = trainer.tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    seq = torch.tensor([ids], dtype=torch.long)
    attention = torch.ones_like(seq)
    action_mask = torch.ones(1, len(ids) - 1, dtype=torch.bool)
    group = trainer.actor_model_group
    n_actors = len(group._actor_handlers)
    refs = group.async_run_method_batch(method_name="forward", sequences=[seq] * n_actors,
                                        attention_mask=[attention] * n_actors,
                                        action_mask=[action_mask] * n_actors)
    actor_lp = ray.get(refs)[0][0].float().reshape(-1).tolist()
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    out = ray.get(trainer.vllm_engines[0].generate.remote(ids, params))
    vllm_lp = [float(d[t].logprob) for t, d in zip(ids[1:], out.prompt_logprobs[1:])]
    rec = {"event": "sync", "time": time.time(), "ids": ids, "actor": actor_lp, "vllm": vllm_lp,
           "max_abs_diff": max(abs(a - b) for a, b in zip(actor_lp, vllm_lp))}
    with open(_out_path(), "a") as fh:
        fh.write(json.dumps(rec) + "\n")
    return rec


def _patch_ppo_trainer(mod) -> None:
    cls = mod.BasePPOTrainer
    if getattr(cls, "_e2e_probe", False):
        return
    upstream = cls.broadcast_to_vllm

    def broadcast_to_vllm(self):
        upstream(self)
        compare_after_sync(self)

    cls.broadcast_to_vllm = broadcast_to_vllm
    cls._e2e_probe = True


def install() -> None:
    from openrlhf_div.compat import cpu_seams

    cpu_seams.add_hook("openrlhf.trainer.ppo_trainer", _patch_ppo_trainer)


install()  # imported by the CPU layer's sitecustomize
