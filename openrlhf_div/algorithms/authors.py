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
* :func:`plan_micro_batches` -- the engines' micro-batch layout under aggregation
  ``micro-batch-token-mean`` (seamoke/DPH-RL ``update_policy``): rollouts first, anchors after
  them; mini-batches of ``mini_batch_rows`` rows, each an optimiser step; micro-batches of
  ``micro_batch_seqs`` rows (or token-budget partitions with ``micro_batch_tokens``), anchors and
  rollouts never in the same one; each micro-batch's token-mean weighted ``1 / (M // k)``
  (``1 / gradient_accumulation``) or ``rows / M`` (token budgets), anchor ones also ``eta``.
  ``step_layout``: ``authors`` (anchors in trailing steps of their own, the authors' third,
  quarter-size step) or ``spread`` (anchors shared out over the rollout steps).
* :func:`balanced_partitions` -- Karmarkar-Karp partitions by token count (the token-budget
  micro-batches, as verl's ``get_seqlen_balanced_partitions``).
* :class:`AuthorsLogZHead` -- FlowRL ``log_z_head: authors``.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ._utils import check_same_shape, fill_masked, unknown_name_error

ANCHOR_WEIGHTINGS = ("token_mean", "microbatch_share")
JS_DEF_ONLINE_MODES = ("fixed", "stochastic")
LOG_Z_HEADS = ("small_detached", "authors")
MICRO_BATCH_TOKEN_MEAN = "micro-batch-token-mean"
STEP_LAYOUTS = ("authors", "spread")
MIXED_MICRO_BATCHES = ("separate", "first_row")
# verl's GRPO advantage of a group of one (compute_grpo_outcome_advantage: mean 0, std 1, epsilon
# 1e-6) for an anchor's reward 1: what an anchor gets when a micro-batch whose first row is a
# rollout also holds it (mixed_micro_batches: first_row)
ANCHOR_PPO_ADVANTAGE = 1.0 / (1.0 + 1e-6)


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


def micro_batch_token_mean(loss: torch.Tensor, mask: torch.Tensor, micro_batch_seqs: int = 2,
                           num_seqs: Optional[float] = None, masked_zero: bool = False) -> torch.Tensor:
    """Token-mean inside each group of ``micro_batch_seqs`` (``k``) consecutive rows, each group
    weighted ``k / num_seqs`` (``num_seqs``: the optimiser step's sequence count, default the rows
    here) -- verl's ``loss / gradient_accumulation`` with ``gradient_accumulation = mini-batch rows
    // k``, so a trailing partial group weighs as much as a full one, as there. With full groups
    this is the mean over groups of their token-means. A group with no valid token contributes 0."""
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
    n = float(B if num_seqs is None else num_seqs)
    if n <= 0:
        return per_group.sum() * 0.0  # no sequence in the step: nothing to weigh
    return per_group.sum() * (k / n)  # no clamp: a count below 1 (OpenRLHF's step count / gas) is exact


def micro_batch_token_weights(lengths: torch.Tensor, micro_batch_seqs: int = 2) -> torch.Tensor:
    """Per-sequence weight of one token under :func:`micro_batch_token_mean` (rows in order):
    ``(k / #sequences) / tokens of its micro-batch``. The step's token-mean gives every token
    ``1 / sum(lengths)``."""
    L = torch.as_tensor(lengths, dtype=torch.float64)
    k = int(micro_batch_seqs)
    group_tok = torch.stack([L[i:i + k].sum() for i in range(0, L.numel(), k)])
    return (k / L.numel()) / group_tok.repeat_interleave(k)[:L.numel()]


# ------------------------------------------------------------------ the authors' micro-batch layout
@dataclass(frozen=True)
class PlannedMicroBatch:
    """One micro-batch of :func:`plan_micro_batches`: row indices (into the rows planned), whether
    it holds anchor rows (it holds one kind only) and its accumulation factor ``coef`` -- its loss
    is ``coef x token_mean(micro-batch) (x eta for anchors)``."""

    rows: Tuple[int, ...]
    anchor: bool
    coef: float
    # rows of ``rows`` that are anchors in a rollout micro-batch (``mixed_micro_batches:
    # first_row``): trained with the PPO loss at advantage ANCHOR_PPO_ADVANTAGE against their
    # stored log-probs, as the authors' code does (their micro-batch takes its first row's loss)
    ppo_anchors: Tuple[int, ...] = ()
    rank: int = 0  # the authors' data-parallel rank this micro-batch ran on (authors_world_size)


def balanced_partitions(tokens: Sequence[int], k: int, equal_size: bool = False) -> List[List[int]]:
    """``k`` non-empty groups of indices with near-equal token sums by Karmarkar-Karp largest
    differencing, with the tie-breaking of verl's ``get_seqlen_balanced_partitions``: groups
    ordered by token sum (largest first), indices sorted inside.

    Start (``equal_size=False``, the token-budget micro-batches): one partial solution per item
    (sorted by (tokens, index)), the item in its first group; ``equal_size=True`` (verl's
    ``_balance_batch`` over the data-parallel ranks, every group ``n / k`` items): one partial
    solution per ``k`` consecutive items of that order, one item in each group. Repeatedly take the two partial solutions with the largest spread (max - min group
    sum; ties: the larger top group first), join the first's largest group with the second's
    smallest and so on, re-sort the groups, and put the result back."""
    k = int(k)
    n = len(tokens)
    if not 1 <= k <= n:
        raise ValueError(f"cannot split {n} rows into {k} token-balanced micro-batches")

    def make(groups):
        groups = sorted(groups, key=_group_key, reverse=True)
        return _KKState(groups[0][0] - groups[-1][0], groups)

    heap = []
    ordered = sorted((int(t), i) for i, t in enumerate(tokens))
    if equal_size:
        if n % k:
            raise ValueError(f"cannot split {n} rows into {k} equal-size token-balanced groups ({n} % {k} != 0)")
        for o in range(0, n, k):
            heapq.heappush(heap, make([(t, [(i, t)]) for t, i in ordered[o:o + k]]))
    else:
        for t, i in ordered:
            heapq.heappush(heap, make([(t, [(i, t)])] + [(0, []) for _ in range(k - 1)]))
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        joined = [(ga[0] + gb[0], ga[1] + gb[1]) for ga, gb in zip(a.groups, reversed(b.groups))]
        heapq.heappush(heap, make(joined))
    parts = [sorted(i for i, _ in g[1]) for g in heap[0].groups]
    if any(not p for p in parts):
        raise ValueError(f"token-balanced split of {n} rows into {k} left an empty micro-batch")
    return parts


def _group_key(g):
    """The order of one group of a partial solution: (token sum, size, items)."""
    return (g[0], len(g[1]), g[1])


class _KKState:
    """A partial solution; ``heapq`` pops the largest spread first (ties: the larger top group)."""

    __slots__ = ("spread", "groups")

    def __init__(self, spread, groups):
        self.spread, self.groups = spread, groups

    def __lt__(self, other):
        if self.spread != other.spread:
            return self.spread > other.spread
        return _group_key(self.groups[0]) > _group_key(other.groups[0])


def _segment_micro_batches(rows: List[int], anchor: bool, tokens: Optional[Sequence[int]], mini_batch_rows: int,
                           micro_batch_seqs: int, micro_batch_tokens: Optional[int],
                           sync: Optional[Callable[[int], int]]) -> List[PlannedMicroBatch]:
    if not rows:
        return []
    M = int(mini_batch_rows)
    if micro_batch_tokens is None:
        k = int(micro_batch_seqs)
        ga = M // k  # the authors' gradient_accumulation = ppo_mini_batch_size // micro (an int)
        return [PlannedMicroBatch(tuple(rows[i:i + k]), anchor, 1.0 / ga) for i in range(0, len(rows), k)]
    seg_tokens = [int(tokens[i]) for i in rows]
    budget = int(micro_batch_tokens)
    if max(seg_tokens) > budget:
        raise ValueError(f"a row of {max(seg_tokens)} tokens exceeds micro_batch_tokens={budget} (the authors' "
                         "ppo_max_token_len_per_gpu must hold the longest sequence); raise micro_batch_tokens")
    n = min(len(rows), -(-sum(seg_tokens) // budget))
    if sync is not None:  # the same count on every data-parallel rank (verl all-reduces the max)
        n = min(len(rows), int(sync(n)))
    parts = balanced_partitions(seg_tokens, n)
    return [PlannedMicroBatch(tuple(rows[j] for j in p), anchor, len(p) / M) for p in parts]


def plan_micro_batches(is_anchor: Sequence[bool], tokens: Optional[Sequence[int]] = None, *,
                       mini_batch_rows: int, micro_batch_seqs: int = 2,
                       micro_batch_tokens: Optional[int] = None, step_layout: str = "spread",
                       sync: Optional[Callable[[int], int]] = None, authors_world_size: Optional[int] = None,
                       mixed_micro_batches: str = "separate") -> List[List[PlannedMicroBatch]]:
    """The optimiser steps of one rollout step on one data-parallel rank, as seamoke/DPH-RL's
    ``DataParallelPPOActor.update_policy`` lays them out (docs/ALGORITHMS.md section 9, rows 1, 1b, 2).

    ``is_anchor[i]`` / ``tokens[i]`` (prompt + response tokens, for token budgets) describe this
    rank's rows in rollout order. Rollout rows come first and anchor rows after them (the
    authors' trainer appends the anchors to the rollout batch). ``mini_batch_rows`` ``M`` is the
    authors' ``ppo_mini_batch_size`` on one rank (rows per optimiser step).

    * ``step_layout="authors"``: consecutive mini-batches of ``M`` rows of that order, one
      optimiser step each; with 2048 rollouts and 256 anchors at ``M`` 1024: two rollout steps
      and a third, quarter-size step of anchors. ``"spread"``: the rollout mini-batches, each with
      an equal consecutive share of the anchors (every step holds both kinds).
    * Inside a mini-batch, rollout rows and anchor rows form separate micro-batches: consecutive
      groups of ``micro_batch_seqs`` rows, each weighted ``coef = 1 / (M // micro_batch_seqs)``
      (the authors' ``loss / gradient_accumulation``, also for a short trailing mini-batch); or,
      with ``micro_batch_tokens`` (the authors' ``use_dynamic_bsz`` with
      ``ppo_max_token_len_per_gpu``), ``ceil(tokens / budget)`` token-balanced partitions
      (:func:`balanced_partitions`), each weighted ``coef = rows / M`` (the authors'
      ``loss * len(micro-batch) / ppo_mini_batch_size``). ``sync(n)`` makes the partition count
      the same on every rank (the maximum, as verl does).

    Where the authors' code would put both kinds in one micro-batch (a mini-batch boundary
    inside it, or a token-budget partition across the rollout/anchor border) and give every row
    the first row's loss, this layout keeps them apart (docs/ALGORITHMS.md section 9, row 1b).

    ``authors_world_size`` ``W`` (None: this rank's rows only, as above): the rows are the
    **whole** rollout step (every data-parallel rank's), and the steps are the authors' at
    ``W`` GPUs (:func:`_plan_authors_world`): ``mini_batch_rows`` is then the authors'
    per-GPU ``ppo_mini_batch_size`` (``train.batch_size / W``), each optimiser step holds every
    authors' rank's micro-batches, and ``coef`` includes their ``1 / W`` gradient average.
    ``mixed_micro_batches``: ``separate`` keeps the kinds apart; ``first_row`` (only with
    ``authors_world_size``) partitions each rank's mini-batch as a whole, as the authors do, and
    a micro-batch takes its first row's loss (anchors after a rollout: ``ppo_anchors``).
    """
    if step_layout not in STEP_LAYOUTS:
        raise unknown_name_error("step_layout", step_layout, STEP_LAYOUTS)
    if mixed_micro_batches not in MIXED_MICRO_BATCHES:
        raise unknown_name_error("mixed_micro_batches", mixed_micro_batches, MIXED_MICRO_BATCHES)
    if authors_world_size is not None:
        return _plan_authors_world(is_anchor, tokens, mini_batch_rows=mini_batch_rows,
                                   micro_batch_seqs=micro_batch_seqs, micro_batch_tokens=micro_batch_tokens,
                                   step_layout=step_layout, world=int(authors_world_size),
                                   mixed=mixed_micro_batches)
    if mixed_micro_batches != "separate":
        raise ValueError("mixed_micro_batches: first_row reproduces the authors' micro-batches at their GPU count; "
                         "it needs authors_world_size (set it, or mixed_micro_batches: separate)")
    M, k = int(mini_batch_rows), int(micro_batch_seqs)
    if micro_batch_tokens is None and not 1 <= k <= M:
        raise ValueError(f"the authors' layout needs 1 <= micro_batch_seqs ({k}) <= mini-batch rows ({M}); "
                         "raise train.batch_size or lower micro_batch_seqs")
    if micro_batch_tokens is not None and tokens is None:
        raise ValueError("micro_batch_tokens needs the rows' token counts")
    flags = [bool(a) for a in is_anchor]
    online = [i for i, a in enumerate(flags) if not a]
    anchors = [i for i, a in enumerate(flags) if a]
    if step_layout == "authors":
        order = online + anchors
        minis = [order[s:s + M] for s in range(0, len(order), M)]
    else:
        n_steps = max(1, -(-len(online) // M))
        cuts = [round(j * len(anchors) / n_steps) for j in range(n_steps + 1)]
        minis = [online[j * M:(j + 1) * M] + anchors[cuts[j]:cuts[j + 1]] for j in range(n_steps)]
    steps = []
    for mb in minis:
        seg_on = [i for i in mb if not flags[i]]
        seg_an = [i for i in mb if flags[i]]
        step = (_segment_micro_batches(seg_on, False, tokens, M, k, micro_batch_tokens, sync)
                + _segment_micro_batches(seg_an, True, tokens, M, k, micro_batch_tokens, sync))
        if step:
            steps.append(step)
    return steps


def _plan_authors_world(is_anchor: Sequence[bool], tokens: Optional[Sequence[int]], *, mini_batch_rows: int,
                        micro_batch_seqs: int, micro_batch_tokens: Optional[int], step_layout: str, world: int,
                        mixed: str) -> List[List[PlannedMicroBatch]]:
    """The optimiser steps of one rollout step as seamoke/DPH-RL ran it on ``world`` GPUs.

    * ``RayPPOTrainer.fit``: ``_balance_batch`` (``trainer.balance_batch: True``, the fork's
      default, no script changes it) reorders the rollouts into ``world`` equal-size
      token-balanced groups (:func:`balanced_partitions` with ``equal_size``) laid end to end;
      the anchors are appended after them (``DataProto.concat([batch, sft_batch])``).
    * ``update_actor`` dispatches contiguous equal chunks, one per rank (``DataProto.chunk``).
    * Each rank's ``update_policy``: mini-batches of ``mini_batch_rows`` consecutive rows of its
      chunk; micro-batches ``split(micro_batch_seqs)`` (``coef = 1 / (M // k)``) or, with
      ``micro_batch_tokens``, ``rearrange_micro_batches``: ``ceil(tokens / budget)`` partitions,
      the count all-reduced (max) over the ranks for the same mini-batch, ``coef = rows / M``.
      ``mixed == "first_row"``: over the whole mini-batch, each micro-batch taking its first
      row's loss (``data['type'][0] == 2``); ``"separate"``: rollouts and anchors partitioned
      apart.
    * FSDP averages the gradients of the ``world`` ranks: every ``coef`` is divided by ``world``;
      optimiser step ``j`` holds every rank's ``j``-th mini-batch.
    """
    W, M, k = world, int(mini_batch_rows), int(micro_batch_seqs)
    if W < 1:
        raise ValueError(f"authors_world_size must be >= 1, got {world}")
    if step_layout != "authors":
        raise ValueError("authors_world_size lays each step out as the authors did (their rank slicing puts the "
                         f"anchors where their order puts them); it needs step_layout: authors, got {step_layout!r}")
    if micro_batch_tokens is None and not 1 <= k <= M:
        raise ValueError(f"the authors' layout needs 1 <= micro_batch_seqs ({k}) <= mini-batch rows per GPU ({M}); "
                         "raise train.batch_size or lower micro_batch_seqs / authors_world_size")
    flags = [bool(a) for a in is_anchor]
    if (micro_batch_tokens is not None or W > 1) and tokens is None:
        raise ValueError("the authors' layout at authors_world_size > 1 or with micro_batch_tokens needs the rows' "
                         "token counts")
    online = [i for i, a in enumerate(flags) if not a]
    anchors = [i for i, a in enumerate(flags) if a]
    N = len(flags)
    if N % W:
        raise ValueError(f"the authors' dispatch splits the {N} rows of a rollout step into {W} equal chunks "
                         f"(DataProto.chunk); {N} % {W} != 0: make rollouts + anchors a multiple of "
                         "authors_world_size")
    if online:
        if len(online) % W:
            raise ValueError(f"the authors' _balance_batch splits the {len(online)} rollouts into {W} equal groups; "
                             f"make the rollout count a multiple of authors_world_size ({W})")
        groups = balanced_partitions([int(tokens[i]) for i in online], W, equal_size=True) if W > 1 else [
            list(range(len(online)))]
        online = [online[j] for g in groups for j in g]
    order = online + anchors
    C = N // W
    chunks = [order[r * C:(r + 1) * C] for r in range(W)]
    minis = [[c[s:s + M] for s in range(0, len(c), M)] for c in chunks]  # the same count on every rank
    steps: List[List[PlannedMicroBatch]] = []
    for j in range(len(minis[0])):
        per_rank = [minis[r][j] for r in range(W)]
        step: List[PlannedMicroBatch] = []
        if mixed == "separate":
            for r, mb in enumerate(per_rank):
                for kind in (False, True):
                    seg = [i for i in mb if flags[i] == kind]
                    for p in _segment_micro_batches(seg, kind, tokens, M, k, micro_batch_tokens, None):
                        step.append(PlannedMicroBatch(p.rows, p.anchor, p.coef / W, (), r))
            steps.append(step)
            continue
        if micro_batch_tokens is None:
            parts_of = [[list(range(s, min(s + k, len(mb)))) for s in range(0, len(mb), k)] for mb in per_rank]
            coefs = [[1.0 / (M // k)] * len(p) for p in parts_of]
        else:
            budget = int(micro_batch_tokens)
            counts = []
            for mb in per_rank:
                lens = [int(tokens[i]) for i in mb]
                if max(lens) > budget:
                    raise ValueError(f"a row of {max(lens)} tokens exceeds micro_batch_tokens={budget} (the authors' "
                                     "ppo_max_token_len_per_gpu must hold the longest sequence); raise "
                                     "micro_batch_tokens")
                counts.append(min(len(mb), -(-sum(lens) // budget)))
            n = max(counts)  # rearrange_micro_batches all-reduces the count (max) over the ranks
            if n > min(len(mb) for mb in per_rank):
                raise ValueError(f"the authors' synchronised micro-batch count {n} exceeds a rank's {min(len(mb) for mb in per_rank)} "
                                 "rows (their rearrange_micro_batches asserts); raise micro_batch_tokens")
            parts_of = [balanced_partitions([int(tokens[i]) for i in mb], n) for mb in per_rank]
            coefs = [[len(p) / M for p in parts] for parts in parts_of]
        for r, (mb, parts) in enumerate(zip(per_rank, parts_of)):
            for p, c in zip(parts, coefs[r]):
                rows = tuple(mb[q] for q in sorted(p))  # the micro-batch in mini-batch order
                kind = flags[rows[0]]
                if kind and not all(flags[i] for i in rows):
                    raise AssertionError("an anchor-first micro-batch holding rollouts (the authors' order puts "
                                         "rollouts first)")
                ppo = () if kind else tuple(i for i in rows if flags[i])
                step.append(PlannedMicroBatch(rows, kind, c / W, ppo, r))
        steps.append(step)
    return steps


def share_micro_batches(step: Sequence[PlannedMicroBatch], dp_size: int, rank: int
                        ) -> List[Optional[PlannedMicroBatch]]:
    """This engine rank's share of one optimiser step planned for the whole rollout step
    (``authors_world_size``): micro-batch ``i`` goes to rank ``i % dp_size``; every rank gets
    the same count (``ceil(len / dp_size)``), ``None`` standing for a micro-batch of weight 0
    (the engine repeats one with ``coef`` 0 so its collectives match). Each share's ``coef``
    is multiplied by ``dp_size``: the engine averages gradients over its ranks."""
    D = int(dp_size)
    per = -(-len(step) // D)
    mine = [step[i] for i in range(int(rank), len(step), D)]
    out: List[Optional[PlannedMicroBatch]] = [
        PlannedMicroBatch(mb.rows, mb.anchor, mb.coef * D, mb.ppo_anchors, mb.rank) for mb in mine]
    return out + [None] * (per - len(out))


def route_anchors_to_ppo(is_anchor: torch.Tensor, ppo_anchor: torch.Tensor, mask: torch.Tensor,
                         old_log_probs: torch.Tensor, advantages: torch.Tensor,
                         anchor_log_probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(is_anchor, old_log_probs, advantages)`` for a micro-batch with anchors routed to the PPO
    loss (:class:`PlannedMicroBatch` ``ppo_anchors``): those rows become online rows whose old
    log-probs are their stored ones (the authors' type-2 ``old_log_probs``) and whose advantage is
    :data:`ANCHOR_PPO_ADVANTAGE` on every response token."""
    sel = ppo_anchor.to(is_anchor.device).bool().reshape(-1)
    if bool((sel & ~is_anchor.bool().reshape(-1)).any()):
        raise ValueError("ppo_anchors names a rollout row")
    rows = sel.view(-1, *([1] * (old_log_probs.dim() - 1)))
    old = torch.where(rows, anchor_log_probs.to(old_log_probs.dtype), old_log_probs)
    adv_full = advantages if advantages.shape == mask.shape else advantages.reshape(-1, 1).expand_as(mask)
    # float64 where the fields are float32 (Megatron's rows): loss_inputs casts to the log-probs' dtype
    adv_dt = torch.promote_types(adv_full.dtype, torch.float64) if adv_full.is_floating_point() else torch.float64
    adv = torch.where(rows, mask.to(adv_dt) * ANCHOR_PPO_ADVANTAGE, adv_full.to(adv_dt))
    return is_anchor.bool().reshape(-1) & ~sel, old, adv


def layout_report(method, n_rollouts: int, n_anchors: int, train_batch_size: int,
                  row_tokens: Optional[int] = None, layout: Optional[dict] = None) -> List[str]:
    """Lines describing one rollout step in the authors' layout of ``method`` (engines under
    ``micro-batch-token-mean``): the authors' GPU count and, per optimiser step, the share of a
    full step of rollouts it trains and the anchor weight (``eta x`` the summed anchor
    micro-batch factors) it implies, and how many anchors get the PPO loss
    (``mixed_micro_batches: first_row``). Token budgets are laid out with every row at
    ``row_tokens`` tokens (said in the first line). ``layout``: the run's micro-batch layout
    (``EngineLayout.to_dict()``: step_layout, micro_batch_tokens, authors_world_size,
    mixed_micro_batches; the ``layout:`` section)."""
    h = dict(method.hparams)
    h.update(layout or {})
    world = h.get("authors_world_size")
    budget = h.get("micro_batch_tokens")
    per_gpu = int(train_batch_size) // int(world or 1)
    flags = [False] * int(n_rollouts) + [True] * int(n_anchors)
    tokens = [int(row_tokens or 1)] * len(flags)
    steps = plan_micro_batches(flags, tokens, mini_batch_rows=per_gpu, micro_batch_seqs=int(h["micro_batch_seqs"]),
                               micro_batch_tokens=budget, step_layout=h.get("step_layout", "spread"),
                               authors_world_size=world, mixed_micro_batches=h.get("mixed_micro_batches", "separate"))
    eta = float(h.get("anchor_eta", 0.0))
    where = (f"micro-batches of {budget} tokens, every row taken as {row_tokens} tokens" if budget is not None
             else f"micro-batches of {h['micro_batch_seqs']} rows")
    gpus = (f"the authors' GPU count {world} (authors_world_size; {per_gpu} rows per GPU and step)" if world is not None
            else "each engine rank's own rows (authors_world_size unset: the authors' one-GPU form)")
    lines = [f"authors' layout: {gpus}; {n_rollouts} rollouts + {n_anchors} anchors per rollout step; {where}"]
    for j, step in enumerate(steps, 1):
        roll = sum(mb.coef for mb in step if not mb.anchor)
        anc = sum(mb.coef for mb in step if mb.anchor)
        routed = sum(len(mb.ppo_anchors) for mb in step)
        lines.append(f"  step {j}: rollout (PPO) micro-batches {roll:.3f} of a step, anchor weight eta x {anc:.3f} "
                     f"= {eta * anc:.5f}" + (f"; {routed} anchors in rollout micro-batches, trained with the PPO loss "
                                             "at advantage +1 (mixed_micro_batches: first_row)" if routed else ""))
    return lines


def micro_batch_loss(loss: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """``coef x`` the token-mean of one micro-batch (verl's ``agg_loss('token-mean')`` over the
    micro-batch's own tokens, then the accumulation factor). No clamp on the factor; a
    micro-batch without a valid token gives 0."""
    check_same_shape("loss", loss, mask=mask)
    m = mask.to(loss.dtype)
    tok = m.sum()
    total = fill_masked(loss, mask).sum()
    return total * (float(coef) / tok) if float(tok) > 0 else total * 0.0


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


# ------------------------------------------------------------------ what `methods NAME` prints
# option -> (the spec's value, the authors' code's value, source). The presets keep the spec's
# value unless they say otherwise; `openrlhf-div methods NAME` shows each option a method has,
# its value and which side it follows (docs/ALGORITHMS.md section 9, rows in brackets).
AUTHORS_OPTIONS = {
    "anchor_weighting": ("token_mean", "microbatch_share",
                         "[1] seamoke/DPH-RL verl/workers/actor/dp_actor.py update_policy: whole micro-batches "
                         "routed by data['type'][0], each divided by gradient_accumulation -> eta x #anchor / "
                         "#online micro-batches (eta/8 at 2048:256)"),
    "aggregation": ("token-mean", MICRO_BATCH_TOKEN_MEAN,
                    "[2] seamoke/DPH-RL dp_actor.py update_policy + core_algos.agg_loss('token-mean') per "
                    "micro-batch of ppo_micro_batch_size_per_gpu=2 (scripts/llama/forward_kl.sh)"),
    "micro_batch_seqs": (2, 2, "[2] scripts/llama/*.sh ppo_micro_batch_size_per_gpu=2"),
    "step_layout": ("spread", "authors", "[1] seamoke/DPH-RL ray_trainer.py fit appends the anchors after the rollouts, "
                                         "dp_actor.py update_policy batch.split(ppo_mini_batch_size): the anchors "
                                         "form a trailing (quarter-size) optimiser step; engines only"),
    "micro_batch_tokens": (None, 32384, "[1b] seamoke/DPH-RL verl/trainer/config/ppo_trainer.yaml use_dynamic_bsz: "
                                        "true, ppo_max_token_len_per_gpu: 32384 (every scripts/llama/*.sh but "
                                        "forward_kl.sh, which sets use_dynamic_bsz=False); engines only"),
    "js_def_clamp": (None, 10.0, "[3a] seamoke/DPH-RL verl/trainer/ppo/core_algos.py kl_penalty('low_var_kl'): "
                                 "k3 clamped to [-10, 10]"),
    "js_def_online": ("fixed", "stochastic", "[3b] seamoke/DPH-RL dp_actor.py update_policy: "
                                            "random.randint(1, 10) <= js_ratio, weight sft_loss_coeff"),
    "js_def_ratio": (1, 1, "[3b] seamoke/DPH-RL verl/trainer/config/ppo_trainer.yaml js_ratio: 1"),
    "lad_clip": (None, (0.2, 0.28), "[6a] LAD paper App. C.2: DAPO clip-higher for every method"),
    "lad_hellinger_half": (True, False, "[6b] LAD paper Table 5 loss column (no 1/2; generator has it)"),
    "log_z_head": ("small_detached", "authors", "[7a] Xuekai-Zhu/FlowRL verl/workers/fsdp_workers.py ProjZModule "
                                                "(porj_layer=3), not detached"),
    "flowrl_max_weight": (10.0, None, "[7b] Xuekai-Zhu/FlowRL dp_actor.py compute_flowrl_objective multiplies by "
                                      "the unclipped importance weight"),
    "ds_granularity": ("token", "seq_sum", "[8a] Differential Smoothing paper Eq. 6 (sequence log-probability; "
                                           "no public code)"),
    "kl_cov_min_one": (False, True, "[9c] volcengine/verl core_algos.py compute_policy_loss_kl_cov: "
                                    "max(1, int(N * ratio))"),
    "eps_low": (None, None, ""), "eps_high": (None, None, ""), "dual_clip": (None, None, ""),
}
# the authors' PPO clip where it differs from the presets', per method: (eps_low, eps_high, dual_clip)
AUTHORS_CLIP = {
    "clip_cov": ((1.0, 1.0, None), "[5] PRIME-RL/Entropy-Mechanism-of-RL recipe/dapo/7b_clip_cov.sh clip_ratio 1 / 1; "
                                   "compute_policy_loss_clip_cov has no dual clip"),
    "cispo": ((10.0, 0.2, None), "[9b] volcengine/verl examples/cispo_trainer/run_cispo_qwen2_5_0_5b_gsm8k.sh "
                                 "clip_ratio_low 10, clip_ratio_high 0.2"),
}


# per preset: hyperparameters whose value in the authors' published scripts differs from the
# preset's (which follows the paper's text): name -> {hparam: (authors' value, source)}
AUTHORS_SCRIPT_VALUES = {
    "dph_js": {"anchor_eta": (0.01, "[4e] seamoke/DPH-RL scripts/llama/js_kl.sh sft_loss_coeff=${2:-'0.01'} "
                                    "(paper Table 5: 0.2)")},
    "dph_alpha": {"anchor_alpha": (0.2, "[4e] seamoke/DPH-RL scripts/llama/alpha.sh alpha_coeff=${3:-'0.2'}")},
}


# run-level settings (config / command line, not method hyperparameters) where the DPH-RL authors'
# runs differ from the library's defaults: (setting, library default, authors' value, source).
# `openrlhf-div methods NAME` lists them for the anchor methods (docs/ALGORITHMS.md section 9).
AUTHORS_RUN_SETTINGS = (
    ("presample n_pre / tau", "8 / 8", "4 / 4", "[4a] seamoke/DPH-RL data/sql/process_data/exact_correct_id.py id_groups=4"),
    ("presample drop_unsolved", "false", "false (SQL)", "[4b] exact_correct_id.py: completely_wrong_ids never filled"),
    ("presample resample_anchor_responses", "false (first correct pre-sampling response)", "true",
     "[4c] ray_trainer.py fit generate_sft (nsample=1); anchors drawn once at pre-sampling and stored either way"),
    ("pre-sampling top-p (presample: rollout.top_p)", "the rollout's", "0.95",
     "[4g] scripts/llama/offline_sampling.sh val_kwargs.top_p=0.95"),
    ("anchor draw top-p (presample.anchor_top_p)", "the pre-sampling's", "0.9",
     "[4g] generate_sft samples with the rollout settings: ppo_trainer.yaml rollout.top_p 0.9"),
    ("rollout top-p (rollout.top_p)", "the config's (paper text 0.95)", "0.9",
     "[4g] verl/trainer/config/ppo_trainer.yaml rollout.top_p (no script sets it)"),
    ("evaluation top-p (div.eval_top_p)", "the rollout's", "0.95", "[4g] paper App. D; offline_sampling.sh"),
    ("train.batch_size (rows per optimiser step)", "the config's", "64 prompts x n (1024 at n=16)",
     "[4g] scripts/llama/*.sh ppo_mini_batch_size=64"),
    ("anchor serving", "seeded shuffled epochs of D_pef (anchor_data.Cursor)", "D_pef x3 in fixed shuffled "
     "blocks of 256", "[4d] ray_trainer.py fit (declined: same marginal anchor distribution per step)"),
)


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and not isinstance(b, bool):
        return float(a) == float(b)
    return a == b


def authors_modes(method, layout: Optional[dict] = None) -> dict:
    """For each spec-vs-authors option a method has: its value, the spec's and the authors'
    value, which one it follows (``spec`` / ``authors`` / ``both`` / ``other``) and the source.
    ``layout``: the run's micro-batch layout (``EngineLayout.to_dict()``: step_layout, micro_batch_tokens)."""
    h = dict(getattr(method, "hparams", {}) or {})
    h.update(layout or {})
    h["aggregation"] = getattr(method, "aggregation", "token-mean")
    out = {}
    for opt, (spec, auth, src) in AUTHORS_OPTIONS.items():
        if opt in ("eps_low", "eps_high", "dual_clip") or opt not in h:
            continue
        if opt == "micro_batch_seqs" and h["aggregation"] != MICRO_BATCH_TOKEN_MEAN:
            continue
        if opt == "aggregation" and h["aggregation"] not in (spec, auth):
            continue  # a method whose own aggregation is neither (FlowRL's sequence mean)
        v = h[opt]
        follows = ("both" if _same(v, spec) and _same(v, auth) else "spec" if _same(v, spec)
                   else "authors" if _same(v, auth) else "other")
        if opt == "micro_batch_tokens" and v is None:
            follows = "both"  # forward_kl.sh runs without token budgets (use_dynamic_bsz=False)
        out[opt] = {"value": v, "spec": spec, "authors": auth, "follows": follows, "source": src}
    for opt, (auth, src) in AUTHORS_SCRIPT_VALUES.get(getattr(method, "name", ""), {}).items():
        if opt in h:
            out[opt] = {"value": h[opt], "spec": "the preset's (paper text)", "authors": auth,
                        "follows": "authors" if _same(h[opt], auth) else "spec", "source": src}
    clip = AUTHORS_CLIP.get(getattr(method, "policy_loss", None))
    if clip is not None and all(k in h for k in ("eps_low", "eps_high", "dual_clip")):
        v = (h["eps_low"], h["eps_high"], h["dual_clip"])
        out["eps_low/eps_high/dual_clip"] = {"value": v, "spec": "the preset's", "authors": clip[0],
                                             "follows": "authors" if _same(v, clip[0]) else "spec",
                                             "source": clip[1]}
    return out


def mode_summary(method, layout: Optional[dict] = None) -> str:
    """One line for reports: which form the method runs in (the spec's clean form, the authors'
    code, or a mix) and the options' values (``layout``: as :func:`authors_modes`)."""
    modes = authors_modes(method, layout)
    if not modes:
        return "the spec's form (no authors'-code option applies)"
    sides = {m["follows"] for m in modes.values()} - {"both"}
    kind = ("the spec's clean form" if sides <= {"spec"} else "the authors' code" if sides == {"authors"}
            else "mixed")
    return kind + ": " + ", ".join(f"{k}={m['value']}" for k, m in modes.items())
