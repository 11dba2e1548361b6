"""The Megatron actor's loss path: vocabulary-parallel logits -> registry loss (no Megatron import).

For one micro-batch of ``B`` rows (online rollouts and, for DPH methods, ``D_pef`` anchor rows
routed by a per-row flag) with ``A`` action positions:

1. ``lp, H = token_log_probs_entropy(hidden, weight_shard, sequences, A)``: per-token log-probs of
   the sampled tokens and full-vocabulary entropy, from the last hidden states and this rank's
   rows of the output layer (:mod:`.vocab_parallel`: chunked, max / sum-exp / target all-reduces
   over the TP group, no ``[tokens, V]`` logits, not even this rank's slice),
   aligned like OpenRLHF's actor: position ``t`` predicts ``sequences[:, t + 1]``; the last ``A``
   positions are kept.
2. ``method.loss(online=LossInputs(...), anchor=AnchorInputs(...), num_online_tokens=N_on,
   num_anchor_tokens=N_pef, num_online_seqs=S_on)`` from the registry, unchanged: each part is a
   token-mean over **the global token count of the optimiser step** (all micro-batches, all
   data-parallel ranks), so ``L = L_exp + eta L_pef`` summed over micro-batches and ranks is one
   token-mean over the step, whatever the micro-batch sizes.
3. ``loss * (num_microbatches * dp_size)``: Megatron's schedule divides each micro-batch loss
   by ``num_microbatches`` and its DDP averages gradients over the ``dp_size`` replicas; the
   factor undoes both, so the gradient is exactly that of the step's global token-mean -- the same
   semantics as OpenRLHF's DeepSpeed path (``iter_grad_accum_global_norm`` +
   ``aggregate_loss``), where DeepSpeed's ``1/gas`` and DP averaging are compensated the same way.

Aggregation ``micro-batch-token-mean`` (the DPH-RL authors' update loop, docs/ALGORITHMS.md
section 9 rows 1, 1b, 2): the actor lays a step's micro-batches out with
:func:`openrlhf_div.algorithms.authors.plan_micro_batches` and sets :class:`MicroBatch`
``authors_coef``; step 2 is then ``method.loss(..., micro_batch_coef=authors_coef)`` (the
micro-batch's own token-mean times the authors' accumulation factor, ``x eta`` for anchors) and
step 3 multiplies by ``num_microbatches`` only (:func:`loss_scale`): the data-parallel average
stays, as the authors' FSDP averages over ranks.

Rows are routed by :class:`MicroBatch` ``is_anchor``; an anchor row uses its stored base
log-probs ``anchor_ref_log_probs`` (from the pre-sampling stage), never an online reference.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch

from openrlhf_div.algorithms.authors import route_anchors_to_ppo
from openrlhf_div.algorithms.registry import Method

from ..contract import loss_inputs
from .vocab_parallel import vocab_parallel_log_probs_from_hidden

ADDITIVE_METRICS = ("loss", "loss_exp", "loss_pef")

__all__ = ["MicroBatch", "StepCounts", "token_log_probs_entropy", "registry_loss", "step_counts", "loss_scale"]


@dataclass
class MicroBatch:
    """One micro-batch, all tensors on the compute device; ``[B, A]`` per-token fields."""

    sequences: torch.Tensor                      # [B, L] token ids (prompt + response)
    attention_mask: torch.Tensor                 # [B, L] 1 on real tokens
    action_mask: torch.Tensor                    # [B, A] 1 on trained tokens (last A of the L-1 targets)
    old_log_probs: Optional[torch.Tensor] = None  # [B, A] behaviour policy (online rows)
    advantages: Optional[torch.Tensor] = None    # [B, A] or [B] (online rows)
    ref_log_probs: Optional[torch.Tensor] = None  # [B, A] online reference (needs.ref_log_probs)
    correct: Optional[torch.Tensor] = None       # [B] bool
    is_anchor: Optional[torch.Tensor] = None     # [B] bool: D_pef anchor row
    anchor_ref_log_probs: Optional[torch.Tensor] = None  # [B, A] stored base log-probs (anchor rows)
    authors_coef: Optional[float] = None         # the authors' accumulation factor (micro-batch-token-mean)
    authors_ppo_anchors: Optional[torch.Tensor] = None  # [B] bool: anchors trained with the PPO loss (first_row)
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def num_actions(self) -> int:
        return int(self.action_mask.shape[1])

    def anchor_rows(self) -> torch.Tensor:
        if self.is_anchor is None:
            return torch.zeros(self.sequences.shape[0], dtype=torch.bool, device=self.sequences.device)
        return self.is_anchor.to(torch.bool).reshape(-1)


@dataclass
class StepCounts:
    """Global denominators of one optimiser step (summed over micro-batches and DP ranks)."""

    online_tokens: float
    anchor_tokens: float
    online_seqs: float
    anchor_seqs: float = 0.0  # for anchor_weighting: microbatch_share (docs/ALGORITHMS.md 9, row 1)


def step_counts(batches, dp_group=None) -> StepCounts:
    """:class:`StepCounts` of the micro-batches of one step, all-reduced over ``dp_group``.

    ``dp_group=None`` means *no* reduction (one data-parallel replica), not the default group:
    the tensor- and pipeline-parallel ranks of a replica hold the same rows and must not be summed.
    """
    import torch.distributed as dist

    t = torch.zeros(4, dtype=torch.float64)
    for mb in batches:
        a = mb.anchor_rows().cpu()
        m = mb.action_mask.detach().to("cpu", torch.float64)
        t[0] += m[~a].sum()
        t[1] += m[a].sum()
        t[2] += float((m[~a].sum(dim=1) > 0).sum())
        t[3] += float((m[a].sum(dim=1) > 0).sum())
    if dp_group is not None and dist.is_initialized() and dist.get_world_size(group=dp_group) > 1:
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        t = t.to(dev)
        dist.all_reduce(t, group=dp_group)
        t = t.cpu()
    return StepCounts(float(t[0]), float(t[1]), float(t[2]), float(t[3]))


def loss_scale(batches, dp_size: int) -> float:
    """The factor :meth:`MegatronEngine.train_step` multiplies each micro-batch loss by:
    ``num_microbatches x dp_size`` (undoes Megatron's ``1 / num_microbatches`` and the DDP
    average: the step's global token-mean), or ``num_microbatches`` for the authors' layout
    (micro-batches with ``authors_coef``; the DDP average is the authors' FSDP average)."""
    n = float(len(batches))
    if any(getattr(mb, "authors_coef", None) is not None for mb in batches):
        if not all(getattr(mb, "authors_coef", None) is not None for mb in batches):
            raise ValueError("a step mixes micro-batches of the authors' layout with others")
        return n
    return n * float(dp_size)


def token_log_probs_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, sequences: torch.Tensor, num_actions: int, *, vocab_start: int = 0,
    vocab_size: Optional[int] = None, temperature: float = 1.0, group=None, need_entropy: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``[B, A]`` log-probs of ``sequences[:, -A:]`` and entropies from ``[B, L, H]`` last hidden
    states and this rank's ``[V_local, H]`` output-layer rows.

    Only the ``A`` predicting positions reach the LM head (``hidden[:, L-1-A : L-1]``).
    """
    L = sequences.shape[1]
    if hidden.shape[:2] != sequences.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match sequences {tuple(sequences.shape)}")
    if not 0 < num_actions <= L - 1:
        raise ValueError(f"num_actions={num_actions} must be in [1, L-1] with L={L}")
    pred = hidden[:, L - 1 - num_actions: L - 1]
    target = sequences[:, L - num_actions:]
    return vocab_parallel_log_probs_from_hidden(pred, weight, target, vocab_start=vocab_start, vocab_size=vocab_size,
                                                temperature=temperature, group=group, need_entropy=need_entropy)


def registry_loss(method: Method, log_probs: torch.Tensor, entropy: Optional[torch.Tensor], mb: MicroBatch,
                  counts: StepCounts, *, generator: Optional[torch.Generator] = None
                  ) -> Tuple[torch.Tensor, Dict[str, float], Dict[str, float]]:
    """``method.loss`` on one micro-batch; returns ``(loss, metrics, weights)``.

    ``weights`` gives each metric's token weight in this micro-batch (online / anchor tokens), so
    callers can average metrics over the step exactly; ``None`` marks the additive ones (``loss``,
    ``loss_exp``, ``loss_pef`` are already divided by the step's global counts: sum them). The loss is *not* yet multiplied by
    ``num_microbatches * dp_size`` (see the module docstring).
    """
    anchor = mb.anchor_rows()
    mask = mb.action_mask
    old, adv, ref = mb.old_log_probs, mb.advantages, mb.ref_log_probs
    routed = mb.authors_ppo_anchors
    if routed is not None and bool(routed.any()):  # anchors in a rollout micro-batch: PPO at advantage +1
        anchor, old, adv = route_anchors_to_ppo(anchor, routed.to(anchor.device), mask, old, adv,
                                                mb.anchor_ref_log_probs)
        sel = routed.to(anchor.device).view(-1, 1)
        ref = None if ref is None else torch.where(sel, mb.anchor_ref_log_probs.to(ref.dtype), ref)
    online = ~anchor
    on_inputs, an_inputs = loss_inputs(
        method, log_probs=log_probs, mask=mask, is_anchor=anchor, old_log_probs=old,
        advantages=adv, ref_log_probs=ref, anchor_ref_log_probs=mb.anchor_ref_log_probs,
        correct=mb.correct, entropy=entropy, generator=generator)
    if mb.authors_coef is not None:
        loss, metrics = method.loss(online=on_inputs, anchor=an_inputs, micro_batch_coef=float(mb.authors_coef))
    else:
        loss, metrics = method.loss(online=on_inputs, anchor=an_inputs, num_online_tokens=counts.online_tokens,
                                    num_anchor_tokens=counts.anchor_tokens, num_online_seqs=counts.online_seqs,
                                    num_anchor_seqs=counts.anchor_seqs or None)
    n_on = float(mask[online].sum()) if on_inputs is not None else 0.0
    n_an = float(mask[anchor].sum()) if an_inputs is not None else 0.0
    weights = {k: (None if k in ADDITIVE_METRICS else n_on) for k in metrics}
    return loss, metrics, weights
