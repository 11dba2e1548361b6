"""Per-token log-probs and entropy from vocabulary-parallel logits, without gathering the vocabulary.

With tensor parallelism the output layer is column-parallel: tensor-parallel (TP) rank ``r``
holds the logits of the vocabulary slice ``[vocab_start_r, vocab_start_r + V_local)``, a
``[..., V_local]`` tensor. Gathering the full ``[..., V]`` logits (152k entries per token for
Qwen2.5) costs ``TP`` times the memory of a shard; instead every quantity below is assembled from
three kinds of all-reduce over the TP group, each of size ``[...]`` (one number per token):

With ``z`` the temperature-scaled logits ``z = logits / T`` and ``V`` the valid vocabulary
(entries at or beyond ``vocab_size``, Megatron's vocabulary padding, are excluded: ``p = 0``):

* ``m = max_v z_v``                                                 (all-reduce MAX)
* ``S = sum_v exp(z_v - m)``, so ``log Z = m + log S``              (all-reduce SUM)
* ``z_y`` the target's logit, picked on the rank that owns ``y``, 0 elsewhere   (all-reduce SUM)
* ``E = sum_v p_v z_v = (sum_v exp(z_v - m) z_v) / S``              (all-reduce SUM, entropy only)

and then, per token,

* log-prob of the target ``y``:  ``lp = z_y - log Z``
* full-vocabulary entropy:       ``H = log Z - E``

Gradients (with ``p = softmax(z)`` restricted to the local slice, computed locally once the
reductions above are known; ``g_lp``, ``g_H`` the incoming gradients of ``lp`` and ``H``):

* ``d lp / d z_v = 1[v = y] - p_v``
* ``d H  / d z_v = p_v (E - z_v)``
* ``d / d logits = (g_lp (1[v = y] - p_v) + g_H p_v (E - z_v)) / T``

Every TP rank holds the same ``lp`` and ``H`` (and receives the same upstream gradient, since
the loss after this point is replicated across the TP group), so no reduction is needed in the
backward pass: each rank's gradient is for its own logits slice only. This is the same
reduction Megatron's ``vocab_parallel_cross_entropy`` performs for the cross-entropy; this
module adds the entropy and the padded-vocabulary mask, works in float32 whatever the input
dtype, and needs nothing but ``torch.distributed`` (no Megatron import), so it runs with gloo
on CPU.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "vocab_parallel_log_probs_entropy",
    "vocab_parallel_log_probs",
    "vocab_parallel_entropy",
    "vocab_range",
]


def vocab_range(padded_vocab_size: int, tp_rank: int, tp_size: int) -> Tuple[int, int]:
    """``[start, end)`` of the vocabulary slice TP rank ``tp_rank`` owns (Megatron's even split)."""
    if padded_vocab_size % tp_size:
        raise ValueError(
            f"padded vocabulary size {padded_vocab_size} is not divisible by the tensor-parallel size "
            f"{tp_size}; pad it with openrlhf_div.engines.megatron.weights.padded_vocab_size"
        )
    per = padded_vocab_size // tp_size
    return tp_rank * per, (tp_rank + 1) * per


def _group_size(group) -> int:
    # None means "this rank holds the whole vocabulary" -- not torch's default (world) group:
    # data-parallel replicas must never be summed here.
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group=group)


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if _group_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """Fused log-prob + entropy over a vocabulary-parallel logits shard (see module docstring)."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, temperature, group, need_entropy):
        v_local = logits.shape[-1]
        z = logits.float()
        if temperature != 1.0:
            z = z / temperature
        # Mask of valid (non-padding) vocabulary entries in this slice.
        n_valid_local = max(0, min(v_local, vocab_size - vocab_start)) if vocab_size is not None else v_local
        has_pad = n_valid_local < v_local
        if has_pad:
            valid = torch.zeros(v_local, dtype=torch.bool, device=z.device)
            valid[:n_valid_local] = True
            z = z.masked_fill(~valid, float("-inf"))
        # m = max over the whole vocabulary
        m = z.max(dim=-1).values if v_local > 0 else z.new_full(z.shape[:-1], float("-inf"))
        m = _all_reduce(m.detach().clone(), dist.ReduceOp.MAX, group)
        e = torch.exp(z - m.unsqueeze(-1))  # exp(-inf) = 0 on padding entries
        s = _all_reduce(e.sum(dim=-1), dist.ReduceOp.SUM, group)
        log_z = m + torch.log(s)
        # Target logit, picked on the owning rank.
        local_t = target.long() - vocab_start
        owned = (local_t >= 0) & (local_t < n_valid_local)
        idx = torch.where(owned, local_t, torch.zeros_like(local_t)).unsqueeze(-1)
        z_y = torch.where(owned, torch.gather(z, -1, idx).squeeze(-1), torch.zeros_like(m))
        z_y = _all_reduce(z_y, dist.ReduceOp.SUM, group)
        log_probs = z_y - log_z
        p = e / s.unsqueeze(-1)
        if need_entropy:
            z_fin = torch.where(torch.isfinite(z), z, torch.zeros_like(z)) if has_pad else z
            ez = _all_reduce((e * z_fin).sum(dim=-1), dist.ReduceOp.SUM, group)
            expect_z = ez / s
            entropy = log_z - expect_z
            ctx.save_for_backward(p, z_fin, expect_z, idx, owned)
        else:
            entropy = None
            ctx.save_for_backward(p, idx, owned)
        ctx.need_entropy = need_entropy
        ctx.temperature = temperature
        ctx.in_dtype = logits.dtype
        if entropy is None:
            return log_probs, torch.zeros_like(log_probs)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, g_lp, g_h):
        if ctx.need_entropy:
            p, z, expect_z, idx, owned = ctx.saved_tensors
        else:
            p, idx, owned = ctx.saved_tensors
        grad = torch.zeros_like(p)
        if g_lp is not None:
            grad = -p * g_lp.float().unsqueeze(-1)
            onehot_g = torch.where(owned, g_lp.float(), torch.zeros_like(g_lp.float())).unsqueeze(-1)
            grad.scatter_add_(-1, idx, onehot_g)
        if ctx.need_entropy and g_h is not None:
            grad = grad + g_h.float().unsqueeze(-1) * p * (expect_z.unsqueeze(-1) - z)
        if ctx.temperature != 1.0:
            grad = grad / ctx.temperature
        return grad.to(ctx.in_dtype), None, None, None, None, None, None


def vocab_parallel_log_probs_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    group=None,
    need_entropy: bool = True,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of ``target`` and full-vocabulary entropy from a vocabulary-parallel shard.

    Args:
        logits: ``[..., V_local]`` this rank's logits slice (any float dtype; computed in fp32).
        target: ``[...]`` global token ids (any integer dtype).
        vocab_start: first global vocabulary index this rank owns (:func:`vocab_range`).
        vocab_size: the real vocabulary size; global indices ``>= vocab_size`` (Megatron's
            padding rows) get probability 0. ``None``: every entry is valid.
        temperature: logits are divided by it first (OpenRLHF's actor does the same with the
            rollout temperature, so old and new log-probs match vLLM's sampling distribution).
        group: the tensor-parallel process group; ``None`` means no reduction (the shard is the
            whole vocabulary, TP = 1) -- unlike ``torch.distributed``, not the world group.
        need_entropy: skip the entropy's extra all-reduce and saved tensors when False.

    Returns:
        ``(log_probs [...], entropy [...] or None)`` in float32, identical on every TP rank.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree: logits must be "
            "[..., V_local] with target [...]"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    lp, h = _VocabParallelLogProbEntropy.apply(
        logits, target, int(vocab_start), vocab_size, float(temperature), group, bool(need_entropy)
    )
    return lp, (h if need_entropy else None)


def vocab_parallel_log_probs(logits, target, **kw) -> torch.Tensor:
    """Log-probs only (see :func:`vocab_parallel_log_probs_entropy`)."""
    return vocab_parallel_log_probs_entropy(logits, target, need_entropy=False, **kw)[0]


def vocab_parallel_entropy(logits, **kw) -> torch.Tensor:
    """Full-vocabulary entropy only (see :func:`vocab_parallel_log_probs_entropy`)."""
    target = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return vocab_parallel_log_probs_entropy(logits, target, need_entropy=True, **kw)[1]
