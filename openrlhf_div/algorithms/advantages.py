"""Advantage estimators and advantage/reward reshaping (ALGORITHMS.md sections 1 and 3).

Rewards for ``B`` prompts x ``G`` responses are a flat ``[B*G]`` tensor grouped
contiguously (responses of one prompt next to each other), as OpenRLHF lays them out.
"""
from __future__ import annotations

import math

import torch

from ._utils import check_same_shape, fill_masked, unknown_name_error

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
DS_GRANULARITIES = ("token", "seq_mean", "seq_sum")


def _groups(rewards: torch.Tensor, group_size: int, name: str = "rewards") -> torch.Tensor:
    if not isinstance(rewards, torch.Tensor):
        rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() != 1:
        raise ValueError(f"{name} must be a flat [B*G] tensor, got shape {tuple(rewards.shape)}")
    if int(group_size) < 1 or rewards.numel() % int(group_size) != 0:
        raise ValueError(
            f"{name} has {rewards.numel()} entries, not a multiple of group_size={group_size}"
        )
    return rewards.reshape(-1, int(group_size))


def group_advantages(rewards: torch.Tensor, group_size: int, estimator: str = "grpo") -> torch.Tensor:
    """Sequence-level advantages ``[B*G]`` from grouped rewards ``[B*G]``.

    * ``grpo`` (OpenRLHF's group_norm): ``(R_i - mean_g R) / (std_g R + 1e-6)``, unbiased std
      (torch's default, as OpenRLHF and verl); a group of one gets std 0.
    * ``dr_grpo``: ``R_i - mean_g R``
    * ``rloo``: ``R_i - mean_{j != i} R_j = G/(G-1) (R_i - mean_g R)``; needs ``G >= 2``.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise unknown_name_error("advantage estimator", estimator, ADVANTAGE_ESTIMATORS)
    r = _groups(rewards, group_size)
    if not torch.is_floating_point(r):
        r = r.to(torch.float32)
    mean = r.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        std = r.std(dim=1, keepdim=True) if r.shape[1] > 1 else torch.zeros_like(mean)
        adv = (r - mean) / (std + 1e-6)
    elif estimator == "dr_grpo":
        adv = r - mean
    else:
        g = r.shape[1]
        if g < 2:
            raise ValueError("rloo needs group_size >= 2")
        adv = (r - mean) * g / (g - 1)
    return adv.reshape(-1)


# ---------------------------------------------------------------- Differential Smoothing
def ds_reshape_advantages(
    advantages: torch.Tensor,
    correct: torch.Tensor,
    old_log_probs: torch.Tensor,
    mask: torch.Tensor,
    gamma_p: float = 0.01,
    gamma_n: float = 0.01,
    granularity: str = "token",
) -> torch.Tensor:
    """Differential Smoothing (DS paper, Sec. 4.2), applied after GRPO normalisation.

    * correct response:   ``A'_t = A - gamma_p * lp``
    * incorrect response: ``A'_t = A + gamma_n * lp``

    where ``lp`` is ``pi_old``'s log-probability at the chosen ``granularity``: ``token``
    (``old_t``), ``seq_mean`` (``mean_t old_t``) or ``seq_sum`` (``log pi_old(y)``).
    ``advantages`` is ``[B]`` or ``[B, T]``; ``correct`` is ``[B]`` (bool or 0/1).
    Returns ``[B, T]``, zero where ``mask`` is 0. ``gamma_n = 0`` gives ``ds_positive``,
    ``gamma_p = 0`` gives ``ds_negative``.
    """
    check_same_shape("old_log_probs", old_log_probs, mask=mask)
    if granularity not in DS_GRANULARITIES:
        raise unknown_name_error("DS granularity", granularity, DS_GRANULARITIES)
    B = old_log_probs.shape[0]
    correct = torch.as_tensor(correct, device=old_log_probs.device)
    if correct.dim() != 1 or correct.shape[0] != B:
        raise ValueError(f"correct must be [B] = [{B}], got shape {tuple(correct.shape)}")
    m = mask.to(old_log_probs.dtype)
    old = fill_masked(old_log_probs.detach(), mask)
    if granularity == "token":
        lp = old
    else:
        s = old.sum(dim=1, keepdim=True)
        if granularity == "seq_mean":
            s = s / m.sum(dim=1, keepdim=True).clamp(min=1.0)
        lp = s.expand_as(old)
    if advantages.dim() == 1:
        if advantages.shape[0] != B:
            raise ValueError(f"advantages has {advantages.shape[0]} entries, batch has {B}")
        adv = advantages.to(old.dtype).unsqueeze(-1).expand_as(old)
    else:
        check_same_shape("old_log_probs", old_log_probs, advantages=advantages)
        adv = advantages.to(old.dtype)
    c = correct.to(torch.bool).unsqueeze(-1)
    out = torch.where(c, adv - gamma_p * lp, adv + gamma_n * lp)
    return fill_masked(out, mask)


# ---------------------------------------------------------------- Unlikeliness reward
def unlikeliness_rewards(
    rewards: torch.Tensor, seq_mean_log_probs: torch.Tensor, group_size: int, beta: float = 0.25
) -> torch.Tensor:
    """Unlikeliness reward (He et al. 2025): ``R_i <- R_i * (1 - beta * rank_i / G)``.

    ``rank`` orders the responses of a group by ``seq_mean_log_probs`` (length-normalised
    ``pi_old`` log-prob) ascending, ``rank = 0`` the least likely: the likeliest correct
    answers are discounted most. Ties keep their order in the group (stable sort).
    GRPO normalisation follows (the caller's advantage estimator).
    """
    r = _groups(rewards, group_size)
    lp = _groups(seq_mean_log_probs, group_size, "seq_mean_log_probs")
    order = torch.sort(lp, dim=1, stable=True).indices
    rank = torch.empty_like(order)
    ar = torch.arange(r.shape[1], device=order.device).expand_as(order)
    rank.scatter_(1, order, ar)
    g = r.shape[1]
    return (r * (1.0 - beta * rank.to(r.dtype) / g)).reshape(-1)


# ---------------------------------------------------------------- Pass@k training
def _comb_ratio(a: int, b: int, n: int, k: int) -> float:
    """``C(a, b) / C(n, k)`` as a float, 0 when ``a < b`` (exact integers)."""
    if b < 0 or a < b:
        return 0.0
    return math.comb(a, b) / math.comb(n, k)


def passk_advantages(rewards: torch.Tensor, group_size: int, k: int = 4) -> torch.Tensor:
    """Analytical Pass@k advantage (Chen et al. 2025) for binary rewards, ``[B*G]``.

    With ``n = G`` samples and ``c`` correct: ``rho = 1 - C(n-c, k)/C(n, k)``,
    ``sigma = sqrt(rho (1 - rho))``; correct responses get ``(1 - rho)/(sigma + 1e-6)``,
    incorrect ones ``(1 - rho - C(n-c-1, k-1)/C(n-1, k-1)) / (sigma + 1e-6)``.
    """
    r = _groups(rewards, group_size)
    n = r.shape[1]
    if not (1 <= k <= n):
        raise ValueError(f"passk_advantages needs 1 <= k <= group_size, got k={k}, group_size={n}")
    correct = r >= 0.5
    c = correct.sum(dim=1).tolist()
    out = torch.empty_like(r, dtype=torch.float32 if not torch.is_floating_point(r) else r.dtype)
    for gi, cc in enumerate(c):
        rho = 1.0 - _comb_ratio(n - cc, k, n, k)
        sigma = math.sqrt(max(rho * (1.0 - rho), 0.0))
        a_pos = (1.0 - rho) / (sigma + 1e-6)
        a_neg = (1.0 - rho - _comb_ratio(n - cc - 1, k - 1, n - 1, k - 1)) / (sigma + 1e-6)
        out[gi] = torch.where(correct[gi], torch.tensor(a_pos, dtype=out.dtype),
                              torch.tensor(a_neg, dtype=out.dtype))
    return out.reshape(-1)


def pkpo_advantages(rewards: torch.Tensor, group_size: int, k: int = 4) -> torch.Tensor:
    """PKPO (Walder & Karkhanis 2025) for binary rewards, ``[B*G]``.

    Transformed rewards: correct ``k/n``, incorrect ``(k/n)(1 - C(n-c-1, k-1)/C(n-1, k-1))``;
    then a leave-one-out baseline ``s_i - mean_{j != i} s_j``.
    """
    r = _groups(rewards, group_size)
    n = r.shape[1]
    if not (1 <= k <= n) or n < 2:
        raise ValueError(f"pkpo_advantages needs 1 <= k <= group_size and group_size >= 2, "
                         f"got k={k}, group_size={n}")
    correct = r >= 0.5
    c = correct.sum(dim=1).tolist()
    s = torch.empty_like(r, dtype=torch.float32 if not torch.is_floating_point(r) else r.dtype)
    for gi, cc in enumerate(c):
        pos = k / n
        neg = (k / n) * (1.0 - _comb_ratio(n - cc - 1, k - 1, n - 1, k - 1))
        s[gi] = torch.where(correct[gi], torch.tensor(pos, dtype=s.dtype), torch.tensor(neg, dtype=s.dtype))
    loo = (s.sum(dim=1, keepdim=True) - s) / (n - 1)
    return (s - loo).reshape(-1)


# ---------------------------------------------------------------- EntAdv
def entropy_advantages(
    advantages: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor,
    alpha: float = 0.4, kappa: float = 2.0,
) -> torch.Tensor:
    """EntAdv (Cheng et al. 2025): ``A_t + min(alpha * sg(H_t), |A_t| / kappa)``, ``[B, T]``."""
    check_same_shape("entropy", entropy, mask=mask)
    adv = advantages.to(entropy.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand_as(entropy)
    check_same_shape("entropy", entropy, advantages=adv)
    bonus = torch.minimum(alpha * fill_masked(entropy.detach(), mask), adv.abs() / kappa)
    return fill_masked(adv + bonus, mask)


# ---------------------------------------------------------------- DAPO pieces
def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO's soft overlong punishment per response length ``L``.

    0 for ``L <= L_max - L_c``; ``((L_max - L_c) - L) / L_c`` for ``L_max - L_c < L <= L_max``;
    ``-1`` beyond ``L_max``. Added to the task reward.
    """
    if cache_len <= 0 or cache_len > max_len:
        raise ValueError(f"overlong shaping needs 0 < cache_len <= max_len, got {cache_len}, {max_len}")
    L = torch.as_tensor(lengths, dtype=torch.float32)
    expected = max_len - cache_len
    pen = (expected - L) / cache_len
    pen = torch.where(L <= expected, torch.zeros_like(L), pen)
    return torch.where(L > max_len, torch.full_like(L, -1.0), pen)


def dynamic_sampling_mask(rewards: torch.Tensor, group_size: int, atol: float = 1e-6) -> torch.Tensor:
    """DAPO dynamic sampling filter: ``[B]`` bool, True for groups whose rewards are not all equal.

    Groups with zero reward variance give zero GRPO advantage; the engine drops them and
    refills the batch with new prompts.
    """
    r = _groups(rewards, group_size)
    return (r.max(dim=1).values - r.min(dim=1).values) > atol
