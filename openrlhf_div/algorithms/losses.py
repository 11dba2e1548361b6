"""Per-token policy losses and regularizers (ALGORITHMS.md sections 2, 4 and 5).

Every function returns the loss **per token, unaggregated, zero where the mask is 0**,
as a ``[B, T]`` tensor to be *minimised*; :func:`aggregate_loss` reduces it.
Log-ratios are clamped to [-20, 20] before any ``exp``.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ._fused import (
    Keep,
    _count,
    cispo_terms,
    dph_anchor_terms,
    js_def_terms,
    kl_cov_terms,
    lad_terms,
    per_token,
    ppo_clip_terms,
    unflat,
)
from ._utils import (
    broadcast_seq,
    check_same_shape,
    clamp_log,
    fill_masked,
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
    masked_zero: bool = False,
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
    ``masked_zero=True`` promises ``loss`` is already 0 at masked tokens (every per-token loss
    of this library is) and skips selecting them again.
    """
    check_same_shape("loss", loss, mask=mask)
    m = mask.to(loss.dtype)
    lm = loss if masked_zero else fill_masked(loss, mask)
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
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    A = broadcast_seq("advantages", advantages, log_probs).detach()
    keep = Keep(mask)
    return per_token(
        lambda need_coef: ppo_clip_terms(log_probs.detach(), old_log_probs.detach(), A, keep,
                                         eps_low, eps_high, dual_clip, need_coef),
        log_probs, old_log_probs)


def cispo_loss(log_probs, old_log_probs, advantages, mask, eps_low: float = 1.0, eps_high: float = 0.28):
    """CISPO (MiniMax-M1): ``l = -sg(clip(r, 1-eps_low, 1+eps_high)) * A * lp``.

    Every token keeps a gradient; only the importance weight is clipped (and detached).
    Default ``eps_low = 1.0`` (no lower bound, as MiniMax-M1), ``eps_high = 0.28``.
    """
    check_same_shape("log_probs", log_probs, old_log_probs=old_log_probs, mask=mask)
    A = broadcast_seq("advantages", advantages, log_probs).detach()
    keep = Keep(mask)
    return per_token(lambda need_coef: cispo_terms(log_probs.detach(), old_log_probs.detach(), A, keep,
                                                   eps_low, eps_high, need_coef), log_probs)


def clip_cov_loss(
    log_probs, old_log_probs, advantages, mask,
    eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: Optional[float] = 3.0,
    ratio: float = 2e-4, lb: float = 1.0, ub: float = 5.0,
    generator: Optional[torch.Generator] = None,
):
    """Clip-Cov (Cui et al. 2025) on top of PPO-clip.

    Among valid tokens with ``lb < Cov_t < ub`` that PPO-clip has not already clipped,
    ``max(1, floor(ratio * N))`` are picked at random (``N`` = valid tokens) and detached:
    their value stays, their gradient is zero. The pick is uniform without replacement
    among the candidates, drawn from ``generator`` (a CPU generator; None: torch's global
    one); it only runs when a gradient is computed (it cannot change the value).
    """
    check_same_shape("log_probs", log_probs, old_log_probs=old_log_probs, mask=mask)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    A = broadcast_seq("advantages", advantages, log_probs).detach()
    keep = Keep(mask)
    return per_token(
        lambda need_coef: clip_cov_terms(log_probs.detach(), old_log_probs.detach(), A, keep, eps_low,
                                         eps_high, dual_clip, ratio, lb, ub, generator, need_coef),
        log_probs, old_log_probs)


def clip_cov_terms(lp, old, A, keep, eps_low, eps_high, dual_clip, ratio, lb, ub, generator,
                   need_coef, stats=None):
    """:func:`clip_cov_loss` as ``(value, coef)`` (see ``_fused``): PPO-clip's terms, with
    ``coef`` zeroed at the picked tokens. ``stats`` receives PPO-clip's ``"clipped"``.

    The covariance is computed negated from PPO-clip's ``-A`` (``Ap + An``), so no copy of
    the advantages is made: ``-Cov_t = (-A_t - mean(-A))(lp_t - mean lp)`` (negation is
    exact), and ``lb < Cov_t < ub`` is ``-ub < -Cov_t < -lb``."""
    st = {} if stats is None else stats
    value, coef = ppo_clip_terms(lp, old, A, keep, eps_low, eps_high, dual_clip, need_coef, st)
    if not need_coef:
        return value, None
    dt = value.dtype
    m = torch.ones_like(value) if keep.mask is None else keep.mask.to(dt)
    denom = m.sum().clamp(min=1.0)  # masked_mean's denominator
    n_valid = value.numel() if keep.mask is None else -_count(keep.bits(value))  # bits: -1 kept
    n_lp = keep.filled(lp.to(dt))
    ncov = st["Ap"].add_(st["An"])  # -A, 0 at masked tokens
    m_na, m_lp = ncov.sum() / denom, n_lp.sum() / denom
    ncov.sub_(m_na).mul_(n_lp.sub_(m_lp))
    # -ub < -Cov < -lb (strict) is -Cov == clamp(-Cov, next float above -ub, next below -lb)
    one = torch.ones((), dtype=dt, device=value.device)
    lo_t = torch.nextafter(-torch.tensor(ub, dtype=dt, device=value.device), one * math.inf)
    hi_t = torch.nextafter(-torch.tensor(lb, dtype=dt, device=value.device), one * -math.inf)
    if not bool(lo_t <= hi_t):
        return value, coef
    inside = torch.eq(torch.clamp(ncov, lo_t, hi_t, out=n_lp), ncov, out=n_lp)
    at_masked = (0.0 - m_na) * (0.0 - m_lp)  # what -Cov holds at every masked token
    if keep.mask is not None and bool((lo_t <= at_masked) & (at_masked <= hi_t)):
        keep.fill_(inside)
    cand = inside.addcmul_(inside, st["clipped"], value=-1.0)  # valid, in range, not clipped
    n_cand = int(cand.sum(dtype=torch.float32 if cand.numel() < 2**24 else torch.float64))  # exact
    n_pick = min(max(1, int(math.floor(ratio * n_valid))), n_cand)
    if n_pick > 0:
        picked = _uniform_pick(cand.reshape(-1), n_cand, n_pick, generator)
        coef.index_put_(unflat(picked.to(coef.device), coef), torch.zeros((), dtype=coef.dtype, device=coef.device))
    return value, coef


def _uniform_pick(cand: torch.Tensor, n_cand: int, k: int, generator) -> torch.Tensor:
    """``k`` distinct positions drawn uniformly without replacement among the ``n_cand``
    nonzero entries of the 0/1 vector ``cand``, with ``generator`` (CPU).

    The first ``k`` distinct hits of i.i.d. uniform draws over all positions are uniform
    over the candidates and a uniformly random ``k``-subset (exchangeability), and cost
    ``O(k N / n_cand)`` instead of ``nonzero`` + ``randperm`` over ``N``. When candidates
    are too sparse for that, fall back to ``nonzero`` and a permutation of the candidates."""
    N = cand.numel()
    need = k * N / n_cand
    if need <= N / 8:
        got = torch.empty(0, dtype=torch.long)
        while True:
            m = int(1.25 * (k - got.numel()) * N / n_cand) + 64
            draws = torch.randint(N, (m,), generator=generator)
            hit = cand[draws.to(cand.device)].cpu() > 0
            got = torch.cat([got, draws[hit]])
            uniq, inv = torch.unique(got, return_inverse=True)
            if uniq.numel() >= k:
                first = torch.full((uniq.numel(),), got.numel(), dtype=torch.long)
                first.scatter_reduce_(0, inv, torch.arange(got.numel()), "amin")
                return uniq[first.argsort()[:k]]
    idx = torch.nonzero(cand, as_tuple=True)[0]
    perm = torch.randperm(idx.numel(), generator=generator, device="cpu")[:k].to(idx.device)
    return idx[perm]


def kl_cov_loss(log_probs, old_log_probs, advantages, mask, ratio: float = 2e-3, k: float = 1.0):
    """KL-Cov (Cui et al. 2025): the top ``floor(ratio * N)`` tokens by ``Cov_t`` get
    ``-A r + k |log r|``, all others ``-A r`` (no ratio clipping)."""
    check_same_shape("log_probs", log_probs, old_log_probs=old_log_probs, mask=mask)
    A = broadcast_seq("advantages", advantages, log_probs).detach()
    keep = Keep(mask)
    return per_token(lambda need_coef: kl_cov_terms(log_probs.detach(), old_log_probs.detach(), A, keep,
                                                    ratio, k, need_coef), log_probs, old_log_probs)


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
    c = _correct(correct, entropy)
    loss = torch.where(c.unsqueeze(-1), -coef_pos * entropy, coef_neg * entropy)
    return zero_masked(loss, mask)


def _correct(correct, entropy):
    c = torch.as_tensor(correct, device=entropy.device).to(torch.bool)
    if c.dim() != 1 or c.shape[0] != entropy.shape[0]:
        raise ValueError(f"correct must be [B] = [{entropy.shape[0]}], got shape {tuple(c.shape)}")
    return c


def diff_entropy_weights(correct, entropy, coef_pos: float, coef_neg: float) -> torch.Tensor:
    """``[B, 1]`` per-response weight of ``H`` in :func:`diff_entropy_loss`: ``-coef_pos``
    (correct) or ``+coef_neg`` (incorrect), in ``entropy``'s dtype."""
    c = _correct(correct, entropy)
    w = torch.full((c.shape[0], 1), coef_neg, dtype=entropy.dtype, device=entropy.device)
    return w.masked_fill_(c.unsqueeze(-1), -coef_pos)


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
    keep = Keep(mask)
    ref = ref_log_probs.detach()
    return per_token(lambda need_coef: dph_anchor_terms(log_probs.detach(), ref, keep, name, alpha, need_coef),
                     log_probs)


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
    keep = Keep(mask)
    ref = ref_log_probs.detach()
    return per_token(lambda need_coef: js_def_terms(log_probs.detach(), ref, keep, on, need_coef), log_probs)


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
    if granularity == "token":  # elementwise: value and gradient fused (_fused.lad_terms)
        A = broadcast_seq("advantages", advantages, log_probs).detach()
        keep = Keep(mask)
        return per_token(lambda need_coef: lad_terms(log_probs.detach(), old_log_probs.detach(), A, keep,
                                                     divergence, eta, clip_eps, need_coef),
                         log_probs, old_log_probs)
    A = _adv(advantages, log_probs, mask)
    if granularity == "sequence":
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
