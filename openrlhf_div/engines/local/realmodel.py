"""Options that matter for real pretrained models in the local engine (all off or neutral for
the demo's tiny model): thread count, learning-rate schedule, gradient checkpointing, LoRA
through ``peft``, and a run config with absolute paths.

* ``num_threads: null`` uses the cores this process may run on (``os.sched_getaffinity``);
  the demo sets 1 (its tiny model is fastest single-threaded).
* ``optim.lr_schedule``: ``constant`` or ``cosine`` after ``optim.warmup_steps`` linear
  warm-up steps, as a function of the RL step only (so ``--resume`` needs no scheduler state):
  ``f(s) = (s + 1) / W`` for ``s < W``, then ``1`` (constant) or
  ``r + (1 - r) (1 + cos(pi (s - W) / (S - W))) / 2`` (cosine, ``r = optim.min_lr_ratio``).
* ``model.gradient_checkpointing``: recompute activations in the backward pass.
* ``model.lora_rank > 0``: train LoRA adapters (``peft``, ``target_modules="all-linear"`` by
  default) instead of all weights; checkpoints hold the adapter (resumed on top of
  ``model.path``), ``final_model`` the merged model.
"""
from __future__ import annotations

import copy
import math
import os
from typing import Optional


def available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def resolve_num_threads(value: Optional[int]) -> int:
    """``num_threads`` of the config: an explicit count, or (null) the available cores."""
    return int(value) if value else available_cores()


def lr_factor(step: int, total_steps: int, schedule: str = "constant", warmup_steps: int = 0,
              min_lr_ratio: float = 0.0) -> float:
    """The learning-rate multiplier of RL step ``step`` (0-based) out of ``total_steps``."""
    W = max(0, int(warmup_steps))
    if step < W:
        return (step + 1) / W
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = max(1, int(total_steps) - W)
        progress = min(1.0, (step - W) / span)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"optim.lr_schedule must be constant or cosine, got {schedule!r}")


def apply_lora(model, rank: int, alpha: Optional[float], dropout: float, target_modules):
    """Wrap ``model`` in LoRA adapters (``peft``); a clear error when peft is missing."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # pragma: no cover - peft is in requirements/cpu.txt
        raise ImportError("model.lora_rank > 0 needs `peft` (pip install peft)") from exc
    cfg = LoraConfig(r=int(rank), lora_alpha=float(alpha if alpha is not None else 2 * rank), lora_dropout=dropout,
                     target_modules=target_modules or "all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def load_lora_checkpoint(base_model, adapter_dir: str):
    """A trainable LoRA model from ``adapter_dir`` (a checkpoint's ``model`` folder) on ``base_model``."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base_model, adapter_dir, is_trainable=True)


def is_lora_dir(path: Optional[str]) -> bool:
    return bool(path) and os.path.exists(os.path.join(path, "adapter_config.json"))


def merged_for_saving(model):
    """The model to write as ``final_model``: LoRA merged into a copy of the base weights."""
    if hasattr(model, "merge_and_unload"):
        return copy.deepcopy(model).merge_and_unload()
    return model


def absolute_paths(cfg):
    """A copy of the config whose local paths are absolute (so `--resume` works from any
    directory): data files, the presample folder, the output dir and a local ``model.path``
    (a Hub id stays as it is)."""
    out = copy.deepcopy(cfg)
    d = out.data
    for name in ("train", "eval", "anchor", "presample_dir"):
        v = getattr(d, name)
        if v:
            setattr(d, name, os.path.abspath(v))
    if out.presample.output_dir:
        out.presample.output_dir = os.path.abspath(out.presample.output_dir)
    out.output_dir = os.path.abspath(out.output_dir)
    if out.model.path and os.path.exists(os.path.expanduser(out.model.path)):
        out.model.path = os.path.abspath(os.path.expanduser(out.model.path))
    from openrlhf_div.plugins import in_effect

    out.plugins = in_effect(out.plugins)  # --plugin ones too: `train --resume` loads them (issue 43 item 2)
    return out
