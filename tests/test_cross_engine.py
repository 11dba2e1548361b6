"""Cross-engine: the local engine and the OpenRLHF experience maker, on one fixed fake rollout.

The scale-out issue's criterion: "the experience maker's outputs for a fixed fake rollout match
the local engine's for the same method". One rollout (7 prompts x G = 4 responses, ragged
lengths 1..8, fixed rewards with all-equal groups and a partial-credit reward, fixed old
log-probs with junk at every padding position) goes through

* the local engine: :meth:`~openrlhf_div.algorithms.registry.Method.rollout` per generation
  round, rows of the kept groups (the pure part of ``Trainer.make_experience``) and, further down, ``Trainer.make_experience`` itself with the
  sampler and the verifier replaced by the fixed rollout, then ``Trainer.micro_step``;
* the OpenRLHF engine: OpenRLHF's own per-sample construction from vLLM responses
  (``SamplesGenerator._process_response_into_experience``) and micro-batch split
  (``split_rollout_samples``, seq-len balanced so rows are reordered), then
  ``DivExperienceMaker.compute_advantages_and_returns`` (+ ``attach_anchors``), OpenRLHF's
  replay-buffer collation, and ``DivActorPPOTrainer.training_step`` with OpenRLHF's ``Actor``
  wrapping the *same* tiny Hugging Face model (DeepSpeed replaced by no-op stubs).

Both engines call ``Method.rollout``, so comparing them with each other alone would compare
the registry with itself: their rollout sides are each checked against :func:`_spec`, the
estimators, shaping and reshaping of ALGORITHMS.md sections 1 and 3 written out with Python
scalars one group at a time (no library code). For every method whose rollout-side processing
differs we assert that the two engines give the spec's shaped rewards, kept groups, correctness
flags and per-token advantages (and, at the
loss, the same old log-probs, advantages, current log-probs, entropy and reference log-probs
per response token), that both request the same things (reference model, entropy, anchors)
as ``Method.needs`` says, and that DPH anchors reach the anchor loss with their stored base
log-probs bit for bit. A few values are also written out by hand from ALGORITHMS.md.
"""
from __future__ import annotations

import argparse
import json
import math
import types

import pytest
import torch

from openrlhf_div.algorithms import get_method
from openrlhf_div.compat import install_flash_attn_standin, install_vllm_stub
from openrlhf_div.engines.local import trainer as local_trainer
from openrlhf_div.engines.local.config import load_config
from openrlhf_div.io import atomic_write_jsonl
from openrlhf_div.engines.local.generation import GenerationOutput, pack_sequences
from openrlhf_div.engines.local.trainer import Trainer
from openrlhf_div.tasks import RewardResult, Task

install_flash_attn_standin()
install_vllm_stub()

from openrlhf.trainer.ppo_utils.experience import (  # noqa: E402
    make_experience_batch,
    remove_padding_in_sequences,
    split_experience_batch,
)

from openrlhf_div.engines.openrlhf.advantages import rollout_advantages  # noqa: E402
from openrlhf_div.engines.flags import add_div_arguments, derive_upstream_flags, method_from_args  # noqa: E402
from openrlhf_div.engines.anchor_data import AnchorSampler, AnchorRecord, read_pef  # noqa: E402

torch.set_num_threads(1)
NS = types.SimpleNamespace
VOCAB = "abcdefgh="  # ids: <pad> 0, <bos> 1, <eos> 2, <unk> 3, a..h 4..11, '=' 12

# ------------------------------------------------------------------ the fixed fake rollout
G = 4
PROMPTS = [[4, 5, 12], [6, 7, 8, 12], [9, 12], [10, 4, 6, 5, 12], [7, 12], [8, 9, 10, 12], [11, 4, 12]]
LENGTHS = [[3, 1, 5, 2],   # g0 mixed; one response in DAPO's overlong zone
           [2, 3, 5, 7],   # g1 all correct, but overlong shaping makes the group informative
           [2, 3, 1, 3],   # g2 all wrong (dropped by dynamic sampling)
           [3, 6, 2, 4],   # g3 partial credit 0.1 (reward, not correct)
           [1, 2, 3, 2],   # g4 all-equal non-binary rewards (dropped)
           [2, 3, 1, 3],   # g5 all correct, short (dropped)
           [7, 2, 8, 3]]   # g6 mixed, but overlong shaping makes it all-equal (dropped)
REWARDS = [[1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0.1, 0, 1], [0.5] * 4, [1, 1, 1, 1], [1, 0, 1, 0]]
B = len(PROMPTS)
N = B * G
T = max(max(x) for x in LENGTHS)
JUNK = 5.0  # written at every padding position of the old log-probs: no engine may read it
DAPO = {"overlong_max_len": 6, "overlong_cache_len": 3}  # soft zone (3, 6], -1 beyond 6


def _rollout():
    g = torch.Generator().manual_seed(20251122)
    lens = torch.tensor([x for row in LENGTHS for x in row])
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    old = -(0.05 + 2.95 * torch.rand(N, T, generator=g))
    old = torch.where(mask.bool(), old, torch.full_like(old, JUNK))
    resp = [torch.randint(4, 12, (int(n),), generator=g).tolist() for n in lens]
    rewards = torch.tensor([x for row in REWARDS for x in row], dtype=torch.float32)
    return NS(rewards=rewards, old=old, mask=mask, lengths=lens, response_ids=resp,
              prompt_ids=[PROMPTS[i // G] for i in range(N)])


ROLL = _rollout()

# name, method overrides, what the method must ask of an engine (ref, entropy, anchors)
CASES = [
    ("grpo", {}, (False, False, False)),
    ("dr_grpo", {}, (False, False, False)),
    ("rloo", {}, (False, False, False)),
    ("dapo", DAPO, (False, False, False)),
    ("ds_grpo", {"gamma_p": 0.3, "gamma_n": 0.2}, (False, False, False)),  # token granularity
    ("ds_grpo", {"gamma_p": 0.3, "gamma_n": 0.2, "ds_granularity": "seq_mean"}, (False, False, False)),
    ("ds_grpo", {"gamma_p": 0.3, "gamma_n": 0.2, "ds_granularity": "seq_sum"}, (False, False, False)),
    ("ds_positive", {"gamma_p": 0.3}, (False, False, False)),
    ("ds_negative", {"gamma_n": 0.2}, (False, False, False)),
    ("unlikeliness", {}, (False, False, False)),
    ("passk", {}, (False, False, False)),
    ("pkpo", {"passk_k": 2}, (False, False, False)),
    ("entadv", {}, (False, True, False)),
    ("rkl", {}, (True, False, False)),
    ("dph_f", {}, (False, False, True)),
    ("dph_js_def", {}, (True, False, True)),
]
IDS = [n + ("" if not o else "[" + ",".join(f"{k}={v}" for k, v in o.items()) + "]") for n, o, _ in CASES]


def _local_method(name, overrides):
    return get_method(name, **overrides)


def _openrlhf_method(name, overrides):
    """The method as the OpenRLHF driver builds it: from ``--div.*`` flags."""
    p = argparse.ArgumentParser()
    add_div_arguments(p)
    argv = ["--div.method", name]
    for k, v in overrides.items():
        argv += [f"--div.{k}", str(v)]
    return method_from_args(p.parse_args(argv))


# ------------------------------------------------------------------ the two experience paths
def _local_pure(method, r=ROLL):
    """The local engine's rollout side (one generation round, no refill): shaped rewards and
    kept groups on the whole round, then correctness and advantages of the kept rows."""
    ro = method.rollout(r.rewards, G, old_log_probs=r.old, mask=r.mask, lengths=r.lengths)
    rows = torch.nonzero(ro.keep.repeat_interleave(G)).flatten()
    return NS(shaped=ro.rewards, keep=ro.keep, rows=rows, correct=ro.correct[rows], adv=ro.advantages[rows])


def _spec(name, overrides, r=ROLL):
    """The rollout side written from docs/ALGORITHMS.md sections 1 and 3 with plain Python
    scalars, one group at a time (no library code): the independent expectation both engines
    are checked against. Returns shaped rewards [N], kept groups [B], correct [N] and per-token
    advantages [N, T] (zero outside the mask and on dropped groups)."""
    from math import comb
    from statistics import mean, stdev

    m = get_method(name, **overrides)
    h = m.hparams
    R = [float(x) for x in r.rewards]
    L = [int(x) for x in r.lengths]
    old = [[float(r.old[i, t]) for t in range(L[i])] for i in range(N)]
    correct = [x >= 1.0 for x in R]
    shaped = list(R)
    if h.get("overlong_max_len") is not None:  # DAPO's overlong shaping
        lmax, lc = h["overlong_max_len"], h["overlong_cache_len"]
        for i in range(N):
            if L[i] > lmax:
                shaped[i] += -1.0
            elif L[i] > lmax - lc:
                shaped[i] += ((lmax - lc) - L[i]) / lc
    if "unlikeliness" in m.reward_shaping:  # rank by length-normalised old log-prob, ascending
        for b in range(B):
            idx = list(range(b * G, (b + 1) * G))
            order = sorted(idx, key=lambda i: mean(old[i]))
            for rank, i in enumerate(order):
                shaped[i] = R[i] * (1 - h["unlikeliness_beta"] * rank / G)
    keep = [True] * B
    if m.dynamic_sampling:  # keep groups of mixed correctness (task rewards)
        keep = [0 < sum(correct[b * G:(b + 1) * G]) < G for b in range(B)]
    seq = [0.0] * N
    for b in range(B):
        idx = list(range(b * G, (b + 1) * G))
        s = [shaped[i] for i in idx]
        c = sum(correct[i] for i in idx)
        if m.estimator == "grpo":
            a = [(x - mean(s)) / (stdev(s) + 1e-6) for x in s]
        elif m.estimator == "dr_grpo":
            a = [x - mean(s) for x in s]
        elif m.estimator == "rloo":
            a = [x - (sum(s) - x) / (G - 1) for x in s]
        elif m.estimator == "passk":
            k = h["passk_k"]
            rho = 1 - comb(G - c, k) / comb(G, k)
            sig = (rho * (1 - rho)) ** 0.5
            a = [((1 - rho) if correct[i] else (1 - rho - comb(G - c - 1, k - 1) / comb(G - 1, k - 1))) / (sig + 1e-6)
                 for i in idx]
        elif m.estimator == "pkpo":
            k = h["passk_k"]
            sc = [k / G if correct[i] else (k / G) * (1 - comb(G - c - 1, k - 1) / comb(G - 1, k - 1)) for i in idx]
            a = [x - (sum(sc) - x) / (G - 1) for x in sc]
        else:
            raise AssertionError(f"no spec reference for estimator {m.estimator!r}")
        for i, v in zip(idx, a):
            seq[i] = v
    adv = torch.zeros(N, T, dtype=torch.float64)
    for i in range(N):
        if not keep[i // G]:
            continue
        for t in range(L[i]):
            v = seq[i]
            if "ds" in m.adv_reshaping:  # Differential Smoothing on pi_old's log-probability
                g = h["ds_granularity"]
                lo = old[i][t] if g == "token" else (mean(old[i]) if g == "seq_mean" else sum(old[i]))
                v = v - h["gamma_p"] * lo if correct[i] else v + h["gamma_n"] * lo
            adv[i, t] = v
    return NS(shaped=torch.tensor(shaped, dtype=torch.float64), keep=torch.tensor(keep), adv=adv,
              correct=torch.tensor(correct))


class _Tok:  # what DivExperienceMaker reads of a tokenizer
    pad_token_id = 0

    def __len__(self):
        return 64


def _maker(method, pool=None, micro=5, dynamic=False, anchor_batch_size=None, tokenizer=None, anchor_ratio=8.0):
    from openrlhf_div.engines.openrlhf.experience_maker import DivExperienceMaker

    args = NS(rollout=NS(n_samples_per_prompt=G, micro_batch_size=micro, max_tokens_per_gpu=24),
              train=NS(seed=0, dynamic_batch_enable=dynamic),
              actor=NS(num_nodes=1, num_gpus_per_node=1), ds=NS(ring_attn_size=1, tensor_parallel_size=1),
              data=NS(max_len=64), algo=NS(advantage=NS(estimator="group_norm")),
              div=NS(method=method.name, anchor_batch_size=anchor_batch_size, anchor_ratio=anchor_ratio, anchor_seed=0,
                     anchor_data=None))
    return DivExperienceMaker(None, None, None, None, None, NS(args=args), tokenizer or _Tok(), method=method,
                              anchor_pool=pool)


def _openrlhf_rollout(maker, r=ROLL):
    """OpenRLHF's rollout samples for the fixed rollout, built by OpenRLHF's own code from
    vLLM-style responses, split into micro-batches by the maker, with the policy forward's
    ``action_log_probs`` (= the fixed old log-probs; junk outside the action span)."""
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    samples = []
    for i in range(N):
        p, y = r.prompt_ids[i], r.response_ids[i]
        resp = {"prompt": f"prompt {i // G}", "label": "x", "images": None, "mm_train_inputs": None,
                "observation_tokens": p + y, "action_ranges": [(len(p), len(p) + len(y))],
                "rollout_log_probs": None, "truncated": False, "reward": float(r.rewards[i]),
                "scores": float(r.rewards[i] >= 1.0), "extra_logs": {}}
        samples.append(SamplesGenerator._process_response_into_experience(None, resp, max_len=64))
    exps = maker.split_rollout_samples(samples)
    for e in exps:  # what make_experience's remote policy forward would attach
        lp = torch.full(e.action_mask.shape, JUNK)
        for row, i in enumerate(e.index):
            P, L = len(r.prompt_ids[i]), int(r.lengths[i])
            assert e.action_mask[row].nonzero().flatten().tolist() == list(range(P - 1, P - 1 + L))
            lp[row, P - 1:P - 1 + L] = r.old[i, :L]
        e.action_log_probs = lp
        e.base_action_log_probs = None
    return exps


def _action_rows(e, t):
    """``{original index: values of t on that row's action positions}`` of a maker Experience."""
    return {int(i): t[row][e.action_mask[row].bool()] for row, i in enumerate(e.index) if int(i) >= 0}


# ------------------------------------------------------------------ 1. pure experience paths
def test_fixed_rollout_is_what_the_docstring_says():
    assert N == 28 and T == 8 and int(ROLL.mask.sum()) == sum(map(sum, LENGTHS))
    assert bool((ROLL.old[ROLL.mask == 0] == JUNK).all()) and bool((ROLL.old[ROLL.mask == 1] < 0).all())
    # no ties in the length-normalised old log-probs inside a group (the unlikeliness ranks are unique)
    seq = ((ROLL.old * ROLL.mask).sum(1) / ROLL.mask.sum(1)).view(B, G)
    assert all(len(set(row.tolist())) == G for row in seq)


@pytest.mark.parametrize("name,overrides,needs", CASES, ids=IDS)
def test_local_and_openrlhf_pure_paths_agree(name, overrides, needs):
    ml, mo = _local_method(name, overrides), _openrlhf_method(name, overrides)
    assert ml.describe() == mo.describe()  # get_method(name, **overrides) == the driver's --div.* flags
    loc = _local_pure(ml)
    res = rollout_advantages(mo, ROLL.rewards, ROLL.old, ROLL.mask, G, lengths=ROLL.lengths)
    # each engine against the spec written out independently (not against each other: both
    # call Method.rollout, so comparing them alone would compare the registry with itself)
    ref = _spec(name, overrides)
    assert torch.equal(loc.keep, ref.keep) and torch.equal(res.keep, ref.keep.repeat_interleave(G))
    torch.testing.assert_close(res.shaped_rewards.double(), ref.shaped, rtol=0, atol=1e-6)
    torch.testing.assert_close(res.advantages.double(), ref.adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loc.adv.double(), ref.adv[loc.rows], rtol=1e-5, atol=1e-5)
    assert torch.equal(res.correct, ref.correct)
    keep = loc.keep.repeat_interleave(G)
    assert torch.equal(res.keep, keep)
    torch.testing.assert_close(res.shaped_rewards, loc.shaped, rtol=0, atol=1e-6)
    assert torch.equal(res.correct[loc.rows], loc.correct)
    assert res.correct.tolist() == [x >= 1.0 for x in ROLL.rewards.tolist()]
    torch.testing.assert_close(res.advantages[loc.rows], loc.adv, rtol=0, atol=1e-6)
    torch.testing.assert_close(res.mask[loc.rows], ROLL.mask[loc.rows], rtol=0, atol=0)
    dropped = ~keep
    assert res.advantages[dropped].abs().sum() == 0 and res.mask[dropped].sum() == 0
    # nothing of the junk at padding leaks into an advantage
    assert loc.adv[ROLL.mask[loc.rows] == 0].abs().sum() == 0
    assert torch.isfinite(loc.adv).all() and loc.adv.abs().max() < 10
    assert bool(loc.keep.all()) == (name != "dapo")  # only DAPO samples dynamically


def test_the_cases_are_not_vacuous():
    """Every case's rollout side differs from every other's, except the methods whose
    difference lives at the loss only (EntAdv's entropy term, RKL's KL, DPH's anchors): those
    ship exactly GRPO's advantages."""
    advs = {}
    for (name, overrides, _), cid in zip(CASES, IDS):
        loc = _local_pure(get_method(name, **overrides))
        advs[cid] = torch.zeros(N, T).index_copy(0, loc.rows, loc.adv)
    same_as_grpo = {cid for cid in IDS if torch.equal(advs[cid], advs["grpo"])}
    assert same_as_grpo == {"grpo", "entadv", "rkl", "dph_f", "dph_js_def"}
    others = [cid for cid in IDS if cid not in same_as_grpo] + ["grpo"]
    for a in range(len(others)):
        for b in range(a + 1, len(others)):
            assert (advs[others[a]] - advs[others[b]]).abs().max() > 1e-3, (others[a], others[b])


def test_hand_values_from_the_spec():
    """A few numbers of the comparison above, written out from ALGORITHMS.md."""
    # DAPO: overlong penalty ((L_max - L_c) - L) / L_c in (3, 6], -1 beyond 6; keep = mixed
    # correctness on the task rewards (one refill criterion in both engines, issue 9): g1 is all
    # correct (only its shaped rewards differ) -> dropped; g6 is mixed -> kept
    loc = _local_pure(get_method("dapo", **DAPO))
    assert loc.keep.tolist() == [True, False, False, True, False, False, True]
    torch.testing.assert_close(loc.shaped[4:8], torch.tensor([1.0, 1.0, 1 - 2 / 3, 0.0]))
    torch.testing.assert_close(loc.shaped[24:28], torch.tensor([0.0, 0.0, 0.0, 0.0]))
    # GRPO on g0 = [1, 0, 1, 0]: (R - 0.5) / (std_unbiased + 1e-6), broadcast over the mask
    loc = _local_pure(get_method("grpo"))
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(loc.adv[:4], torch.tensor([a, -a, a, -a])[:, None] * ROLL.mask[:4])
    assert loc.adv[8:12].abs().sum() == 0  # an all-equal group gets no signal without dynamic sampling
    # g3 = [1, 0.1, 0, 1]: correct is R >= 1 (the 0.1 is a reward, not a correct answer)
    assert loc.correct[12:16].tolist() == [True, False, False, True]
    # DS-GRPO token granularity: A - gamma_p old_t on correct, A + gamma_n old_t on incorrect
    ds = _local_pure(get_method("ds_grpo", gamma_p=0.3, gamma_n=0.2))
    gr = _local_pure(get_method("grpo"))
    c = gr.correct.float()[:, None]
    want = (gr.adv - c * 0.3 * ROLL.old + (1 - c) * 0.2 * ROLL.old) * ROLL.mask
    torch.testing.assert_close(ds.adv, want)
    # RLOO on g3: R_i - mean_{j != i} R_j
    rl = _local_pure(get_method("rloo"))
    r3 = torch.tensor([1.0, 0.1, 0.0, 1.0])
    loo = r3 - (r3.sum() - r3) / 3
    torch.testing.assert_close(rl.adv[12:16, 0], loo)


@pytest.mark.parametrize("name,overrides,needs", CASES, ids=IDS)
def test_experience_maker_matches_local_engine(name, overrides, needs):
    """The maker on OpenRLHF-built micro-batches (seq-len balanced: rows out of prompt order)."""
    ml, mo = _local_method(name, overrides), _openrlhf_method(name, overrides)
    loc = _local_pure(ml)
    pool = AnchorSampler([AnchorRecord.from_json(a) for a in ANCHORS]) if mo.needs.anchor_batch else None
    maker = _maker(mo, pool=pool, dynamic=True)
    exps = maker.compute_advantages_and_returns(_openrlhf_rollout(maker))
    assert len(exps) > 1 and sorted(i for e in exps for i in e.index) == list(range(N))
    assert [i for e in exps for i in e.index] != list(range(N))  # really reordered
    kept_pos = {int(i): k for k, i in enumerate(loc.rows)}
    seen = 0
    for e in exps:
        adv = _action_rows(e, e.advantages)
        assert torch.equal(e.returns, e.advantages)
        for row, i in enumerate(e.index):
            L = int(ROLL.lengths[i])
            kept = bool(loc.keep[i // G])
            assert float(e.info["div_kept"][row]) == float(kept)
            assert float(e.info["return"][row]) == pytest.approx(float(loc.shaped[i]), abs=1e-6)
            assert e.info["div_anchor"][row] == 0
            if kept:
                k = kept_pos[i]
                assert adv[i].numel() == L
                torch.testing.assert_close(adv[i], loc.adv[k, :L], rtol=0, atol=1e-6)
                assert float(e.info["div_correct"][row]) == float(loc.correct[k])
                # outside the response span: no advantage
                assert e.advantages[row][~e.action_mask[row].bool()].abs().sum() == 0
                seen += 1
            else:  # a dropped group: zero mask, zero advantage (adds no tokens to any normaliser)
                assert e.action_mask[row].sum() == 0 and e.advantages[row].abs().sum() == 0
    assert seen == len(loc.rows)


def test_anchor_rows_survive_collation_with_fewer_anchors_than_micro_batches():
    """Regression: OpenRLHF's default ``--rollout.micro_batch_size 1`` gives one experience per
    rollout row, so most experiences get no anchor row. Its replay buffer re-batches rows of
    different experiences taking the first row's field set: anchor-less rows used to carry
    ``base_action_log_probs = None``, which crashed the collation (anchor row first) or dropped
    the anchors' stored base log-probs (anchor-less row first)."""
    from openrlhf_div.engines.contract import row_values

    recs = [AnchorRecord.from_json(a) for a in ANCHORS[:2]]
    maker = _maker(get_method("dph_f"), pool=AnchorSampler(recs, seed=0), micro=1, anchor_batch_size=2)
    exps = maker.attach_anchors(maker.compute_advantages_and_returns(_openrlhf_rollout(maker)))
    assert len(exps) == N and sum(int(e.sequences.shape[0]) for e in exps) == N + 2
    items = [it for e in exps for it in remove_padding_in_sequences(split_experience_batch(e))]
    stored = {tuple(r.prompt_ids + r.response_ids): r.ref_log_probs for r in recs}
    for order in (items, items[::-1]):
        batch = make_experience_batch(order)
        flags = row_values(batch.info, "div_anchor", len(order))
        assert int(flags.sum()) == 2
        for row in torch.nonzero(flags).flatten().tolist():
            key = tuple(batch.sequences[row][batch.attention_mask[row].bool()].tolist())
            got = batch.base_action_log_probs[row][batch.action_mask[row].bool()]
            assert torch.equal(got, torch.tensor(stored[key]))
        assert batch.base_action_log_probs[flags == 0].abs().sum() == 0


# ------------------------------------------------------------------ 2. down to the loss
class _FixedTask(Task):
    """Verifier stand-in: the fixed rewards, in rollout order."""

    name = "test_xengine_fixed"

    def __init__(self, rewards):
        self.rewards = [float(x) for x in rewards]

    def prompt(self, example):
        return example["prompt"]

    def score(self, response, label):  # pragma: no cover - reward_results is overridden
        raise AssertionError("not used")

    def reward_results(self, responses, labels):
        assert len(responses) == len(self.rewards)
        return [RewardResult(r, r >= 1.0) for r in self.rewards]


def _fake_generate(r=ROLL):
    def generate(model, tokenizer, prompts, *, n_samples, **kw):
        assert n_samples == G and len(prompts) == B
        ids, attn, rmask = pack_sequences(r.prompt_ids, r.response_ids, tokenizer.pad_token_id)
        return GenerationOutput(ids, attn, rmask, r.old.clone(), [list(p) for p in r.prompt_ids],
                                [list(y) for y in r.response_ids], [f"r{i}" for i in range(N)],
                                torch.ones(N, dtype=torch.bool))
    return generate


ANCHORS = [  # D_pef records as presample writes them (prompt_ids, response_ids, stored ref_t)
    {"id": f"pef-{k}", "prompt_text": f"anchor {k}", "label": "x", "response": "",
     "prompt_ids": PROMPTS[k][:2] + [12], "response_ids": [4 + (3 * k + j) % 8 for j in range(2 + k)],
     "ref_log_probs": [-(0.1 + 0.37 * k + 0.11 * j) for j in range(2 + k)], "n_correct": 8, "n_pre": 8}
    for k in range(5)
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("xengine")
    atomic_write_jsonl(str(d / "train.jsonl"), [{"prompt": "ab=", "label": "b", "id": f"t{i}"} for i in range(B)])
    atomic_write_jsonl(str(d / "d_pef.jsonl"), ANCHORS)
    return d


def _local_trainer(name, overrides, files, tmp_path, monkeypatch, extra=()):
    extra = [f"method.{k}={v}" for k, v in overrides.items()] + list(extra)
    if get_method(name).needs.anchor_batch:
        extra.append(f"data.anchor={files / 'd_pef.jsonl'}")
    cfg = load_config(None, [
        "task=math", f"output_dir={tmp_path / 'run'}", f"model.tiny_vocab={VOCAB}", "device=cpu",
        f"data.train={files / 'train.jsonl'}", f"rollout.prompts_per_step={B}", f"rollout.group_size={G}",
        "rollout.max_new_tokens=8", "rollout.recompute_old_log_probs=false", "rollout.dynamic_sampling_max_tries=1",
        "optim.micro_batch_size=64", "logging.tensorboard=false", "logging.progress=false", "logging.entropy=false",
        f"method.name={name}", *extra])
    events = []
    tr = Trainer(cfg, hooks=[events.append])
    tr.task = _FixedTask(ROLL.rewards)
    fake = _fake_generate()
    monkeypatch.setattr(tr.sampler, "generate", lambda prompts, **kw: fake(tr.model, tr.tokenizer, prompts, **kw))
    return tr, events


class _Recorder:
    """OpenRLHF's ``Actor`` behind a recorder of the keyword arguments of each call."""

    def __init__(self, actor):
        self.actor, self.calls = actor, []

    def __call__(self, *a, **kw):
        self.calls.append(kw)
        return self.actor(*a, **kw)

    def train(self):
        self.actor.train()

    @property
    def model(self):
        return self.actor.model


def _openrlhf_actor(method, model):
    """``DivActorPPOTrainer`` around OpenRLHF's ``Actor`` on ``model``; DeepSpeed is a no-op stub
    (this test is about what reaches the loss, the real DeepSpeed step has its own test)."""
    from openrlhf.models import Actor

    from openrlhf_div.engines.openrlhf.actor import DivActorPPOTrainer

    actor = Actor(model, temperature=1.0)
    actor.packing_samples = False
    tr = object.__new__(DivActorPPOTrainer)
    tr.actor = _Recorder(actor)
    tr.div_method = method
    tr._div_generator = torch.Generator().manual_seed(0)
    tr.strategy = NS(ring_attn_group=None, backward=lambda *a: None, optimizer_step=lambda *a, **k: None,
                     get_grad_norm=lambda *a: 0.0)
    tr.args = NS(train=NS(dynamic_batch_enable=False), actor=NS(aux_loss_coef=0.0))
    tr.aux_loss, tr.ema_model, tr.replay_buffer, tr.log_z_head = False, None, None, None
    tr.actor_optim, tr.actor_scheduler = None, NS(get_last_lr=lambda: [0.0])
    tr.last_loss, tr.div_step, tr.div_last_good = None, 1, None  # the step guards' state (checkpoints.py)
    return tr


def _spy(method):
    """Record what the engine hands to the method's online and anchor losses."""
    seen = {"online": [], "anchor": []}
    on, an = method.online_loss, method.anchor_loss

    def online_loss(b):
        seen["online"].append(b)
        return on(b)

    def anchor_loss(a):
        seen["anchor"].append(a)
        return an(a)

    method.online_loss, method.anchor_loss = online_loss, anchor_loss
    return seen


def _vec(t, row, mask):
    return t[row][mask[row].bool()].detach()


@pytest.mark.parametrize("name,overrides,needs", CASES, ids=IDS)
def test_both_engines_ship_the_same_loss_inputs(name, overrides, needs, files, tmp_path, monkeypatch):
    want_ref, want_entropy, want_anchor = needs
    # ---- local engine: make_experience on the fixed rollout, one micro-step over every row
    tr, events = _local_trainer(name, overrides, files, tmp_path, monkeypatch)
    exp, stats = tr.make_experience()
    loc = _local_pure(tr.method)
    assert exp is not None and len(exp) == len(loc.rows) and stats["kept_groups"] == float(int(loc.keep.sum()))
    R = exp.mask.shape[1]
    # make_experience is the pure functions: same rewards, flags and advantages
    torch.testing.assert_close(exp.shaped_rewards, loc.shaped[loc.rows], rtol=0, atol=0)
    assert torch.equal(exp.correct, loc.correct)
    torch.testing.assert_close(exp.advantages, local_trainer.fit_width(loc.adv, R), rtol=0, atol=0)
    anchors = tr.anchor_cursor.next(len(ANCHORS)) if tr.anchor_cursor is not None else []
    rows = list(range(len(exp)))
    tr.micro_step(exp, rows, anchors, float(exp.mask.sum()),
                  float(sum(len(a.response_ids) for a in anchors)), float(len(rows)),
                  where=dict(epoch=0, mini_batch=0, micro_batch=0))
    (ev,) = events
    on_l, an_l = ev["online"], ev["anchor"]

    # ---- OpenRLHF engine: maker (+ anchors), replay-buffer collation, the actor's training step
    mo = _openrlhf_method(name, overrides)
    div = argparse.Namespace(task=None, anchor_data=str(files / "d_pef.jsonl") if want_anchor else None)
    derived = derive_upstream_flags(mo, [], div)
    pool = AnchorSampler(read_pef(str(files)), seed=0) if mo.needs.anchor_batch else None
    maker = _maker(mo, pool=pool, micro=5, anchor_batch_size=len(ANCHORS), tokenizer=tr.tokenizer)
    exps = _openrlhf_rollout(maker)
    if derived.reference_actor and "--algo.kl.use_loss" in derived.argv:
        # the reference actor's forward (OpenRLHF's Actor on the local engine's reference model)
        from openrlhf.models import Actor

        ref_actor = Actor(tr.ref_model)
        ref_actor.packing_samples = False
        with torch.no_grad():
            for e in exps:
                e.base_action_log_probs = ref_actor(e.sequences, e.action_mask, attention_mask=e.attention_mask)
    exps = maker.compute_advantages_and_returns(exps)
    exps = maker.attach_anchors(exps)
    ident = []  # original rollout index of every row; anchors by their record id
    by_tokens = {tuple(a["prompt_ids"] + a["response_ids"]): a["id"] for a in ANCHORS}
    for e in exps:
        for row, i in enumerate(e.index):
            ident.append(int(i) if int(i) >= 0 else
                         by_tokens[tuple(e.sequences[row][e.attention_mask[row].bool()].tolist())])
    items = [it for e in exps for it in remove_padding_in_sequences(split_experience_batch(e))]
    batch = make_experience_batch(items)
    actor_tr = _openrlhf_actor(mo, tr.model)
    seen = _spy(mo)
    actor_tr.training_step(batch, 0.0, 0, loss_batch_info={"anchor": {}} if mo.needs.anchor_batch else {})
    on_o = seen["online"][0]
    an_o = seen["anchor"][0] if seen["anchor"] else None

    # ---- both engines request exactly what the method declares
    ml = tr.method
    assert ml.describe() == mo.describe()
    assert (ml.needs.ref_log_probs, ml.needs.entropy, ml.needs.anchor_batch) == needs
    local_req = (tr.ref_model is not None and on_l.ref_log_probs is not None, on_l.entropy is not None,
                 tr.anchor_cursor is not None and an_l is not None)
    openrlhf_req = (derived.reference_actor and "--algo.kl.use_loss" in derived.argv and on_o.ref_log_probs is not None,
                    bool(actor_tr.actor.calls[0]["return_entropy"]) and on_o.entropy is not None,
                    maker.last_num_anchors > 0 and an_o is not None)
    assert local_req == openrlhf_req == needs
    assert (tr.ref_model is not None) == derived.reference_actor == want_ref
    assert (on_l.log_z is None) and (on_o.log_z is None)

    # ---- online rows: the same tensors per response token
    online_ident = [i for i in ident if isinstance(i, int)]
    assert sorted(online_ident) == list(range(N))
    o_row = {i: k for k, i in enumerate(online_ident)}
    for k, i in enumerate(loc.rows.tolist()):
        L = int(ROLL.lengths[i])
        b = o_row[i]
        pairs = [("advantages", 1e-6), ("old_log_probs", 0.0), ("log_probs", 2e-5)]
        if want_entropy:
            pairs.append(("entropy", 2e-5))
        if want_ref:
            pairs.append(("ref_log_probs", 2e-5))
        for field, atol in pairs:
            vl = _vec(getattr(on_l, field), k, on_l.mask)
            vo = _vec(getattr(on_o, field), b, on_o.mask)
            assert vl.numel() == vo.numel() == L, (field, i)
            torch.testing.assert_close(vo.float(), vl.float(), rtol=0, atol=atol, msg=f"{field} row {i}")
        torch.testing.assert_close(_vec(on_l.old_log_probs, k, on_l.mask), ROLL.old[i, :L], rtol=0, atol=0)
        assert bool(on_l.correct[k]) == bool(on_o.correct[b]) == bool(ROLL.rewards[i] >= 1.0)
    dropped = [i for i in range(N) if not bool(loc.keep[i // G])]
    for i in dropped:  # dropped groups reach the OpenRLHF loss as rows without a single token
        assert on_o.mask[o_row[i]].sum() == 0
    # the current log-probs are the model's: an independent plain forward of one response
    with torch.no_grad():
        ids, attn, rm = pack_sequences([ROLL.prompt_ids[int(loc.rows[0])]], [ROLL.response_ids[int(loc.rows[0])]], 0)
        lp0 = local_trainer.sequence_log_probs(tr.model, ids, attn, rm)[0]
    torch.testing.assert_close(_vec(on_o.log_probs, o_row[int(loc.rows[0])], on_o.mask), lp0, rtol=0, atol=2e-5)

    # ---- DPH anchors: the same D_pef contents, stored base log-probs untouched
    if want_anchor:
        stored = {a["id"]: a for a in ANCHORS}
        loc_ids = [a.id for a in anchors]
        anchor_ident = [i for i in ident if not isinstance(i, int)]
        assert sorted(loc_ids) == sorted(anchor_ident) == sorted(stored)  # one full pass: every record once
        assert [(a.prompt_ids, a.response_ids, a.ref_log_probs) for a in tr.anchor_samples] == \
            [(r.prompt_ids, r.response_ids, r.ref_log_probs) for r in read_pef(str(files / "d_pef.jsonl"))]
        for k, aid in enumerate(loc_ids):
            b = anchor_ident.index(aid)
            ref = torch.tensor(stored[aid]["ref_log_probs"], dtype=torch.float32)
            assert torch.equal(_vec(an_l.ref_log_probs, k, an_l.mask), ref)
            assert torch.equal(_vec(an_o.ref_log_probs, b, an_o.mask), ref)
            torch.testing.assert_close(_vec(an_o.log_probs, b, an_o.mask), _vec(an_l.log_probs, k, an_l.mask),
                                       rtol=0, atol=2e-5)
    else:
        assert an_l is None and an_o is None and not any(isinstance(i, str) for i in ident)


def test_both_engines_draw_the_same_number_of_anchors(files, tmp_path, monkeypatch):
    """B_pef = ceil(online rows / anchor_ratio) in both engines (the local engine per optimizer
    step, the OpenRLHF maker per rollout step; the same thing with one optimizer step). A ratio
    of 9 on 28 rows tells ceil (4) from round (3)."""
    from openrlhf_div.engines.anchor_data import anchor_count

    assert [anchor_count(n, None, 8.0) for n in (1, 4, 12, 20, 36, 2048)] == [1, 1, 2, 3, 5, 256]
    tr, events = _local_trainer("dph_f", {}, files, tmp_path, monkeypatch, extra=["optim.anchor_ratio=9"])
    exp, _ = tr.make_experience()
    tr.optimise(exp)
    assert len(exp) == N and sum(len(e["anchors"]) for e in events) == math.ceil(N / 9) == 4
    mo = _openrlhf_method("dph_f", {})
    maker = _maker(mo, pool=AnchorSampler(read_pef(str(files)), seed=0), anchor_ratio=9.0, tokenizer=tr.tokenizer)
    maker.attach_anchors(maker.compute_advantages_and_returns(_openrlhf_rollout(maker)))
    assert maker.last_num_anchors == 4
