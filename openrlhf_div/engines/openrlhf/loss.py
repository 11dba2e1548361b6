"""The policy actor's loss: the registry's per-token losses, reduced by OpenRLHF's ``aggregate_loss``.

For one micro-batch whose rows are online rollouts (anchor flag 0) or ``D_pef`` anchors
(flag 1)::

    L = aggregate_loss(l_exp, m_exp, token_level_loss, **online_norm)
      + eta * aggregate_loss(l_pef, m_pef, True, **anchor_norm)

where ``l_exp = method.online_loss(...)`` and ``l_pef = method.anchor_loss(...)`` are ``[B, T]``
per-token losses from the method registry and each ``*_norm`` is OpenRLHF's
``loss_batch_info`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``) computed over
that kind's tokens of the whole optimizer step on all data-parallel ranks. OpenRLHF's own
normaliser (``iter_grad_accum_global_norm``) produces both: :func:`split_window_norms` runs
it once over the online masks and once over the anchor masks of the same window, so after
DeepSpeed's ``1 / gas`` scaling the micro-batch losses of one step add up to
``L_exp + eta * L_pef`` with each part a token mean over its own tokens, exactly as
``Method.loss(num_online_tokens=..., num_anchor_tokens=...)`` defines it.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from openrlhf_div.algorithms.authors import micro_batch_token_mean
from openrlhf_div.algorithms.registry import AnchorInputs, LossInputs, Method
from openrlhf_div.compat.flash_attn_standin import install as _install_flash_attn_standin

_install_flash_attn_standin()  # no-op when the real flash-attn is installed

from openrlhf.models.loss import aggregate_loss  # noqa: E402
from openrlhf.utils import loss_utils as _loss_utils  # noqa: E402

from .flags import ANCHOR_FLAG, CORRECT_FLAG, TOKEN_LEVEL  # noqa: E402,F401

ANCHOR_NORM_KEY = "anchor"    # loss_batch_info[ANCHOR_NORM_KEY]: the anchor tokens' normaliser


def row_values(info: Dict, key: str, n: int, device=None) -> torch.Tensor:
    """``info[key]`` as a float ``[n]`` tensor (OpenRLHF batches per-row info values as a
    tensor or as a list of 0-d tensors / numbers); zeros when the key is absent."""
    v = info.get(key) if info else None
    if v is None:
        return torch.zeros(n, device=device)
    if isinstance(v, torch.Tensor):
        t = v.reshape(-1).float()
    elif len(v) and isinstance(v[0], torch.Tensor):
        t = torch.stack([x.reshape(()) for x in v]).float()
    else:
        t = torch.as_tensor(v, dtype=torch.float32)
    if t.numel() != n:
        raise ValueError(f"info[{key!r}] has {t.numel()} values for {n} rows")
    return t.to(device) if device is not None else t


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


def metric_keys(method: Method) -> List[str]:
    """The metric names :func:`div_actor_loss` reports for ``method``, whatever the micro-batch
    holds (data-parallel ranks all-reduce metrics key by key, so every rank needs the same set).
    Found by running the method's online loss once on a 1x2 dummy batch."""
    z = torch.zeros(1, 2)
    dummy = LossInputs(log_probs=z - 1.0, old_log_probs=z - 1.0, advantages=torch.ones(1, 2),
                       mask=torch.ones(1, 2), correct=torch.ones(1, dtype=torch.bool),
                       ref_log_probs=z - 1.0, entropy=z + 1.0, log_z=torch.zeros(1),
                       generator=torch.Generator().manual_seed(0))
    _, m = method.online_loss(dummy)
    return [f"div/{k}" for k in m] + ["div/loss_exp", "div/loss_pef", "div/loss"]


def _aggregate(per_tok: torch.Tensor, mask: torch.Tensor, method: Method, token_level: Optional[bool],
               info: Dict) -> torch.Tensor:
    """OpenRLHF's ``aggregate_loss`` with its window normaliser, or, for the authors'
    ``micro-batch-token-mean``, groups of ``micro_batch_seqs`` rows of this micro-batch each weighted
    ``k / global_batch_size`` (times ``dp_size``, as ``aggregate_loss`` compensates DP averaging)."""
    if token_level is None:
        n = info.get("global_batch_size")  # the window's sequences on all ranks / gas
        loss = micro_batch_token_mean(per_tok, mask, int(method.hparams["micro_batch_seqs"]),
                                      None if n is None else float(n), masked_zero=True)
        return loss * float(info.get("dp_size", 1))
    return aggregate_loss(per_tok, mask, token_level_loss=token_level, **info)


def _count(info: Optional[Dict], rows: int) -> float:
    """Sequences of one kind in the optimiser step (the window normaliser's), or this micro-batch's."""
    if info and info.get("global_batch_size") is not None:
        return float(info["global_batch_size"])
    return float(rows)


def _sub(t: Optional[torch.Tensor], rows: torch.Tensor) -> Optional[torch.Tensor]:
    return None if t is None else t[rows]


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
    them) and the *stored* base log-probs on anchor rows; ``log_z`` ``[B]`` is FlowRL's head output. ``loss_batch_info`` is OpenRLHF's
    normaliser for the online tokens, with the anchor tokens' under ``"anchor"``; ``None``
    means "this micro-batch is the whole step on one rank" (plain token means).
    """
    needs = method.needs
    is_anchor = is_anchor.to(log_probs.device).bool()
    on, an = ~is_anchor, is_anchor
    mask_on, mask_an = split_masks(action_mask, is_anchor)
    info = dict(loss_batch_info or {})
    anchor_info = info.pop(ANCHOR_NORM_KEY, None)
    token_level = TOKEN_LEVEL[method.aggregation]
    total = log_probs.sum() * 0.0  # keeps the graph (and DeepSpeed's hooks) when a part is empty
    metrics: Dict[str, float] = {}

    if bool(on.any()):
        if old_log_probs is None or advantages is None:
            raise ValueError("online rows need old log-probs and advantages from the experience maker")
        online = LossInputs(
            log_probs=log_probs[on], old_log_probs=old_log_probs[on].to(log_probs.dtype),
            advantages=advantages[on].to(log_probs.dtype), mask=mask_on[on],
            correct=None if correct is None else correct[on].bool(),
            ref_log_probs=_sub(ref_log_probs, on) if needs.ref_log_probs else None,
            entropy=_sub(entropy, on) if needs.entropy else None, generator=generator,
            log_z=_sub(log_z, on) if needs.prompt_hidden else None)
        per_tok, m = method.online_loss(online)
        l_exp = _aggregate(per_tok, online.mask, method, token_level, info)
        total = total + l_exp
        metrics.update({f"div/{k}": v for k, v in m.items()})
        metrics["div/loss_exp"] = float(l_exp.detach())
    if bool(an.any()):
        if not needs.anchor_batch:
            raise ValueError(f"micro-batch holds D_pef anchor rows but method {method.name!r} has no anchor loss")
        if ref_log_probs is None:
            raise ValueError("anchor rows need their stored base log-probs (Experience.base_action_log_probs)")
        if loss_batch_info is not None and anchor_info is None:
            raise ValueError(
                "anchor rows need the anchor-token normaliser (loss_batch_info['anchor']); "
                "DivActorPPOTrainer.ppo_train provides it (dynamic batching does not)"
            )
        anchor = AnchorInputs(log_probs=log_probs[an], ref_log_probs=ref_log_probs[an].to(log_probs.dtype),
                              mask=mask_an[an])
        per_tok = method.anchor_loss(anchor)
        l_pef = _aggregate(per_tok, anchor.mask, method, None if token_level is None else True, anchor_info or {})
        # anchor_weighting: eta, or eta x anchor / online sequences of the window (microbatch_share)
        weight = method.effective_anchor_weight(_count(info, int(on.sum())), _count(anchor_info, int(an.sum())))
        total = total + weight * l_pef
        metrics["div/loss_pef"] = float(l_pef.detach())
    metrics["div/loss"] = float(total.detach())
    return total, {k: metrics.get(k, 0.0) for k in metric_keys(method)}
