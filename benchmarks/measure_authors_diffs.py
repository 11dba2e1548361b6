"""Measure, on random inputs, how far the papers' *published code* is from this library's
clean form (docs/ALGORITHMS.md, "Paper text vs authors' code vs this library").

Every "authors" quantity below is computed by a small transcription, written here, of what the
cited code does (read from the public repositories; no code copied):

* seamoke/DPH-RL  verl/trainer/ppo/ray_trainer.py ``fit`` (anchor set: replicated x3, cut to a
  multiple of 256, chunks of 256 appended after the 2048 rollouts), verl's ``DataProto.chunk``
  dispatch (contiguous rows per data-parallel rank), verl/workers/actor/dp_actor.py
  ``update_policy`` (mini-batches of ``ppo_mini_batch_size * n / world`` rows, micro-batches of
  ``ppo_micro_batch_size_per_gpu`` rows or, with ``use_dynamic_bsz``, token-budget partitions;
  a micro-batch is an anchor micro-batch iff its FIRST row has type 2; loss = token-mean of the
  micro-batch / gradient_accumulation, or * rows / mini-batch rows with dynamic bsz; FSDP
  averages over ranks), verl/trainer/ppo/core_algos.py ``kl_penalty`` (k3 clamped to [-10, 10]).
* PRIME-RL/Entropy-Mechanism-of-RL recipe/dapo/7b_clip_cov.sh (clip 1 / 1) and verl's
  ``compute_policy_loss_clip_cov`` (no dual clip).
* Xuekai-Zhu/FlowRL verl/workers/fsdp_workers.py ``ProjZModule`` and dp_actor.py
  ``compute_flowrl_objective``.
* volcengine/verl core_algos.py ``agg_loss`` (``seq-mean-token-sum-norm``),
  ``compute_policy_loss_kl_cov`` and ``compute_grpo_outcome_advantage``.

The library side calls the library. Run: ``python benchmarks/measure_authors_diffs.py`` (CPU,
a few seconds); it prints one line per figure quoted in docs/ALGORITHMS.md.
"""
from __future__ import annotations

import argparse
import math
from typing import Dict, List, Sequence, Tuple

import torch

from openrlhf_div.algorithms import authors as A
from openrlhf_div.algorithms.advantages import ds_reshape_advantages, group_advantages
from openrlhf_div.algorithms.losses import dph_js_def_loss, ppo_clip_mask


# --------------------------------------------------------------------------- row 1 / 2
def balanced_partitions(lengths: Sequence[int], k: int) -> List[List[int]]:
    """``k`` groups of indices with near-equal token sums (greedy longest-first; verl uses a
    Karmarkar-Karp partitioner with the same goal, so mixing counts are indicative)."""
    k = max(1, min(k, len(lengths)))
    groups: List[List[int]] = [[] for _ in range(k)]
    sums = [0] * k
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        g = sums.index(min(sums))
        groups[g].append(i)
        sums[g] += lengths[i]
    return [sorted(g) for g in groups]


def verl_micro_batches(rows: Sequence[Tuple[int, int]], world: int, mini_rows_total: int, micro: int = 2,
                       dynamic_tokens: int = 0) -> List[List[Tuple[int, float, List[int]]]]:
    """Transcription of the DPH fork's dispatch + update_policy layout.

    ``rows``: ``(type, tokens)`` per row in trainer order (rollouts type 1, then anchors type 2).
    Returns, per optimizer step, ``(kind, coefficient, row indices)`` per micro-batch, where the
    step's gradient is ``sum coefficient * token_mean(micro-batch loss)`` (FSDP's 1/world
    included) and ``kind`` is the type of the micro-batch's first row."""
    n = len(rows)
    per_rank = n // world  # DataProto.chunk: equal contiguous chunks (n divisible by world here)
    mini = mini_rows_total // world
    steps: Dict[int, List[Tuple[int, float, List[int]]]] = {}
    for r in range(world):
        idx = list(range(r * per_rank, (r + 1) * per_rank))
        for s, lo in enumerate(range(0, len(idx), mini)):
            mb = idx[lo:lo + mini]
            if dynamic_tokens:
                parts = balanced_partitions([rows[i][1] for i in mb],
                                              max(1, math.ceil(sum(rows[i][1] for i in mb) / dynamic_tokens)))
                micro_batches = [[mb[j] for j in p] for p in parts]
                coef = [len(p) / mini for p in micro_batches]
            else:
                micro_batches = [mb[k:k + micro] for k in range(0, len(mb), micro)]
                ga = mini // micro
                coef = [1.0 / ga] * len(micro_batches)
            for c, m in zip(coef, micro_batches):
                steps.setdefault(s, []).append((rows[m[0]][0], c / world, m))
    return [steps[s] for s in sorted(steps)]


def anchor_share(steps) -> Tuple[float, List[Tuple[float, float]]]:
    """(effective anchor weight relative to the online loss over the whole rollout step, per
    step (online coefficient mass, anchor coefficient mass)); eta factored out."""
    per = [(sum(c for k, c, _ in st if k == 1), sum(c for k, c, _ in st if k == 2)) for st in steps]
    on = sum(p[0] for p in per)
    an = sum(p[1] for p in per)
    return an / on, per


def row1_anchor_weight() -> None:
    print("## row 1: DPH anchor weight (2048 rollouts : 256 anchors, ppo_mini_batch_size 64 prompts x 16)")
    rows = [(1, 100)] * 2048 + [(2, 100)] * 256
    for world in (1, 8, 32):
        share, per = anchor_share(verl_micro_batches(rows, world, 64 * 16, micro=2))
        steps = ", ".join(f"step {i + 1}: online {o:.3f} anchor {a:.3f}" for i, (o, a) in enumerate(per))
        print(f"  world {world:2d}, micro-batch 2: effective anchor weight = eta x {share:.4f} "
              f"(1/8 = {1 / 8:.4f}); per optimizer step [{steps}]")
    ours = A.anchor_weight(0.2, "microbatch_share", num_online_seqs=2048, num_anchor_seqs=256)
    print(f"  library anchor_weighting=microbatch_share: eta 0.2 -> {ours:.4f} (token_mean: 0.2)")
    # dynamic bsz (the fork's default use_dynamic_bsz: true; every script but forward_kl.sh):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(300, 3000, (2304,), generator=g)
    resp = torch.randint(20, 800, (2304,), generator=g)
    rows = [(1 if i < 2048 else 2, int(prompt[i] + resp[i])) for i in range(2304)]
    for world in (8, 32):
        steps = verl_micro_batches(rows, world, 64 * 16, dynamic_tokens=32384)
        share, _ = anchor_share(steps)
        wrong = sum(1 for st in steps for k, _, m in st for i in m if rows[i][0] != k)
        mixed = sum(1 for st in steps for _, _, m in st if len({rows[i][0] for i in m}) > 1)
        print(f"  world {world:2d}, dynamic bsz 32384 tokens: effective anchor weight by first-row routing "
              f"= eta x {share:.4f}; {mixed} mixed micro-batches, {wrong} rows given the other kind's loss")


def row1_engine_layout() -> None:
    print("## row 1 on the engines: authors.plan_micro_batches (the OpenRLHF / Megatron layout under "
          "micro-batch-token-mean) vs the transcription above")
    g = torch.Generator().manual_seed(8)
    n_on, n_an = 2048, 256
    resp = torch.randint(20, 800, (n_on + n_an,), generator=g).double()
    for micro in (2, 4):
        rows = [(1, 100)] * n_on + [(2, 100)] * n_an
        theirs = verl_micro_batches(rows, 1, 64 * 16, micro=micro)
        w_theirs = torch.zeros(len(theirs), n_on + n_an, dtype=torch.float64)
        for s_i, st in enumerate(theirs):
            for kind, c, m in st:
                for i in m:
                    w_theirs[s_i, i] += c * (1.0 if kind == 1 else 0.2) / float(resp[m].sum())
        ours = A.plan_micro_batches([i >= n_on for i in range(n_on + n_an)], mini_batch_rows=64 * 16,
                                    micro_batch_seqs=micro, step_layout="authors")
        w_ours = torch.zeros(len(ours), n_on + n_an, dtype=torch.float64)
        for s_i, st in enumerate(ours):
            for mb in st:
                idx = list(mb.rows)
                for i in idx:
                    w_ours[s_i, i] += mb.coef * (0.2 if mb.anchor else 1.0) / float(resp[idx].sum())
        rel = float(((w_ours - w_theirs).abs() / w_theirs.abs().clamp(min=1e-300)).max())
        print(f"  world 1, micro-batches of {micro}: {len(ours)} optimizer steps (authors {len(theirs)}); "
              f"max relative per-token weight difference {rel:.1e}")
    # world > 1: each replica lays out its own rollout rows and its share of the anchors (the
    # library's round-robin anchors); the authors' ranks take contiguous chunks of [rollouts; anchors]
    for world in (8, 32):
        share, per = anchor_share(verl_micro_batches([(1, 100)] * n_on + [(2, 100)] * n_an, world, 64 * 16))
        steps = A.plan_micro_batches([i >= n_on // world for i in range((n_on + n_an) // world)],
                                     mini_batch_rows=64 * 16 // world, micro_batch_seqs=2, step_layout="authors")
        ours = [(sum(mb.coef for mb in st if not mb.anchor), sum(mb.coef for mb in st if mb.anchor)) for st in steps]
        fmt = lambda ps: ", ".join(f"{a:.3f}" for _, a in ps)  # noqa: E731
        print(f"  world {world}: anchor mass per optimizer step (eta x): authors [{fmt(per)}], library per replica "
              f"[{fmt(ours)}]; over the rollout step both eta x {share:.4f} / eta x "
              f"{sum(a for _, a in ours) / sum(o for o, _ in ours):.4f}")


def row2_token_weights() -> None:
    print("## row 2: per-micro-batch token-mean vs the step's token-mean (token weight ratio authors/ours)")
    g = torch.Generator().manual_seed(1)
    for lo, hi in ((20, 1000), (20, 4096)):
        L = torch.randint(lo, hi + 1, (1024,), generator=g).double()
        w = A.micro_batch_token_weights(L, 2) * L.sum()  # ratio to 1 / N_tokens
        print(f"  lengths U[{lo},{hi}], micro-batches of 2: ratio min {float(w.min()):.2f}x, "
              f"p1 {float(w.quantile(0.01)):.2f}x, median {float(w.median()):.2f}x, "
              f"p99 {float(w.quantile(0.99)):.2f}x, max {float(w.max()):.2f}x")


# --------------------------------------------------------------------------- row 3
def verl_k3_clamped(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    kl = (ref_logprob - logprob).clamp(-20, 20)
    return (kl.exp() - kl - 1).clamp(-10, 10)


def row3_js_def() -> None:
    print("## row 3: JS by definition (k3 clamp at 10; stochastic online half)")
    for gap in (3.0, 3.2, 3.3, 4.0, 6.0):
        lp = torch.tensor([[gap]], dtype=torch.float64)
        ref = torch.zeros_like(lp)
        m = torch.ones_like(lp)
        ours = float(dph_js_def_loss(lp, ref, m, on="anchor"))
        log_m = torch.logaddexp(lp, ref) - math.log(2)
        theirs = float(verl_k3_clamped(ref, log_m))  # anchor side: kl_penalty(logprob=old(sft), ref=log m)
        ours_o = float(dph_js_def_loss(-lp, ref, m, on="online"))
        theirs_o = float(verl_k3_clamped(-lp, torch.logaddexp(-lp, ref) - math.log(2)))
        print(f"  |lp - ref| = {gap}: anchor side ours {ours:.2f} authors {theirs:.2f}; "
              f"online side (lp below ref) ours {ours_o:.2f} authors {theirs_o:.2f}")
    # k3(x) = e^x - x - 1 with x = log((1 + u) / 2), u = e^gap: the clamp engages at k3 = 10
    lo, hi = 0.0, 10.0
    for _ in range(60):
        mid = (lo + hi) / 2
        x = math.log((1 + math.exp(mid)) / 2)
        lo, hi = (mid, hi) if math.exp(x) - x - 1 < 10 else (lo, mid)
    print(f"  clamp engages at |lp - ref| > {lo:.3f} (anchor: lp above ref; online: lp below ref)")
    g = torch.Generator().manual_seed(2)
    draws = torch.randint(1, 11, (100000,), generator=g)
    print(f"  online half: authors apply eta x 1 on a micro-batch when randint(1,10) <= js_ratio=1: "
          f"{float((draws <= 1).double().mean()):.4f} of micro-batches (expected weight eta x 0.1); "
          f"library fixed: eta x js_def_lambda = eta x 0.125 on every token")


# --------------------------------------------------------------------------- row 4
def row4_presample() -> None:
    print("## row 4: near-perfect at 4/4 (authors) vs 8/8 (library default), per-sample success p")
    for p in (0.5, 0.7, 0.9, 0.95):
        print(f"  p = {p}: P(4/4) = {p ** 4:.3f}, P(8/8) = {p ** 8:.3f} ({p ** 4 / p ** 8:.2f}x more anchor "
              f"prompts); a fresh n=1 anchor draw is kept with probability {p}")


# --------------------------------------------------------------------------- row 5
def row5_clip_cov() -> None:
    print("## row 5: Clip-Cov clip 0.2/0.2 + dual clip 3 (library preset) vs 1/1 without dual clip (authors)")
    g = torch.Generator().manual_seed(3)
    for sd in (0.2, 1.2):
        lr = torch.randn(200000, generator=g, dtype=torch.float64) * sd
        adv = torch.randn(200000, generator=g, dtype=torch.float64)
        r = lr.exp()
        ours_zero = ppo_clip_mask(r, adv, 0.2, 0.2) | ((adv < 0) & (r > 3.0))
        theirs_zero = ppo_clip_mask(r, adv, 1.0, 1.0)
        eps_part = (ppo_clip_mask(r, adv, 0.2, 0.2) != theirs_zero).double().mean()
        dual_part = ((adv < 0) & (r > 3.0)).double().mean()
        print(f"  log-ratio sd {sd}: gradient differs on {float((ours_zero != theirs_zero).double().mean()):.3%} "
              f"of tokens ({float(eps_part):.3%} from eps, {float(dual_part):.3%} from the dual clip)")


# --------------------------------------------------------------------------- row 6
def row6_lad() -> None:
    print("## row 6: LAD Hellinger with / without the 1/2; PPO-clip gate (clip-higher 0.2/0.28)")
    from openrlhf_div.algorithms.losses import lad_loss

    g = torch.Generator().manual_seed(4)
    lp = (torch.randn(4, 64, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True)
    old = torch.zeros(4, 64, dtype=torch.float64)
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    m = torch.ones(4, 64, dtype=torch.float64)
    half = torch.autograd.grad(lad_loss(lp, old, adv, m, "hellinger", 0.25).sum(), lp)[0]
    # LAD Table 5's Hellinger loss column: e^{A/eta} (sqrt(r e^{-A/eta}) - 1)^2 (no 1/2)
    z = (adv / 0.25).unsqueeze(-1)
    full = torch.autograd.grad((z.exp() * ((lp - old - z).exp().sqrt() - 1) ** 2).sum(), lp)[0]
    print(f"  gradient ratio without/with 1/2: {float((full / half).mean()):.4f}")
    for sd in (0.1, 0.3):
        lr = torch.randn(200000, generator=g, dtype=torch.float64) * sd
        a = torch.randn(200000, generator=g, dtype=torch.float64)
        print(f"  log-ratio sd {sd}: clip 0.2/0.28 zeroes {float(ppo_clip_mask(lr.exp(), a, 0.2, 0.28).double().mean()):.3%}"
              " of LAD token gradients")


# --------------------------------------------------------------------------- row 7
def row7_flowrl() -> None:
    print("## row 7: FlowRL log Z head size (hidden 3584 = Qwen2.5-7B)")
    from openrlhf_div.algorithms.heads import LogZHead

    H = 3584
    ours = sum(p.numel() for p in LogZHead(H).parameters())
    theirs = sum(p.numel() for p in A.AuthorsLogZHead(H).parameters())
    print(f"  parameters: library small head {ours:,}; authors' ProjZModule(num_layers=3) {theirs:,}")
    g = torch.Generator().manual_seed(5)
    log_w = torch.randn(100000, generator=g, dtype=torch.float64) * 1.0
    print(f"  importance weight exp(sum_t (lp - old)), log-weight sd 1: share above the library's cap 10: "
          f"{float((log_w.exp() > 10).double().mean()):.3%} (the authors' code computes a clipped weight but "
          "multiplies by the unclipped one)")


# --------------------------------------------------------------------------- row 8
def row8_ds() -> None:
    print("## row 8: DS granularity (token vs seq_sum), gamma 0.01, mean |A' - A| per token")
    g = torch.Generator().manual_seed(6)
    for L in (38, 1000):
        old = -torch.distributions.Exponential(torch.tensor(1.5, dtype=torch.float64)).sample((64, L))
        m = torch.ones(64, L, dtype=torch.float64)
        adv = torch.zeros(64, dtype=torch.float64)
        corr = torch.rand(64, generator=g) > 0.5
        tok = ds_reshape_advantages(adv, corr, old, m, 0.01, 0.01, "token").abs().mean()
        seq = ds_reshape_advantages(adv, corr, old, m, 0.01, 0.01, "seq_sum").abs().mean()
        print(f"  {L}-token responses: seq_sum shifts the advantage {float(seq / tok):.0f}x more than token")


# --------------------------------------------------------------------------- row 9
def row9_small() -> None:
    print("## row 9: small differences")
    g = torch.Generator().manual_seed(7)
    L = torch.randint(50, 2049, (512,), generator=g).double()
    print(f"  Dr.GRPO: verl seq-mean-token-sum-norm divides the token sum by L_max x sequences; the library's "
          f"token-mean by the token count: per-step scale library/verl = {float(2048 * 512 / L.sum()):.2f} "
          "(L_max 2048, lengths U[50,2048])")
    for n_tok in (100, 499, 501, 5000):
        print(f"  KL-Cov ratio 2e-3 on {n_tok} tokens: library penalises {int(math.floor(2e-3 * n_tok))}, "
              f"verl max(1, int(.)) = {max(1, int(2e-3 * n_tok))}")
    r = torch.tensor([1.0])
    print(f"  GRPO group of one, reward 1: library {float(group_advantages(r, 1, 'grpo')[0]):.3f}, "
          f"verl (a group of one gets mean 0, std 1) {float((r[0] - 0.0) / (1.0 + 1e-6)):.3f}")


def row10_authors_world_size() -> None:
    print("## rows 10-10b: authors_world_size (authors.plan_micro_batches at the authors' GPU count; "
          "tests/test_authors_replay.py checks it against a transcription at every world size)")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(300, 3000, (2304,), generator=g)
    resp = torch.randint(20, 800, (2304,), generator=g)
    tokens = [int(prompt[i] + resp[i]) for i in range(2304)]
    flags = [i >= 2048 for i in range(2304)]
    ours_local = A.plan_micro_batches(flags, tokens, mini_batch_rows=1024, micro_batch_seqs=2, step_layout="authors")
    step_of = {i: s for s, st in enumerate(ours_local) for mb in st for i in mb.rows}
    for world in (1, 2, 4, 8, 16, 32):
        row = []
        for budget in (None, 32384):
            steps = A.plan_micro_batches(flags, tokens, mini_batch_rows=1024 // world, micro_batch_seqs=2,
                                         micro_batch_tokens=budget, step_layout="authors", authors_world_size=world,
                                         mixed_micro_batches="first_row")
            anc = ", ".join(f"{sum(m.coef for m in st if m.anchor):.3f}" for st in steps)
            routed = "/".join(str(sum(len(m.ppo_anchors) for m in st)) for st in steps)
            moved = sum(1 for s, st in enumerate(steps) for mb in st for i in mb.rows if step_of[i] != s)
            row.append(f"{'tokens' if budget else 'micro 2'}: anchor mass per step eta x [{anc}], anchors at the "
                       f"PPO loss per step {routed}, rows in another step than the one-GPU form {moved}/2304")
        print(f"  world {world:2d}: " + "; ".join(row))


def row11_adam() -> None:
    print("## row 11: AdamW betas (0.9, 0.999) + weight decay 0.01 (the fork) vs (0.9, 0.95) + 0 (OpenRLHF)")
    for decay in (1.0, 0.99):
        moved = []
        for betas, wd in (((0.9, 0.95), 0.0), ((0.9, 0.999), 0.01)):
            w = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
            opt = torch.optim.AdamW([w], lr=1e-6, betas=betas, weight_decay=wd)
            for t in range(200):  # gradients of a fixed sign, shrinking by `decay` per step
                w.grad = torch.full_like(w, -(decay ** t))
                opt.step()
            moved.append(float(w.detach()))
        print(f"  200 steps, gradient x{decay}/step: (0.9, 0.999)+0.01 moves {moved[1] / moved[0]:.2f}x as far as "
              "(0.9, 0.95)+0")


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    torch.set_num_threads(1)
    for f in (row1_anchor_weight, row1_engine_layout, row2_token_weights, row3_js_def, row4_presample, row5_clip_cov, row6_lad,
              row7_flowrl, row8_ds, row9_small, row10_authors_world_size, row11_adam):
        f()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
