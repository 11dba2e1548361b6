"""Replay one rollout step through the OpenRLHF and Megatron engines' loss paths under the DPH-RL
authors' aggregation (aggregation ``micro-batch-token-mean``, ``anchor_weighting:
microbatch_share``, ``engine.step_layout: authors``) and compare every token's gradient weight, per
optimiser step, with an independent transcription of the authors' update loop (issue 23, item 1;
docs/ALGORITHMS.md section 9 rows 1, 1b, 2). Pure torch: no Ray, vLLM, DeepSpeed or Megatron start.

The transcription (written here from seamoke/DPH-RL, not from the library):

* ``RayPPOTrainer.fit``: the anchor rows (type 2) are appended after the rollout rows (type 1);
  world size 1, so the rank's chunk is the whole batch.
* ``DataParallelPPOActor.update_policy``: ``batch.split(ppo_mini_batch_size)`` -- consecutive
  mini-batches of ``M`` rows, one optimiser step each; micro-batches ``mini_batch.split(k)`` with
  ``loss / gradient_accumulation`` where ``gradient_accumulation = M // k``; or, with
  ``use_dynamic_bsz``, ``rearrange_micro_batches``: ``min(rows, ceil(sum(attention_mask) /
  max_token_len))`` Karmarkar-Karp partitions (``get_seqlen_balanced_partitions``,
  ``equal_size=False``: written again below, list-based) with ``loss * len(micro) / M``;
  a micro-batch is an anchor one when its first row's type is 2, whose loss is ``sft_loss_coeff
  x agg_loss(token-mean)``; a rollout one ``agg_loss(token-mean)`` of the policy loss.

A token's gradient weight is ``d(applied loss) / d(its per-token loss)``: the engines' gradient
with respect to the log-probs divided by the per-token loss's own derivative. Both engines must
give the transcription's weights to 1e-6 (relative) at micro-batch sizes 2 and 4 and with
token-budget packing. Cost: < 2 s.
"""
from __future__ import annotations

import math

import pytest
import torch

from openrlhf_div.algorithms import AnchorInputs, LossInputs, get_method
from openrlhf_div.engines.layout import EngineLayout

torch.set_num_threads(1)

P = 3          # prompt tokens per row
T = 12         # response positions
N_ON, N_AN = 16, 4
M = 8          # ppo_mini_batch_size on the rank (rows per optimiser step)
ETA = 0.3


# ------------------------------------------------------------------ the authors' loop, transcribed
def _kk_partitions(lengths, k):
    """verl's Karmarkar-Karp (equal_size=False), as a list of partial solutions re-sorted each
    round: a solution is k groups [sum, items(list of (idx, len))], groups sorted largest first
    (by sum, then size, then items); the two solutions with the largest spread (ties: larger top
    group) are merged, group i of the first with group k-1-i of the second."""
    def gkey(g):
        return (g[0], len(g[1]), g[1])

    def norm(groups):
        return sorted(groups, key=gkey, reverse=True)

    def skey(sol):
        return (sol[0][0] - sol[-1][0], gkey(sol[0]))

    sols = []
    for ln, i in sorted((ln, i) for i, ln in enumerate(lengths)):
        sols.append(norm([[ln, [(i, ln)]]] + [[0, []] for _ in range(k - 1)]))
    while len(sols) > 1:
        sols.sort(key=skey, reverse=True)
        a, b = sols.pop(0), sols.pop(0)
        sols.append(norm([[x[0] + y[0], x[1] + y[1]] for x, y in zip(a, b[::-1])]))
    return [sorted(i for i, _ in g[1]) for g in sols[0]]


def authors_weights(types, attn_len, resp_len, micro, max_token_len=None):
    """Per optimiser step, each row's per-token gradient weight ``[S, N]``."""
    n = len(types)
    steps = []
    for lo in range(0, n, M):  # batch.split(ppo_mini_batch_size)
        mini = list(range(lo, min(lo + M, n)))
        if max_token_len is None:
            ga = M // micro
            micro_batches = [(mini[j:j + micro], 1.0 / ga) for j in range(0, len(mini), micro)]
        else:
            total = sum(attn_len[i] for i in mini)
            k = min(len(mini), -(-total // max_token_len))
            parts = _kk_partitions([attn_len[i] for i in mini], k)
            micro_batches = [([mini[j] for j in p], len(p) / M) for p in parts]
        w = torch.zeros(n, dtype=torch.float64)
        for rows, factor in micro_batches:
            coeff = ETA if types[rows[0]] == 2 else 1.0
            tokens = sum(resp_len[i] for i in rows)  # agg_loss token-mean over the micro-batch
            for i in rows:
                w[i] += factor * coeff / tokens
        steps.append(w)
    return torch.stack(steps)


# ------------------------------------------------------------------ one rollout step's data
def _data(seed):
    g = torch.Generator().manual_seed(seed)
    n = N_ON + N_AN
    resp_len = torch.randint(2, T + 1, (n,), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < resp_len.unsqueeze(1)).double()
    old = -torch.rand(n, T, generator=g, dtype=torch.float64) * 3
    lp = old + 0.05 * torch.randn(n, T, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64).unsqueeze(1).expand(n, T) * mask
    ref = old - 0.3 * torch.rand(n, T, generator=g, dtype=torch.float64)
    is_anchor = torch.arange(n) >= N_ON
    f32 = lambda t: t.float().double()  # noqa: E731 (the Megatron rows hold float32 per-token fields)
    return dict(resp_len=resp_len, mask=mask, old=f32(old), lp=f32(lp), adv=f32(adv.contiguous()), ref=f32(ref),
                is_anchor=is_anchor)


def _method(micro, budget):
    """The method (dph_f as the authors run it) and the engine layout (``engine:``) of a case."""
    return (get_method("dph_f", anchor_eta=ETA, anchor_weighting="microbatch_share",
                       aggregation="micro-batch-token-mean", micro_batch_seqs=micro),
            EngineLayout(step_layout="authors", micro_batch_tokens=budget))


def _token_derivative(method, d):
    """d(per-token loss)/d(log-prob), each row's own loss (elementwise in the log-probs)."""
    lp = d["lp"].clone().requires_grad_(True)
    on, an = ~d["is_anchor"], d["is_anchor"]
    l_on, _ = method.online_loss(LossInputs(log_probs=lp[on], old_log_probs=d["old"][on], advantages=d["adv"][on],
                                            mask=d["mask"][on]))
    l_an = method.anchor_loss(AnchorInputs(log_probs=lp[an], ref_log_probs=d["ref"][an], mask=d["mask"][an]))
    (l_on * d["mask"][on]).sum().backward(retain_graph=True)
    (l_an * d["mask"][an]).sum().backward()
    return lp.grad


def _compare(engine_grads, method, d, expected):
    g_tok = _token_derivative(method, d)
    sel = (d["mask"] > 0) & (g_tok.abs() > 1e-6)
    assert len(engine_grads) == expected.shape[0]
    for s, grad in enumerate(engine_grads):
        w = grad[sel] / g_tok[sel]
        want = expected[s].unsqueeze(1).expand_as(grad)[sel]
        nz = want != 0
        assert torch.equal(w.abs() > 1e-12, nz), f"step {s}: rows trained in the wrong step"
        rel = ((w[nz] - want[nz]).abs() / want[nz].abs()).max()
        assert float(rel) <= 1e-6, f"step {s}: max relative weight difference {float(rel):.3g}"


CASES = [(2, None), (4, None), (2, 4 * (P + T))]
IDS = ["micro2", "micro4", "token_budget"]


def _attn_len(d):
    return [P + int(x) for x in d["resp_len"]]


# ------------------------------------------------------------------ OpenRLHF loss path
def _experience_rows(d):
    from openrlhf.trainer.ppo_utils.experience import Experience

    from openrlhf_div.engines.contract import ANCHOR_FLAG, CORRECT_FLAG

    items = []
    for i in range(N_ON + N_AN):
        L = P + int(d["resp_len"][i])
        seq = torch.zeros(P + T, dtype=torch.long)
        seq[:L] = torch.arange(1, L + 1)
        attn = torch.zeros(P + T, dtype=torch.long)
        attn[:L] = 1
        anchor = bool(d["is_anchor"][i])
        items.append(Experience(
            sequences=seq, attention_mask=attn, action_mask=d["mask"][i].bool(),
            action_log_probs=d["old"][i], base_action_log_probs=d["ref"][i] if anchor else torch.zeros(T, dtype=torch.float64),
            advantages=d["adv"][i], returns=d["adv"][i], rewards=torch.tensor(0.0), scores=torch.tensor(0.0),
            response_length=torch.tensor(float(d["resp_len"][i])), total_length=torch.tensor(float(L)),
            info={ANCHOR_FLAG: torch.tensor(float(anchor)), CORRECT_FLAG: torch.tensor(1.0),
                  "row_id": torch.tensor(float(i))}))
    return items


def _openrlhf_step_grads(method, layout, d, gas):
    from openrlhf.trainer.ppo_utils.experience import make_experience_batch

    from openrlhf_div.engines.contract import anchor_rows
    from openrlhf_div.engines.openrlhf.loss import AUTHORS_KEY, authors_micro_batches, div_actor_loss

    items = _experience_rows(d)
    lp = d["lp"].clone().requires_grad_(True)
    grads, acc = [], None
    it = authors_micro_batches(items, method, layout, mini_batch_rows=M, gas=gas, collate=make_experience_batch,
                               anchor_fn=lambda e: float(e.info["div_anchor"]) > 0.5,
                               tokens_fn=lambda e: int(e.attention_mask.sum()))
    for exp, info in it:
        rows = torch.as_tensor([float(x) for x in exp.info["row_id"]]).long()
        B = rows.numel()
        loss, _ = div_actor_loss(method, log_probs=lp[rows], action_mask=exp.action_mask,
                                 is_anchor=anchor_rows(exp.info, B), old_log_probs=exp.action_log_probs,
                                 advantages=exp.advantages, ref_log_probs=exp.base_action_log_probs,
                                 loss_batch_info=info)
        (g,) = torch.autograd.grad(loss / gas, lp)  # DeepSpeed's backward scales by 1 / gas
        acc = g if acc is None else acc + g
        if info[AUTHORS_KEY]["boundary"]:  # DeepSpeed's optimizer step: the step's gradient
            grads.append(acc)
            acc = None
    assert acc is None
    return grads


@pytest.mark.parametrize("micro,budget", CASES, ids=IDS)
def test_openrlhf_loss_path_gives_the_authors_token_weights(micro, budget):
    d = _data(seed=micro + (budget or 0))
    method, layout = _method(micro, budget)
    types = [2 if a else 1 for a in d["is_anchor"].tolist()]
    expected = authors_weights(types, _attn_len(d), d["resp_len"].tolist(), micro, budget)
    assert expected.shape[0] == 3  # 16 rollouts in 2 mini-batches of 8, the 4 anchors in a third
    _compare(_openrlhf_step_grads(method, layout, d, gas=M // micro), method, d, expected)


# ------------------------------------------------------------------ Megatron loss path
def _megatron_step_grads(method, layout, d):
    from openrlhf_div.engines.megatron.actor import authors_steps
    from openrlhf_div.engines.megatron.loss import loss_scale, registry_loss, step_counts

    # rows as contract.rows_from_experience makes them: per-token fields over all L - 1 targets;
    # the first token id carries the row id (to map micro-batch rows back)
    L = P + T
    rows = []
    for i in range(N_ON + N_AN):
        Li = P + int(d["resp_len"][i])
        seq = torch.zeros(L, dtype=torch.long)
        seq[:Li] = torch.arange(1, Li + 1)
        seq[0] = 1000 + i
        attn = torch.zeros(L, dtype=torch.long)
        attn[:Li] = 1

        def full(t):
            out = torch.zeros(L - 1, dtype=torch.float64)
            out[P - 1:] = t
            return out
        anchor = bool(d["is_anchor"][i])
        r = dict(sequences=seq, attention_mask=attn, action_mask=full(d["mask"][i]), old_log_probs=full(d["old"][i]),
                 advantages=full(d["adv"][i]), is_anchor=torch.tensor(anchor))
        r["anchor_ref_log_probs" if anchor else "ref_log_probs"] = full(d["ref"][i])
        rows.append(r)
    lp = d["lp"].clone().requires_grad_(True)
    grads = []
    for batches in authors_steps(rows, method, M, layout=layout):
        counts = step_counts(batches)
        scale = loss_scale(batches, dp_size=1)
        acc = None
        for mb in batches:
            ids = mb.sequences[:, 0] - 1000
            lp_mb = torch.zeros(ids.numel(), L - 1, dtype=torch.float64)
            lp_mb = lp_mb.index_put((torch.arange(ids.numel()).unsqueeze(1), torch.arange(P - 1, L - 1)),
                                    lp[ids])
            loss, _, _ = registry_loss(method, lp_mb, None, mb, counts)
            (g,) = torch.autograd.grad(loss * scale / len(batches), lp)  # Megatron: 1 / num_microbatches
            acc = g if acc is None else acc + g
        grads.append(acc)
    return grads


@pytest.mark.parametrize("micro,budget", CASES, ids=IDS)
def test_megatron_loss_path_gives_the_authors_token_weights(micro, budget):
    d = _data(seed=100 + micro + (budget or 0))
    method, layout = _method(micro, budget)
    types = [2 if a else 1 for a in d["is_anchor"].tolist()]
    expected = authors_weights(types, _attn_len(d), d["resp_len"].tolist(), micro, budget)
    _compare(_megatron_step_grads(method, layout, d), method, d, expected)


def test_spread_layout_has_the_authors_total_but_two_steps():
    """``step_layout: spread``: the same weight per token over the rollout step (at world 1), in
    two optimiser steps instead of the authors' three."""
    d = _data(seed=7)
    method, _ = _method(2, None)
    grads = _openrlhf_step_grads(method, EngineLayout(step_layout="spread"), d, gas=M // 2)
    assert len(grads) == 2
    types = [2 if a else 1 for a in d["is_anchor"].tolist()]
    expected = authors_weights(types, _attn_len(d), d["resp_len"].tolist(), 2)
    _compare([sum(grads)], method, d, expected.sum(0, keepdim=True))


def test_transcribed_partitioner_agrees_with_the_library_one():
    from openrlhf_div.algorithms.authors import balanced_partitions

    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        n = int(torch.randint(1, 30, (1,), generator=g))
        k = int(torch.randint(1, n + 1, (1,), generator=g))
        lens = torch.randint(1, 40, (n,), generator=g).tolist()
        assert balanced_partitions(lens, k) == _kk_partitions(lens, k)


def test_layout_errors_name_the_fix():
    from openrlhf_div.algorithms.authors import plan_micro_batches

    with pytest.raises(ValueError, match="micro_batch_tokens"):
        plan_micro_batches([False, False], [50, 10], mini_batch_rows=2, micro_batch_tokens=20)
    with pytest.raises(ValueError, match="unknown step_layout"):
        plan_micro_batches([False], mini_batch_rows=2, step_layout="three")
    m = get_method("dph_f", aggregation="micro-batch-token-mean")  # anchor_weighting token_mean
    an = AnchorInputs(log_probs=torch.zeros(1, 2), ref_log_probs=torch.zeros(1, 2), mask=torch.ones(1, 2))
    with pytest.raises(ValueError, match="microbatch_share"):
        m.loss(anchor=an, micro_batch_coef=0.5)
    assert math.isfinite(float(get_method("dph_f", anchor_weighting="microbatch_share").loss(
        anchor=an, micro_batch_coef=0.5)[0]))


def test_micro_batch_token_mean_has_no_clamp_on_the_step_count():
    """OpenRLHF hands micro_batch_token_mean the step's sequence count / gas (e.g. 4/9 = 0.444):
    the weight k / 0.444 is used as is (a max(n, 1) clamp made it k / 1)."""
    from openrlhf_div.algorithms.authors import micro_batch_token_mean

    loss = torch.tensor([[1.0, 3.0], [2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    got = micro_batch_token_mean(loss, mask, micro_batch_seqs=2, num_seqs=4 / 9)
    assert float(got) == pytest.approx((6.0 / 3.0) * 2 / (4 / 9), rel=1e-15)
    assert float(micro_batch_token_mean(loss, mask, 2, num_seqs=0.0)) == 0.0


def test_fresh_anchor_draws_use_anchor_top_p(monkeypatch):
    """presample_ray's fresh anchor draws (resample_anchor_responses) sample at
    --presample.anchor_top_p (the authors' generate_sft: the rollout's 0.9), the pre-sampling
    responses at --rollout.top_p (offline_sampling.sh: 0.95)."""
    import types

    from openrlhf_div.engines.anchor_data import Sample
    from openrlhf_div.engines.openrlhf import presample as P

    calls = []

    def fake_sample_chunk(engines, prompts, labels, tokenizer, args, n, top_p=None):
        calls.append((n, top_p))
        return [[None] for _ in prompts]

    monkeypatch.setattr(P, "_sample_chunk", fake_sample_chunk)
    monkeypatch.setattr(P, "_to_samples", lambda d, tok: ([1], [Sample([2], "y", 1.0)]))
    parsed = [([1], [Sample([2], "y", 1.0)] * 2), ([1], [Sample([2], "n", 0.0)] * 2)]
    out = P._fresh_anchor_samples(None, ["a", "b"], ["l", "l"], None, types.SimpleNamespace(),
                                  parsed, {"tau": 2, "correct_threshold": 1.0, "anchor_top_p": 0.9})
    assert calls == [(1, 0.9)] and out[1] is None and out[0] is not None
    args = types.SimpleNamespace(
        presample=types.SimpleNamespace(n_pre=4, tau=4, drop_unsolved=False, chunk_size=8, correct_threshold=1.0,
                                        resample_anchor_responses=True, anchor_top_p=0.9),
        train=types.SimpleNamespace(seed=0), rollout=types.SimpleNamespace(temperature=1.0, top_p=0.95,
                                                                           max_new_tokens=8),
        data=types.SimpleNamespace(max_len=16, prompt_dataset="d", input_key="p", label_key="l",
                                   apply_chat_template=False, input_template=None),
        actor=types.SimpleNamespace(model_name_or_path="m"), reward=types.SimpleNamespace(remote_url=None))
    s = P.settings_from_args(args)
    assert s["top_p"] == 0.95 and s["anchor_top_p"] == 0.9


def test_engines_refuse_what_the_layout_cannot_do():
    import argparse
    import types

    from openrlhf_div.engines.local.config import ConfigError, config_from_dict
    from openrlhf_div.engines.flags import add_div_arguments, check_supported, method_from_args

    p = argparse.ArgumentParser()
    add_div_arguments(p)
    m = method_from_args(p.parse_args(["--div.method", "dph_f", "--div.aggregation", "micro-batch-token-mean"]))
    args = types.SimpleNamespace(div=types.SimpleNamespace(anchor_data="x"),
                                 train=types.SimpleNamespace(dynamic_batch_enable=False, async_enable=False))
    with pytest.raises(ValueError, match="anchor_weighting microbatch_share"):
        check_supported(m, args)
    args.train.dynamic_batch_enable = True
    with pytest.raises(NotImplementedError, match="micro_batch_tokens"):
        check_supported(m.with_overrides(anchor_weighting="microbatch_share"), args)
    with pytest.raises(ConfigError, match="step_layout is engine layout.*engine.step_layout"):
        config_from_dict({"task": "demo", "method": {"name": "grpo", "step_layout": "authors"}}).build_method()
    with pytest.raises(ConfigError, match="engine.step_layout=authors: the local engine cannot honour"):
        config_from_dict({"task": "demo", "method": {"name": "grpo"}, "engine": {"step_layout": "authors"}})
