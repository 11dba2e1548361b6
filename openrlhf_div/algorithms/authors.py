"""The papers' published code, where it weights, aggregates or gates differently from the
spec's clean form (docs/ALGORITHMS.md, "Paper text vs authors' code vs this library").

Pure torch. Each helper here is one option a method can switch to ("as the authors ran it");
the presets say which one they use and why (``openrlhf-div methods NAME``):

* :func:`anchor_weight` -- ``anchor_weighting``: ``token_mean`` (the spec, ``L_exp + eta L_pef``)
  or ``microbatch_share`` (seamoke/DPH-RL: whole micro-batches go to the anchor or the online
  loss and every micro-batch is divided by the same accumulation count, so the anchor weighs
  ``eta x #anchor micro-batches / #online micro-batches`` -- ``eta / 8`` at 2048 : 256).
* :func:`micro_batch_token_mean` -- aggregation ``micro-batch-token-mean``: token-mean inside
  groups of ``micro_batch_seqs`` consecutive sequences, then the mean over groups (verl's
  ``agg_loss(token-mean)`` applied per micro-batch and divided by ``gradient_accumulation``).
* :func:`js_def_online_gate` -- ``js_def_online: stochastic``: the online half of the
  divergence-definition JS applied with weight ``eta`` to a micro-batch when
  ``randint(1, 10) <= js_ratio`` (the authors' ``random.randint``), instead of ``eta x lambda``
  on every micro-batch.
* :func:`clamp_k3` -- ``js_def_clamp``: verl's ``kl_penalty(low_var_kl)`` clamps the k3 value to
  ``[-10, 10]`` (zero gradient beyond).
* :class:`AuthorsLogZHead` -- FlowRL ``log_z_head: authors``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ._utils import check_same_shape, fill_masked, unknown_name_error

ANCHOR_WEIGHTINGS = ("token_mean", "microbatch_share")
JS_DEF_ONLINE_MODES = ("fixed", "stochastic")
LOG_Z_HEADS = ("small_detached", "authors")
MICRO_BATCH_TOKEN_MEAN = "micro-batch-token-mean"


def anchor_weight(eta: float, mode: str = "token_mean", *, num_online_seqs: Optional[float] = None,
                  num_anchor_seqs: Optional[float] = None) -> float:
    """The weight of ``L_pef`` next to ``L_exp`` in one optimiser step.

    ``token_mean``: ``eta``. ``microbatch_share``: ``eta * num_anchor_seqs / num_online_seqs`` --
    with micro-batches of equal size on both sides this is the authors' ``eta x #anchor
    micro-batches / #online micro-batches`` (``eta / 8`` for 256 anchors next to 128 x 16
    rollouts). Needs both counts (the optimiser step's, over all ranks); with no online rows the
    anchor part keeps ``eta`` (nothing to share with)."""
    if mode not in ANCHOR_WEIGHTINGS:
        raise unknown_name_error("anchor_weighting", mode, ANCHOR_WEIGHTINGS)
    eta = float(eta)
    if mode == "token_mean":
        return eta
    if num_online_seqs is None or num_anchor_seqs is None:
        raise ValueError("anchor_weighting='microbatch_share' needs num_online_seqs and num_anchor_seqs "
                         "(the optimiser step's online and anchor sequence counts)")
    if float(num_online_seqs) <= 0:
        return eta
    return eta * float(num_anchor_seqs) / float(num_online_seqs)


def num_micro_batches(num_seqs: float, micro_batch_seqs: int) -> int:
    """``ceil(num_seqs / micro_batch_seqs)``: the micro-batch count the authors divide by."""
    k = int(micro_batch_seqs)
    if k < 1:
        raise ValueError(f"micro_batch_seqs must be >= 1, got {micro_batch_seqs}")
    return max(1, math.ceil(float(num_seqs) / k))


def micro_batch_token_mean(loss: torch.Tensor, mask: torch.Tensor, micro_batch_seqs: int = 2,
                           num_seqs: Optional[float] = None, masked_zero: bool = False) -> torch.Tensor:
    """Token-mean inside each group of ``micro_batch_seqs`` consecutive rows, summed and divided
    by the optimiser step's micro-batch count ``ceil(num_seqs / micro_batch_seqs)`` (default: the
    rows here). A group whose tokens are all masked contributes 0 (as verl's ``masked_mean``
    with no valid token)."""
    check_same_shape("loss", loss, mask=mask)
    k = int(micro_batch_seqs)
    if k < 1:
        raise ValueError(f"micro_batch_seqs must be >= 1, got {micro_batch_seqs}")
    m = mask.to(loss.dtype)
    lm = loss if masked_zero else fill_masked(loss, mask)
    B = loss.shape[0]
    pad = (-B) % k
    seq_sum, seq_tok = lm.sum(dim=1), m.sum(dim=1)
    if pad:
        seq_sum = torch.cat([seq_sum, seq_sum.new_zeros(pad)])
        seq_tok = torch.cat([seq_tok, seq_tok.new_zeros(pad)])
    g_sum, g_tok = seq_sum.view(-1, k).sum(1), seq_tok.view(-1, k).sum(1)
    per_group = g_sum / g_tok.clamp(min=1.0)
    return per_group.sum() / num_micro_batches(B if num_seqs is None else num_seqs, k)


def micro_batch_token_weights(lengths: torch.Tensor, micro_batch_seqs: int = 2) -> torch.Tensor:
    """Per-sequence weight of one token under :func:`micro_batch_token_mean` (rows in order):
    ``1 / (#micro-batches * tokens of its micro-batch)``. The step's token-mean gives every token
    ``1 / sum(lengths)``."""
    L = torch.as_tensor(lengths, dtype=torch.float64)
    k = int(micro_batch_seqs)
    G = num_micro_batches(L.numel(), k)
    group_tok = torch.stack([L[i:i + k].sum() for i in range(0, L.numel(), k)])
    return 1.0 / (G * group_tok.repeat_interleave(k)[:L.numel()])


def js_def_online_gate(generator: torch.Generator, js_ratio: int = 1) -> bool:
    """The authors' draw ``random.randint(1, 10) <= js_ratio`` (per micro-batch), from a seeded
    ``torch.Generator`` so a run is reproducible and resumable."""
    draw = int(torch.randint(1, 11, (1,), generator=generator))
    return draw <= int(js_ratio)


def clamp_k3(value: torch.Tensor, bound: float = 10.0) -> torch.Tensor:
    """verl's clamp of the k3 value to ``[-bound, bound]`` (gradient 0 where it engages)."""
    return value.clamp(-float(bound), float(bound))


class AuthorsLogZHead(torch.nn.Module):
    """FlowRL's log Z head as its authors built it (Xuekai-Zhu/FlowRL, ``ProjZModule`` with
    ``porj_layer=3``): ``[Linear(H, H) - GELU - LayerNorm - Dropout(0.1)] x (layers - 1) +
    Linear(H, 1)`` on the mean prompt hidden state, **not** detached (its loss also trains the
    trunk). ``[B, H] -> [B]``."""

    def __init__(self, hidden_size: int, num_layers: int = 3, dropout: float = 0.1):
        super().__init__()
        blocks = []
        for _ in range(int(num_layers) - 1):
            blocks += [torch.nn.Linear(hidden_size, hidden_size), torch.nn.GELU(),
                       torch.nn.LayerNorm(hidden_size), torch.nn.Dropout(dropout)]
        blocks.append(torch.nn.Linear(hidden_size, 1))
        self.net = torch.nn.Sequential(*blocks)

    def forward(self, prompt_hidden: torch.Tensor) -> torch.Tensor:
        return self.net(prompt_hidden.float()).squeeze(-1)
