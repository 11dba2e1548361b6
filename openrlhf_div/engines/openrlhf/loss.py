"""The policy actor's loss: ``Method.loss`` with the normalisers of OpenRLHF's accumulation window.

For one micro-batch whose rows are online rollouts (anchor flag 0) or ``D_pef`` anchors
(flag 1), :func:`div_actor_loss` builds the method's inputs through the engine contract
(:func:`openrlhf_div.engines.contract.loss_inputs`) and returns::

    L = method.loss(online, anchor, num_online_tokens=N_on, num_anchor_tokens=N_pef,
                    num_online_seqs=S_on, num_anchor_seqs=S_pef)

where ``N_on = batch_num_tokens / dp_size`` (and ``S_on = global_batch_size / dp_size``) come from
OpenRLHF's ``loss_batch_info`` for the online tokens and ``N_pef`` from the same over the anchor
tokens, each computed over the whole optimizer step on all data-parallel ranks: ``L`` is then
exactly OpenRLHF's ``aggregate_loss(..., dp_size, batch_num_tokens, global_batch_size)`` of each
part. OpenRLHF's own normaliser (``iter_grad_accum_global_norm``) produces both:
:func:`split_window_norms` runs it once over the online masks and once over the anchor masks of the
same window, so after DeepSpeed's ``1 / gas`` scaling and data-parallel averaging the micro-batch
losses of one step add up to ``L_exp + eta * L_pef`` with each part a token mean over its own tokens.

Aggregation ``micro-batch-token-mean`` (the DPH-RL authors' update loop, docs/ALGORITHMS.md
section 9 rows 1, 1b, 2): :func:`authors_micro_batches` replaces OpenRLHF's shuffled micro-batches
and gas windows with the run's micro-batch layout (:meth:`openrlhf_div.engines.layout.EngineLayout.plan`,
``layout.step_layout`` / ``layout.micro_batch_tokens`` / ``layout.authors_world_size``) over the replica's rows (rollouts, then anchors; optimiser steps of ``train.batch_size / dp`` rows; anchors and
rollouts in separate micro-batches of ``micro_batch_seqs`` rows or token budgets), and each
micro-batch's ``loss_batch_info`` carries ``{"authors": {"coef", "gas", "boundary"}}``:
:func:`div_actor_loss` returns ``gas x Method.loss(..., micro_batch_coef=coef)`` -- DeepSpeed's
``1 / gas`` undone, its data-parallel average kept (the authors' FSDP averages over ranks too) --
and the policy actor sets DeepSpeed's accumulation boundary at the last micro-batch of each step.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from openrlhf_div.algorithms.authors import route_anchors_to_ppo, share_micro_batches
from openrlhf_div.algorithms.registry import Method
from openrlhf_div.compat.flash_attn_standin import install as _install_flash_attn_standin

_install_flash_attn_standin()  # no-op when the real flash-attn is installed

from openrlhf.utils import loss_utils as _loss_utils  # noqa: E402

from ..contract import loss_inputs  # noqa: E402
from ..layout import EngineLayout  # noqa: E402

ANCHOR_NORM_KEY = "anchor"    # loss_batch_info[ANCHOR_NORM_KEY]: the anchor tokens' normaliser
AUTHORS_KEY = "authors"       # loss_batch_info[AUTHORS_KEY]: one micro-batch of the authors' layout


def split_masks(action_mask: torch.Tensor, is_anchor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(online_mask, anchor_mask)``: the action mask restricted to each kind of row."""
    m = action_mask.float()
    a = is_anchor.to(m.device, torch.float32).unsqueeze(-1)
    return m * (1.0 - a), m * a


def split_window_norms(data_iter: Iterable, strategy, accumulated_gradient: int, mask_fn: Callable,
                       anchor_fn: Callable) -> Iterator[Tuple[object, Dict]]:
    """Drop-in for OpenRLHF's ``iter_grad_accum_global_norm`` that normalises online and anchor
    tokens separately. Yields ``(item, info)`` where ``info`` is OpenRLHF's normaliser over the
    window's online tokens plus ``info["anchor"]``, the same over its anchor tokens.

    ``mask_fn(item)`` is OpenRLHF's (the action mask); ``anchor_fn(item)`` the ``[B]`` anchor flag.
    Windows are the same gas-sized groups OpenRLHF forms (and the trailing partial one).
    """
    gas = max(int(accumulated_gradient), 1)
    upstream = _UPSTREAM_ITER

    def online(e):
        return split_masks(mask_fn(e), anchor_fn(e))[0]

    def anchor(e):
        return split_masks(mask_fn(e), anchor_fn(e))[1]

    def flush(window: List) -> Iterator[Tuple[object, Dict]]:
        on = list(upstream(window, strategy, gas, online))
        an = list(upstream(window, strategy, gas, anchor))
        for (item, info_on), (_, info_an) in zip(on, an):
            yield item, {**info_on, ANCHOR_NORM_KEY: info_an}

    window: List = []
    for item in data_iter:
        window.append(item)
        if len(window) == gas:
            yield from flush(window)
            window = []
    if window:
        yield from flush(window)


_UPSTREAM_ITER = _loss_utils.iter_grad_accum_global_norm


def authors_micro_batches(items: List, method: Method, layout: EngineLayout, *, mini_batch_rows: int, gas: int,
                          collate: Callable, anchor_fn: Callable, tokens_fn: Callable,
                          sync: Optional[Callable[[int], int]] = None, dp_size: int = 1,
                          rank: int = 0) -> Iterator[Tuple[object, Dict]]:
    """``(micro-batch, loss_batch_info)`` for one epoch over this replica's single-row ``items``
    in the authors' layout (module docstring; ``layout``: the run's ``layout:`` settings,
    planned through :meth:`EngineLayout.plan`). ``anchor_fn(item)`` / ``tokens_fn(item)``: whether
    the row is a ``D_pef`` anchor, and its prompt + response tokens (token budgets);
    ``collate(list of items)`` makes a micro-batch (OpenRLHF's ``make_experience_batch``).

    With ``layout.authors_world_size`` ``items`` are the whole rollout step (every rank's rows,
    gathered), ``mini_batch_rows`` the authors' rows per GPU and step
    (``train.batch_size / authors_world_size``), and this rank (``rank`` of ``dp_size``) takes its
    share of each step's micro-batches (:func:`~openrlhf_div.algorithms.authors.share_micro_batches`;
    a padding share has ``coef`` 0). ``info["authors"]["ppo_anchors"]``: the ``[B]`` flags of
    anchors trained with the PPO loss (``layout.mixed_micro_batches: first_row``)."""
    world = layout.authors_world_size
    steps = layout.plan(method, [bool(anchor_fn(it)) for it in items], [int(tokens_fn(it)) for it in items],
                        mini_batch_rows=int(mini_batch_rows), sync=sync)
    for step in steps:
        if world is not None:
            share = share_micro_batches(step, dp_size, rank)
            step = [mb if mb is not None else replace(step[0], coef=0.0, ppo_anchors=()) for mb in share]
        for j, mb in enumerate(step):
            routed = set(mb.ppo_anchors)
            info = {AUTHORS_KEY: {"coef": mb.coef, "gas": float(gas), "boundary": j == len(step) - 1,
                                  "anchor": mb.anchor,
                                  "ppo_anchors": torch.tensor([i in routed for i in mb.rows], dtype=torch.bool)}}
            yield collate([items[i] for i in mb.rows]), info


def metric_keys(method: Method) -> List[str]:
    """The metric names :func:`div_actor_loss` reports for ``method``, whatever the micro-batch
    holds (data-parallel ranks all-reduce metrics key by key, so every rank needs the same set):
    the components' declarations (:meth:`Method.metric_names`), then the loss parts."""
    return [f"div/{k}" for k in method.metric_names()] + ["div/loss_exp", "div/loss_pef", "div/loss"]


def _counts(info: Optional[Dict], mask: torch.Tensor) -> Tuple[Optional[float], Optional[float]]:
    """``(num_tokens, num_seqs)`` for ``Method.loss`` from an OpenRLHF normaliser: its global
    counts divided by ``dp_size`` (``aggregate_loss`` divides by the count and multiplies by
    ``dp_size`` to undo the data-parallel gradient averaging; dividing the count by ``dp_size``
    is the same). Without one, this micro-batch is the whole step on one rank."""
    if not info:
        return float(mask.sum()), float((mask.sum(-1) > 0).sum())
    dp = float(info.get("dp_size", 1))
    tok, seqs = info.get("batch_num_tokens"), info.get("global_batch_size")
    return (None if tok is None else float(tok) / dp), (None if seqs is None else float(seqs) / dp)


def div_actor_loss(
    method: Method,
    *,
    log_probs: torch.Tensor,
    action_mask: torch.Tensor,
    is_anchor: torch.Tensor,
    old_log_probs: Optional[torch.Tensor],
    advantages: Optional[torch.Tensor],
    ref_log_probs: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    correct: Optional[torch.Tensor] = None,
    loss_batch_info: Optional[Dict] = None,
    generator: Optional[torch.Generator] = None,
    log_z: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The micro-batch loss applied by the policy actor (formula in the module docstring).

    ``ref_log_probs`` carries the reference-model log-probs on online rows (methods that need
    them) and the *stored* base log-probs on anchor rows; ``log_z`` ``[B]`` is FlowRL's head
    output. ``loss_batch_info`` is OpenRLHF's normaliser for the online tokens, with the anchor
    tokens' under ``"anchor"``; ``None`` means "this micro-batch is the whole step on one rank"
    (plain token means).
    """
    is_anchor = is_anchor.to(log_probs.device).bool()
    info = dict(loss_batch_info or {})
    authors = info.pop(AUTHORS_KEY, None)
    anchor_info = info.pop(ANCHOR_NORM_KEY, None)
    if authors is None and loss_batch_info is not None and anchor_info is None and bool(is_anchor.any()):
        raise ValueError(
            "anchor rows need the anchor-token normaliser (loss_batch_info['anchor']); "
            "DivActorPPOTrainer.ppo_train provides it (dynamic batching does not)"
        )
    routed = None if authors is None else authors.get("ppo_anchors")
    if routed is not None and bool(routed.any()):  # anchors in a rollout micro-batch: PPO at advantage +1
        is_anchor, old_log_probs, advantages = route_anchors_to_ppo(
            is_anchor, routed.to(is_anchor.device), action_mask, old_log_probs, advantages, ref_log_probs)
    online, anchor = loss_inputs(
        method, log_probs=log_probs, mask=action_mask.float(), is_anchor=is_anchor, old_log_probs=old_log_probs,
        advantages=advantages, ref_log_probs=ref_log_probs, anchor_ref_log_probs=ref_log_probs, correct=correct,
        entropy=entropy, log_z=log_z, generator=generator)
    if authors is not None:  # one micro-batch of the authors' layout; gas undoes DeepSpeed's 1/gas
        loss, m = method.loss(online=online, anchor=anchor, micro_batch_coef=float(authors["coef"]))
        loss = loss * float(authors["gas"])
    else:
        none = action_mask.new_zeros((0, action_mask.shape[-1]), dtype=torch.float32)  # a part with no rows here
        n_on, s_on = _counts(info, online.mask if online is not None else none)  # (the step's counts all the same)
        n_an, s_an = _counts(anchor_info, anchor.mask if anchor is not None else none)
        loss, m = method.loss(online=online, anchor=anchor, num_online_tokens=n_on, num_anchor_tokens=n_an,
                              num_online_seqs=s_on, num_anchor_seqs=s_an)
    total = loss + log_probs.sum() * 0.0  # keeps every row in the graph (DeepSpeed's hooks)
    metrics = {f"div/{k}": v for k, v in m.items()}
    metrics["div/loss"] = float(total.detach())
    return total, {k: metrics.get(k, 0.0) for k in metric_keys(method)}
