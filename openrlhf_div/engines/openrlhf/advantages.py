"""The experience maker's advantage path: :meth:`Method.rollout` on the whole rollout batch.

No Ray, vLLM or OpenRLHF import. For ``N = B * G`` responses grouped contiguously by prompt,
:meth:`~openrlhf_div.algorithms.registry.Method.rollout` gives the correctness of the task rewards,
the shaped rewards, the kept groups and the ``[N, T]`` advantages -- the one rollout pipeline the
local engine runs too. What is OpenRLHF's here: responses of dropped groups get ``A = 0`` and
``m = 0`` (OpenRLHF trains on every row of the buffer), so they add neither tokens nor sequences
to the loss normalisers, which is exactly dropping them.
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
    """Advantages of one rollout batch (see the module docstring)."""
    m = mask.to(torch.float32)
    ro = method.rollout(rewards, group_size, old_log_probs=old_log_probs.float(), mask=m, lengths=lengths)
    keep = ro.keep.repeat_interleave(group_size)
    keep_f = keep.to(torch.float32).unsqueeze(-1)
    return RolloutAdvantages(advantages=ro.advantages * keep_f, mask=m * keep_f, shaped_rewards=ro.rewards,
                             correct=ro.correct, keep=keep)
