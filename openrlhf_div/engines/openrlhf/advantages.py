"""The experience maker's advantage path as one pure function of (rewards, masks, log-probs, method).

No Ray, vLLM or OpenRLHF import: the OpenRLHF experience maker calls :func:`rollout_advantages`
on the whole rollout batch, and any other engine (or a test) can call it on the same tensors
and must get the same advantages.

For ``N = B * G`` responses grouped contiguously by prompt, with task rewards ``R``,
behaviour-policy log-probs ``old`` and response masks ``m`` (all ``[N, T]``):

1. ``correct_i = R_i >= correct_threshold`` (on the *task* rewards, before shaping);
2. ``R'`` = ``method.shape_rewards(R, G, seq_mean_old_log_probs=mean_t old, lengths=L)``
   (DAPO overlong shaping, unlikeliness reward);
3. ``keep`` = ``method.keep_groups(correct, G)`` broadcast to responses (DAPO dynamic sampling:
   mixed correctness, the criterion of OpenRLHF's generator-level refill on ``scores`` and of the
   local engine's refill; all True otherwise);
4. ``A`` = ``method.advantages(R', G, old_log_probs=old, mask=m, correct=correct)``
   (estimator, then DS reshaping; EntAdv is applied later, in the loss, where ``H_t`` lives);
5. responses of dropped groups get ``A = 0`` and ``m = 0``: they then add neither tokens nor
   sequences to the loss normalisers, which is exactly dropping them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from openrlhf_div.algorithms.registry import Method


@dataclass
class RolloutAdvantages:
    advantages: torch.Tensor      # [N, T] token-level, zero outside the (kept) mask
    mask: torch.Tensor            # [N, T] the response mask with dropped groups zeroed
    shaped_rewards: torch.Tensor  # [N]
    correct: torch.Tensor         # [N] bool, from the task rewards
    keep: torch.Tensor            # [N] bool, False for responses of dropped groups


def rollout_advantages(
    method: Method,
    rewards: torch.Tensor,
    old_log_probs: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    lengths: Optional[torch.Tensor] = None,
) -> RolloutAdvantages:
    """Advantages of one rollout batch (see the module docstring for the exact steps)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
    if old_log_probs.dim() != 2 or old_log_probs.shape != mask.shape:
        raise ValueError(
            f"old_log_probs {tuple(old_log_probs.shape)} and mask {tuple(mask.shape)} must both be [N, T]"
        )
    if rewards.numel() != old_log_probs.shape[0]:
        raise ValueError(f"{rewards.numel()} rewards for {old_log_probs.shape[0]} responses")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} responses are not a whole number of groups of {group_size} "
            "(--rollout.n_samples_per_prompt)"
        )
    old = old_log_probs.float()
    m = mask.to(torch.float32)
    correct = method.is_correct(rewards)
    seq_mean_old = (old * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    shaped = method.shape_rewards(rewards, group_size, seq_mean_old_log_probs=seq_mean_old,
                                  lengths=lengths)
    keep = method.keep_groups(correct.float(), group_size).repeat_interleave(group_size)
    adv = method.advantages(shaped, group_size, old_log_probs=old, mask=m, correct=correct)
    keep_f = keep.to(torch.float32).unsqueeze(-1)
    return RolloutAdvantages(advantages=adv * keep_f, mask=m * keep_f, shaped_rewards=shaped,
                             correct=correct, keep=keep)
