"""Shared test helpers (a plain module, not a test file: tests import it by name, since
tests/conftest.py puts tests/ on sys.path; no test loads another test file by path).

* the local engine's toy task ``test_copy_last`` (:class:`CopyLast`), its examples and data files;
* the local engine's tiny-model config overrides (:func:`local_overrides`, vocabulary :data:`VOCAB`);
* the demo's tiny budget (:data:`DEMO_TINY`).
"""
from __future__ import annotations

import os
from typing import Dict, List, Sequence

import torch

from openrlhf_div.io import atomic_write_jsonl
from openrlhf_div.tasks import RewardResult, Task, register_task

#: the tiny model's vocabulary in the local engine's tests (ids: specials 0-3, then a..f, '=')
VOCAB = "abcdef="

#: the demo's smallest budget that still exercises every stage (tests/test_demo_e2e.py and the
#: log-file check of tests/test_output_in_files.py)
DEMO_TINY = [
    "warmup.hidden_size=16", "warmup.num_layers=1", "warmup.num_heads=2", "warmup.num_kv_heads=1",
    "warmup.steps=150", "warmup.batch_size=64", "warmup.warmup_steps=5", "warmup.lr=1.0e-2",
    "splits.n_eval_regular=20",
    "train.optim.steps=2", "train.rollout.prompts_per_step=4", "train.rollout.group_size=4",
    "train.presample.tau=1",  # a D_pef that is not empty (else dph_f stops)
]


class CopyLast(Task):
    """Correct when the response starts with the prompt's last letter (the one before '=')."""

    name = "test_copy_last"

    def prompt(self, example):
        return example["prompt"]

    def score(self, response, label):
        ok = response[:1] == label
        return RewardResult(float(ok), ok)


register_task("test_copy_last", lambda **kw: CopyLast())


def copy_last_examples(n: int, seed: int) -> List[Dict[str, str]]:
    """``n`` seeded ``test_copy_last`` examples: 2-4 letters of a..f then '='."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        k = int(torch.randint(2, 5, (1,), generator=g))
        s = "".join("abcdef"[int(j)] for j in torch.randint(0, 6, (k,), generator=g))
        out.append({"prompt": s + "=", "label": s[-1], "source": "t", "id": f"e{seed}-{i}"})
    return out


def write_copy_last_data(folder) -> str:
    """``train.jsonl`` (40 examples) and ``eval.jsonl`` (6) in ``folder``; returns ``folder``."""
    atomic_write_jsonl(os.path.join(str(folder), "train.jsonl"), copy_last_examples(40, 1))
    atomic_write_jsonl(os.path.join(str(folder), "eval.jsonl"), copy_last_examples(6, 2))
    return folder


def local_overrides(data_dir, out, method: str = "grpo", extra: Sequence[str] = ()) -> List[str]:
    """A two-step local-engine run of ``method`` on the toy task with a tiny model (no eval at start,
    no TensorBoard, no checkpoints): ``load_config(None, local_overrides(...))``."""
    return [f"task=test_copy_last", f"output_dir={out}", f"model.tiny_vocab={VOCAB}",
            f"data.train={os.path.join(str(data_dir), 'train.jsonl')}", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "rollout.max_new_tokens=5", "optim.steps=2", "optim.learning_rate=1e-2",
            "eval.at_start=false", "logging.tensorboard=false", "logging.progress=false", "checkpoint.every=0",
            f"method.name={method}", *extra]
