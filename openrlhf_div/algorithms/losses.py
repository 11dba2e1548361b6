"""Per-token policy losses and regularizers (ALGORITHMS.md sections 2, 4 and 5).

Every function returns the loss **per token, unaggregated, zero where the mask is 0**,
as a ``[B, T]`` tensor to be *minimised*; :func:`aggregate_loss` reduces it.
Log-ratios are clamped to [-20, 20] before any ``exp``.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ._utils import (
    broadcast_seq,
    check_same_shape,
    clamp_log,
    fill_masked,
    masked_mean,
    unknown_name_error,
    zero_masked,
)
from .divergences import LAD_DIVERGENCES, check_alpha, f_divergence

LOG2 = math.log(2.0)
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "micro-batch-token-mean")


# ---------------------------------------------------------------- aggregation
def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    num_tokens: Optional[float] = None,
    num_seqs: Optional[float] = None,
    micro_batch_seqs: int = 2,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    * ``token-mean``: ``sum(m * l) / sum(m)`` over the whole batch (DAPO / OpenRLHF default)
    * ``seq-mean-token-mean``: mean over sequences of each sequence's token mean
    * ``seq-mean-token-sum``: mean over sequences of each sequence's token sum
    * ``micro-batch-token-mean``: the token-mean of each group of ``micro_batch_seqs``
      consecutive sequences, each group weighted ``micro_batch_seqs / num_seqs`` -- how verl's
      ``token-mean`` comes out per micro-batch in the DPH-RL authors' code
      (:func:`~.authors.micro_batch_token_mean`, docs/ALGORITHMS.md section 9 row 2)

    ``num_tokens`` / ``num_seqs`` override the denominators, so micro-batches of one
    optimiser step can each divide by the *global* count (gradient accumulation stays exact).
    """
    check_same_shape("loss", loss, mask=mask)
    m = mask.to(loss.dtype)
    lm = fill_masked(loss, mask)
    if mode == "token-mean":
        denom = m.sum().clamp(min=1.0) if num_tokens is None else float(max(num_tokens, 1))
        return lm.sum() / denom
    if mode == "micro-batch-token-mean":
        from .authors import micro_batch_token_mean

        return micro_batch_token_mean(lm, mask, micro_batch_seqs, num_seqs, masked_zero=True)
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        per_seq = lm.sum(dim=1)
        if mode == "seq-mean-token-mean":
            per_seq = per_seq / m.sum(dim=1).clamp(min=1.0)
        denom = float(loss.shape[0]) if num_seqs is None else float(max(num_seqs, 1))
        return per_seq.sum() / denom
    raise unknown_name_error("loss aggregation", mode, AGGREGATIONS)


# ---------------------------------------------------------------- helpers
def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary entropy ``H = logsumexp(z) - sum softmax(z) z`` over the last dim.

    Half-precision logits are upcast to float32; float32/float64 keep their dtype."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def _ratio(log_probs, old_log_probs, mask):
    """``r = exp(clamp(lp - old, -20, 20))``, with the log-ratio set to 0 at masked tokens."""
    log_ratio = clamp_log(fill_masked(log_probs - old_log_probs, mask))
    return torch.exp(log_ratio), log_ratio


def _adv(advantages, like, mask):
    return fill_masked(broadcast_seq("advantages", advantages, like).detach(), mask)


def ppo_clip_mask(ratio, adv, eps_low, eps_high):
    """True where PPO-clip's min/max takes the clipped branch (zero gradient there)."""
    return ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))


# ---------------------------------------------------------------- PPO-clip family
def ppo_clip_loss(
    log_probs, old_log_probs, advantages, mask,
    eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: Optional[float] = 3.0,
) -> torch.Tensor:
    """PPO-clip with dual clip (GRPO ``eps = 0.2/0.2``; DAPO clip-higher ``eps_high = 0.28``).

    ``l = max(-A r, -A clip(r, 1-eps_low, 1+eps_high))``; for ``A < 0``,
    ``l = min(l, -c A)`` with ``c = dual_clip`` (None disables it).
    The fraction of tokens on the clipped branch is :func:`ppo_clip_mask`'s mean.
    """
    check_same_shape("log_probs", log_probs, old_log_probs=old_log_probs, mask=mask)
    A = _adv(advantages, log_probs, mask)
    r, _ = _ratio(log_probs, old_log_probs, mask)
    l1 = -A * r
    l2 = -A * r.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(l1, l2)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        loss = torch.where(A < 0, torch.minimum(loss, -dual_clip * A), loss)
    return zero_masked(loss, mask)


def cispo_loss(log_probs, old_log_probs, advantages, mask, eps_low: float = 1.0, eps_high: float = 0.28):
    """CISPO (MiniMax-M1): ``l = -sg(clip(r, 1-eps_low, 1+eps_high)) * A * lp``.

    Every token keeps a gradient; only the importance weight is clipped (and detached).
    Default ``eps_low = 1.0`` (no lower bound, as MiniMax-M1), ``eps_high = 0.28``.
    """
    check_same_shape("log_probs", log_probs, old_log_probs=old_log_probs, mask=mask)
    A = _adv(advantages, log_probs, mask)  # 0 at masked tokens: no 0 * inf there
    r, _ = _ratio(log_probs, old_log_probs, mask)
    w = r.clamp(1.0 - eps_low, 1.0 + eps_high).detach()
    return zero_masked(-w * A * log_probs, mask)


def _covariance(advantages, log_probs, mask):
    """``Cov_t = (A_t - mean A)(lp_t - mean lp)`` over valid tokens (detached)."""
    A = advantages.detach()
    lp = log_probs.detach()
    mA = masked_mean(A, mask)
    mlp = masked_mean(lp, mask)
    return (A - mA) * (lp - mlp)


def clip_cov_loss(
    log_probs, old_log_probs, advantages, mask,
    eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: Optional[float] = 3.0,
    ratio: float = 2e-4, lb: float = 1.0, ub: float = 5.0,
    generator: Optional[torch.Generator] = None,
):
    """Clip-Cov (Cui et al. 2025) on top of PPO-clip.

    Among valid tokens with ``lb < Cov_t < ub`` that PPO-clip has not already clipped,
    ``max(1, floor(ratio * N))`` are picked at random (``N`` = valid tokens) and detached:
    their value stays, their gradient is zero.
    """
    loss = ppo_clip_loss(log_probs, old_log_probs, advantages, mask, eps_low, eps_high, dual_clip)
    A = _adv(advantages, log_probs, mask)
    r, _ = _ratio(log_probs.detach(), old_log_probs, mask)
    cov = _covariance(A, log_probs, mask)
    valid = mask.bool()
    n_valid = int(valid.sum().item())
    cand = valid & (cov > lb) & (cov < ub) & ~ppo_clip_mask(r, A, eps_low, eps_high)
    idx = torch.nonzero(cand.reshape(-1), as_tuple=True)[0]
    n_pick = min(max(1, int(math.floor(ratio * n_valid))), idx.numel())
    detach = torch.zeros(loss.numel(), dtype=torch.bool, device=loss.device)
    if n_pick > 0:
        perm = torch.randperm(idx.numel(), generator=generator, device="cpu")[:n_pick].to(idx.device)
        detach[idx[perm]] = True
    detach = detach.view_as(loss)
    return torch.where(detach, loss.detach(), loss)


def kl_cov_loss(log_probs, old_log_probs, advantages, mask, ratio: float = 2e-3, k: float = 1.0,
                min_one: bool = False):
    """KL-Cov (Cui et al. 2025): the top ``floor(ratio * N)`` tokens by ``Cov_t`` get
    ``-A r + k |log r|``, all others ``-A r`` (no ratio clipping). ``min_one``: at least one
    token (verl's ``max(1, int(N * ratio))``, docs/ALGORITHMS.md section 9 row 9c)."""
    check_same_shape("log_probs", log_probs, old_log_probs=old_log_probs, mask=mask)
    A = _adv(advantages, log_probs, mask)
    r, log_r = _ratio(log_probs, old_log_probs, mask)
    loss = -A * r
    valid = mask.bool()
    n_valid = int(valid.sum().item())
    n_pick = int(math.floor(ratio * n_valid))
    if min_one and n_valid > 0:
        n_pick = max(1, n_pick)
    if n_pick > 0:
        cov = _covariance(A, log_probs, mask).masked_fill(~valid, float("-inf"))
        top = torch.topk(cov.reshape(-1), n_pick).indices
        sel = torch.zeros(loss.numel(), dtype=torch.bool, device=loss.device)
        sel[top] = True
        loss = loss + k * log_r.abs() * sel.view_as(loss).to(loss.dtype)
    return zero_masked(loss, mask)


# ---------------------------------------------------------------- entropy terms
def entropy_loss(entropy, mask, coef: float):
    """Entropy bonus (``coef > 0``) or penalty (``coef < 0``): ``l_t = -coef * H_t``."""
    check_same_shape("entropy", entropy, mask=mask)
    return zero_masked(-coef * entropy, mask)


def diff_entropy_loss(entropy, correct, mask, coef_pos: float, coef_neg: float):
    """Differential entropy control (DS paper 4.8.2): bonus ``+coef_pos H`` on tokens of
    correct responses, penalty ``-coef_neg H`` on incorrect ones, i.e.
    ``l_t = -coef_pos H_t`` (correct) and ``l_t = +coef_neg H_t`` (incorrect)."""
    check_same_shape("entropy", entropy, mask=mask)
    c = torch.as_tensor(correct, device=entropy.device).to(torch.bool)
    if c.dim() != 1 or c.shape[0] != entropy.shape[0]:
        raise ValueError(f"correct must be [B] = [{entropy.shape[0]}], got shape {tuple(c.shape)}")
    loss = torch.where(c.unsqueeze(-1), -coef_pos * entropy, coef_neg * entropy)
    return zero_masked(loss, mask)


# ---------------------------------------------------------------- FlowRL
def flowrl_loss(
    log_probs, old_log_probs, ref_log_probs, advantages, log_z, mask,
    beta: float = 15.0, max_weight: Optional[float] = 10.0,
):
    """FlowRL trajectory balance with length normalisation.

    ``delta = logZ(x) + mean_t lp_t - beta * A - mean_t ref_t``,
    ``w = min(exp(sum_t (lp_t - old_t)), max_weight)`` detached, sequence loss ``w * delta^2``.
    The sequence loss is broadcast to every valid token, so ``seq-mean-token-mean``
    aggregation gives ``mean_i(w_i delta_i^2)`` exactly. ``advantages`` and ``log_z`` are ``[B]``.
    """
    check_same_shape("log_probs", log_probs, old_log_probs=old_log_probs,
                     ref_log_probs=ref_log_probs, mask=mask)
    B = log_probs.shape[0]
    for nm, t in (("advantages", advantages), ("log_z", log_z)):
        if t.dim() != 1 or t.shape[0] != B:
            raise ValueError(f"{nm} must be [B] = [{B}] for FlowRL, got shape {tuple(t.shape)}")
    m = mask.to(log_probs.dtype)
    n = m.sum(dim=1).clamp(min=1.0)
    # mean_t lp_t - mean_t ref_t as one masked mean of lp - ref (selected, not multiplied)
    mean_lp_minus_ref = fill_masked(log_probs - ref_log_probs.detach(), mask).sum(1) / n
    delta = log_z + mean_lp_minus_ref - beta * advantages.detach().to(log_probs.dtype)
    log_w = clamp_log(fill_masked(log_probs.detach() - old_log_probs, mask).sum(1))
    w = torch.exp(log_w)
    if max_weight is not None:  # None: unclipped, as Xuekai-Zhu/FlowRL's compute_flowrl_objective multiplies
        w = w.clamp(max=max_weight)
    seq = w * delta**2
    return zero_masked(seq.unsqueeze(-1).expand_as(log_probs), mask)


# ---------------------------------------------------------------- DPH-RL anchors
DPH_ANCHOR_DIVERGENCES = {"forward_kl": "dph_forward_kl", "js": "dph_js", "alpha": "dph_alpha"}


def dph_anchor_loss(log_probs, ref_log_probs, mask, divergence: str = "forward_kl", alpha: float = 0.5):
    """DPH-RL generator-form anchor loss on ``D_pef`` tokens (ALGORITHMS.md section 4).

    ``log u_t = clamp(lp_t - ref_t, -20, 20)`` with ``ref_t`` the stored per-token base
    log-probs; ``l_t = f(u_t)`` for ``forward_kl`` (``u - 1 - log u`` clamped to [-10, 10],
    estimates ``KL(pi_ref || pi_theta)``), ``js`` (``u log u - (u+1) log((u+1)/2)``,
    estimates ``2 JS``) or ``alpha`` (``(u^(1-a) - (1-a) u - a) / (a (a-1))``).
    No reference model runs: ``ref_log_probs`` come from the pre-sampling stage.
    """
    check_same_shape("log_probs", log_probs, ref_log_probs=ref_log_probs, mask=mask)
    name = DPH_ANCHOR_DIVERGENCES.get(divergence)
    if name is None:
        raise unknown_name_error("DPH anchor divergence", divergence, DPH_ANCHOR_DIVERGENCES)
    if divergence == "alpha":
        check_alpha(alpha)
    log_u = fill_masked(log_probs - ref_log_probs.detach(), mask)
    return zero_masked(f_divergence(name, log_u, alpha=alpha), mask)


def dph_js_def_loss(log_probs, ref_log_probs, mask, on: str = "anchor"):
    """Divergence-definition JS (the DPH ablation that needs the reference online).

    ``log m_t = logsumexp(ref_t, lp_t) - log 2``. On ``D_pef`` tokens (``on="anchor"``):
    ``l_t = exp(log m - ref) - (log m - ref) - 1`` (estimates ``KL(pi_ref || M)``).
    On rollout tokens (``on="online"``): ``l_t = exp(log m - lp) - (log m - lp) - 1``
    (estimates ``KL(pi_theta || M)``).
    """
    check_same_shape("log_probs", log_probs, ref_log_probs=ref_log_probs, mask=mask)
    if on not in ("anchor", "online"):
        raise unknown_name_error("dph_js_def side", on, ("anchor", "online"))
    # with log u = lp - ref (selected first: padding holds no inf): log m - ref = log((1 + u) / 2)
    # and log m - lp = log((1 + 1/u) / 2)
    log_u = fill_masked(log_probs - ref_log_probs.detach(), mask)
    zero = torch.zeros((), dtype=log_u.dtype, device=log_u.device)
    d = clamp_log(torch.logaddexp(zero, log_u if on == "anchor" else -log_u) - LOG2)
    return zero_masked(torch.exp(d) - d - 1, mask)


# ---------------------------------------------------------------- LAD
def lad_loss(
    log_probs, old_log_probs, advantages, mask,
    divergence: str = "js", eta: float = 0.25,
    granularity: str = "token",
    clip_eps: Optional[Tuple[float, float]] = None,
):
    """LAD (seed 003): an f-divergence between the ratio and ``exp(A / eta)``.

    ``z_t = clamp(A_t / eta, -20, 20)``, ``log x_t = clamp(lp_t - old_t - z_t, -20, 20)``,
    ``l_t = exp(z_t) * f(x_t)``. Its gradient is ``r_t f'(x_t) grad lp_t``: likelihood rises
    for high-advantage tokens and the push stops where ``r_t = exp(A_t / eta)`` (for the
    divergences with ``f'(1) = 0``: js, hellinger, jeffreys, tv's subgradient).

    ``granularity="sequence"`` uses the summed log-ratio of each response (and its
    sequence advantage) and broadcasts the sequence loss to the tokens (aggregate it with
    ``seq-mean-token-mean``). ``clip_eps=(eps_low, eps_high)`` zeroes the gradient where
    PPO-clip would (for use with clip-higher); the default is no clip.
    """
    check_same_shape("log_probs", log_probs, old_log_probs=old_log_probs, mask=mask)
    if divergence not in LAD_DIVERGENCES:
        raise unknown_name_error("LAD divergence", divergence, LAD_DIVERGENCES)
    if not eta > 0:
        raise ValueError(f"eta must be > 0, got {eta}")
    A = _adv(advantages, log_probs, mask)
    if granularity == "token":
        log_r = fill_masked(log_probs - old_log_probs, mask)
    elif granularity == "sequence":
        m = mask.to(log_probs.dtype)
        log_r = fill_masked(log_probs - old_log_probs, mask).sum(1, keepdim=True).expand_as(log_probs)
        A = A.sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)
        A = A.expand_as(log_probs)
    else:
        raise unknown_name_error("LAD granularity", granularity, ("token", "sequence"))
    z = clamp_log(A / eta)
    log_x = clamp_log(log_r - z)
    loss = torch.exp(z) * f_divergence(divergence, log_x)
    if clip_eps is not None:
        r = torch.exp(clamp_log(log_r.detach()))
        clipped = ppo_clip_mask(r, A, clip_eps[0], clip_eps[1])
        loss = torch.where(clipped, loss.detach(), loss)
    return zero_masked(loss, mask)
