"""What the local engine may skip or regroup without changing a single loss value (issue 32).

* **On-policy shortcut** (:func:`shortcut_decision`): when a rollout batch gets exactly one
  optimizer pass over one mini-batch, the policy that sampled it is the policy the training
  forward runs (no weight update in between), so the old (behaviour) log-probs are that forward's
  own log-probs, detached: the separate no-grad old-log-prob forward is skipped. The importance
  ratio is then 1 in value and its gradient the policy gradient, exactly what the recompute path
  gives up to float rounding (TRL's GRPOTrainer does the same). It switches itself off when the
  premise fails: several epochs or mini-batches (the weights move between passes), the rollout
  side reads old log-probs before training (reward shaping, e.g. unlikeliness; rollout-time
  advantage reshaping, e.g. DS), active dropout (two forwards would differ), or
  ``rollout.recompute_old_log_probs: false`` (the sampler's log-probs are used, no forward to save).
* **Length buckets** (:func:`bucket_decision`, :func:`bucketed`, :func:`trim`): micro-batches are
  formed from rows of similar length, and each is cut to its own widest prompt and response, so
  padded positions are a small share of the computed tokens, in the no-grad log-prob forwards
  (old, reference) and in training. The loss is a sum over micro-batches normalised by the
  mini-batch's totals, so the grouping does not change it - except where a method's loss depends
  on which rows share a micro-batch: the authors' ``micro-batch-token-mean`` layout and the losses
  that take statistics over a micro-batch's tokens (Clip-Cov, KL-Cov: ``batch_statistics``); there
  the layout wins and bucketing stays off, said once in the log.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


# ------------------------------------------------------------------------------ shortcut
def rollout_reads_old_log_probs(method) -> Optional[str]:
    """Which part of ``method``'s rollout side reads the old log-probs (None: none does)."""
    from openrlhf_div.algorithms.registry import ADV_RESHAPING

    if method.reward_shaping:
        return f"its reward shaping ({', '.join(method.reward_shaping)}) reads them at rollout time"
    at_rollout = [n for n in method.adv_reshaping if ADV_RESHAPING[n].at == "rollout"]
    if at_rollout:
        return f"its advantage reshaping ({', '.join(at_rollout)}) reads them at rollout time"
    return None


def active_dropout(model) -> Optional[str]:
    """A dropout that would make two forwards of the same weights differ in training mode."""
    cfg = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop",
                "hidden_dropout_prob", "attention_probs_dropout_prob"):
        if float(getattr(cfg, key, 0.0) or 0.0) > 0:
            return f"model.config.{key} = {getattr(cfg, key)}"
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Dropout) and mod.p > 0:
            return f"dropout p={mod.p} in {name or 'the model'}"
    return None


def shortcut_decision(cfg, method, model) -> Tuple[bool, str]:
    """``(on, why)`` for the on-policy shortcut (module docstring)."""
    r, o = cfg.rollout, cfg.optim
    if not r.on_policy_shortcut:
        return False, "rollout.on_policy_shortcut=false"
    if not r.recompute_old_log_probs:
        return False, "rollout.recompute_old_log_probs=false (the sampler's log-probs are the old ones)"
    if o.ppo_epochs != 1 or o.mini_batches != 1:
        return False, (f"optim.ppo_epochs={o.ppo_epochs}, optim.mini_batches={o.mini_batches}: the weights move "
                       f"between passes, so old log-probs need their own forward")
    reads = rollout_reads_old_log_probs(method)
    if reads:
        return False, f"method {method.name}: {reads}"
    drop = active_dropout(model)
    if drop:
        return False, f"active dropout ({drop})"
    return True, "one optimizer pass over one mini-batch"


# ------------------------------------------------------------------------------ buckets
def grouping_dependence(method) -> Optional[str]:
    """Why ``method``'s loss depends on which rows share a micro-batch (None: it does not)."""
    if method.aggregation == "micro-batch-token-mean":
        return "aggregation micro-batch-token-mean (the authors' micro-batch layout)"
    stats = [c.name for c in method.components() if getattr(c, "batch_statistics", False)]
    if stats:
        return f"{', '.join(stats)} takes statistics over a micro-batch's tokens"
    return None


def bucket_decision(cfg, method) -> Tuple[bool, str]:
    """``(on, why)`` for length buckets in training (the no-grad forwards bucket whenever
    ``optim.length_buckets`` is on: no loss is computed there)."""
    if not cfg.optim.length_buckets:
        return False, "optim.length_buckets=false"
    dep = grouping_dependence(method)
    if dep:
        return False, f"method {method.name}: {dep}; the layout wins"
    return True, "rows of similar length share a micro-batch"


def bucketed(rows: Sequence[int], lengths: Sequence[int]) -> List[int]:
    """``rows`` ordered by ``lengths[row]`` (stable: equal lengths keep their order)."""
    return sorted(rows, key=lambda i: int(lengths[i]))


def trim(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor):
    """Rows of the action layout (:mod:`.generation`) cut to their own widest prompt and
    response: the left-padding columns no row uses and the right-padding columns after the
    longest response go. Exact: cut columns are padding (attention 0) in every row, and position
    ids come from the mask. Returns ``(input_ids, attention_mask, response_mask)``."""
    R = response_mask.shape[1]
    P = input_ids.shape[1] - R
    prompt_len = attention_mask[:, :P].sum(1)
    p = max(1, int(prompt_len.max())) if prompt_len.numel() else P
    r = max(1, int(response_mask.sum(1).max())) if response_mask.numel() else R
    return input_ids[:, P - p:P + r], attention_mask[:, P - p:P + r], response_mask[:, :r]


class PaddingMeter:
    """Computed vs useful token positions of a phase's forwards; ``share`` is the padded share."""

    def __init__(self):
        self.computed = 0
        self.useful = 0

    def add(self, attention_mask: torch.Tensor) -> None:
        self.computed += int(attention_mask.numel())
        self.useful += int(attention_mask.sum())

    @property
    def share(self) -> float:
        return 1.0 - self.useful / self.computed if self.computed else 0.0
