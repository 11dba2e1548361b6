"""Advantage estimators and reshaping against ALGORITHMS.md sections 1-3.

References: float64 Python loops and exact ``fractions.Fraction`` binomial ratios, written
from the spec text.
"""
import math
from fractions import Fraction

import pytest
import torch

from openrlhf_div.algorithms import (
    ds_reshape_advantages,
    dynamic_sampling_mask,
    entropy_advantages,
    group_advantages,
    overlong_penalty,
    passk_advantages,
    pkpo_advantages,
    unlikeliness_rewards,
)

F64 = torch.float64


def groups_of(rewards, G):
    return [rewards[i:i + G] for i in range(0, len(rewards), G)]


def ref_group_adv(rewards, G, est):
    out = []
    for grp in groups_of(rewards, G):
        mean = sum(grp) / G
        for i, r in enumerate(grp):
            if est == "grpo":
                # std_g R: read as the unbiased (n - 1) sample std, as OpenRLHF's group_norm
                # and verl compute it (torch.std's default)
                std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (G - 1)) if G > 1 else 0.0
                out.append((r - mean) / (std + 1e-6))
            elif est == "dr_grpo":
                out.append(r - mean)
            else:  # rloo: R_i - mean_{j != i} R_j
                out.append(r - sum(grp[j] for j in range(G) if j != i) / (G - 1))
    return out


REWARDS = [1, 0, 0, 1, 1, 1, 0, 0,   # mixed
           0, 0, 0, 0, 0, 0, 0, 0,   # all wrong
           1, 1, 1, 1, 1, 1, 1, 1,   # all right
           0.3, -1.2, 2.5, 0.0, 0.7, 1.1, -0.4, 0.9]  # continuous


@pytest.mark.parametrize("est", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("G", [2, 4, 8])
def test_group_advantages(est, G):
    got = group_advantages(torch.tensor(REWARDS, dtype=F64), G, est)
    assert got.shape == (len(REWARDS),)
    want = ref_group_adv(REWARDS, G, est)
    for g, w in zip(got.tolist(), want):
        assert g == pytest.approx(w, rel=1e-9, abs=1e-12)


def test_group_advantages_float32_and_int_rewards():
    got = group_advantages(torch.tensor([1, 0, 0, 1]), 4, "grpo")
    want = ref_group_adv([1, 0, 0, 1], 4, "grpo")
    assert got.tolist() == pytest.approx(want, rel=1e-6)


def test_group_advantages_bad_input():
    with pytest.raises(ValueError) as e:
        group_advantages(torch.zeros(8), 4, "ppo")
    for n in ("grpo", "dr_grpo", "rloo"):
        assert n in str(e.value)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(10), 4)
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(torch.zeros(2, 4), 4)


# ------------------------------------------------------------------ Differential Smoothing
def ref_ds(adv, correct, old, mask, gp, gn, gran):
    B, T = len(old), len(old[0])
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        valid = [t for t in range(T) if mask[b][t]]
        seq_sum = sum(old[b][t] for t in valid)
        for t in valid:
            lp = {"token": old[b][t], "seq_mean": seq_sum / len(valid), "seq_sum": seq_sum}[gran]
            a = adv[b] if not isinstance(adv[b], list) else adv[b][t]
            out[b][t] = a - gp * lp if correct[b] else a + gn * lp
    return out


def _ds_inputs(seed=0, B=5, T=8):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 4
    mask = torch.ones(B, T, dtype=F64)
    for b in range(B):
        mask[b, T - b:] = 0
    adv = torch.randn(B, generator=g, dtype=F64)
    correct = torch.tensor([True, False, True, True, False][:B])
    return adv, correct, old, mask


@pytest.mark.parametrize("gran", ["token", "seq_mean", "seq_sum"])
@pytest.mark.parametrize("gp,gn", [(0.01, 0.01), (0.02, 0.002), (0.05, 0.0), (0.0, 0.03)])
def test_ds_reshape(gran, gp, gn):
    adv, correct, old, mask = _ds_inputs()
    got = ds_reshape_advantages(adv, correct, old, mask, gp, gn, gran)
    want = ref_ds(adv.tolist(), correct.tolist(), old.tolist(), mask.tolist(), gp, gn, gran)
    assert got.shape == old.shape
    for gr, wr in zip(got.tolist(), want):
        assert gr == pytest.approx(wr, rel=1e-12, abs=1e-15)
    # token-level advantages give the same (the registry hands [N, T])
    got2 = ds_reshape_advantages(adv.unsqueeze(-1) * mask, correct.int(), old, mask, gp, gn, gran)
    assert torch.allclose(got, got2, rtol=1e-12, atol=0)


def test_ds_positive_and_negative_only():
    adv, correct, old, mask = _ds_inputs(1)
    base = adv.unsqueeze(-1) * mask
    pos = ds_reshape_advantages(adv, correct, old, mask, gamma_p=0.05, gamma_n=0.0)
    neg = ds_reshape_advantages(adv, correct, old, mask, gamma_p=0.0, gamma_n=0.05)
    c = correct.unsqueeze(-1)
    # positive-only leaves incorrect responses alone and raises correct ones' advantage
    # (old_t < 0, so -gamma_p * old_t > 0: rarer correct tokens are pushed up more)
    assert torch.equal(pos[~correct], base[~correct])
    assert torch.all((pos - base)[c.expand_as(pos) & (mask > 0)] > 0)
    assert torch.equal(neg[correct], base[correct])
    assert torch.all((neg - base)[~c.expand_as(neg) & (mask > 0)] < 0)


def test_ds_bad_input():
    adv, correct, old, mask = _ds_inputs()
    with pytest.raises(ValueError) as e:
        ds_reshape_advantages(adv, correct, old, mask, granularity="sequence")
    for n in ("token", "seq_mean", "seq_sum"):
        assert n in str(e.value)
    with pytest.raises(ValueError, match="correct"):
        ds_reshape_advantages(adv, correct[:3], old, mask)
    with pytest.raises(ValueError, match="mask"):
        ds_reshape_advantages(adv, correct, old, mask[:, :3])
    with pytest.raises(ValueError, match="advantages"):
        ds_reshape_advantages(adv[:2], correct, old, mask)
    with pytest.raises(ValueError, match="advantages"):
        ds_reshape_advantages(torch.zeros(5, 3, dtype=F64), correct, old, mask)


# ------------------------------------------------------------------ Unlikeliness
def test_unlikeliness_rewards():
    G = 4
    rewards = [1, 1, 0, 1, 1, 0, 1, 1]
    lps = [-0.5, -2.0, -0.1, -1.0, -0.3, -0.9, -3.0, -0.05]
    got = unlikeliness_rewards(torch.tensor(rewards, dtype=F64), torch.tensor(lps, dtype=F64), G, 0.25)
    want = []
    for grp_r, grp_lp in zip(groups_of(rewards, G), groups_of(lps, G)):
        for r, lp in zip(grp_r, grp_lp):
            rank = sum(1 for other in grp_lp if other < lp)  # 0 = least likely
            want.append(r * (1 - 0.25 * rank / G))
    assert got.tolist() == pytest.approx(want, rel=1e-12)
    # group 0 ranks (ascending lp): idx1 -2.0 -> 0, idx3 -1.0 -> 1, idx0 -0.5 -> 2, idx2 -0.1 -> 3;
    # the likeliest correct answer (idx0) is discounted most, the least likely keeps its reward
    assert got[0] == pytest.approx(1 - 0.25 * 2 / 4)
    assert got[1] == pytest.approx(1.0)


# ------------------------------------------------------------------ Pass@k / PKPO
def C(n, k):
    return math.comb(n, k) if 0 <= k <= n else 0


def ref_passk(rewards, G, k):
    out = []
    for grp in groups_of(rewards, G):
        n, c = G, sum(1 for r in grp if r >= 1)
        rho = 1 - Fraction(C(n - c, k), C(n, k))
        sigma = math.sqrt(float(rho * (1 - rho)))
        pos = float(1 - rho) / (sigma + 1e-6)
        neg = float(1 - rho - Fraction(C(n - c - 1, k - 1), C(n - 1, k - 1))) / (sigma + 1e-6)
        out += [pos if r >= 1 else neg for r in grp]
    return out


def ref_pkpo(rewards, G, k):
    out = []
    for grp in groups_of(rewards, G):
        n, c = G, sum(1 for r in grp if r >= 1)
        s = [Fraction(k, n) if r >= 1 else Fraction(k, n) * (1 - Fraction(C(n - c - 1, k - 1), C(n - 1, k - 1)))
             for r in grp]
        out += [float(si - (sum(s) - si) / (n - 1)) for si in s]
    return out


def _binary_groups(G, seed=0):
    # every count c = 0..G of correct answers, in shuffled positions
    g = torch.Generator().manual_seed(seed)
    rows = []
    for c in range(G + 1):
        row = [1.0] * c + [0.0] * (G - c)
        perm = torch.randperm(G, generator=g).tolist()
        rows += [row[p] for p in perm]
    return rows


@pytest.mark.parametrize("G,k", [(4, 1), (4, 4), (8, 4), (16, 4), (16, 8), (5, 2), (64, 16)])
def test_passk_advantages(G, k):
    rewards = _binary_groups(G)
    got = passk_advantages(torch.tensor(rewards, dtype=F64), G, k)
    assert got.tolist() == pytest.approx(ref_passk(rewards, G, k), rel=1e-9, abs=1e-9)


def test_passk_advantages_known_values():
    # n = 4, k = 2, c = 1: rho = 1 - C(3,2)/C(4,2) = 1/2, sigma = 1/2;
    # correct (1/2)/(1/2) = 1; incorrect (1/2 - C(2,1)/C(3,1)) / (1/2) = -1/3
    got = passk_advantages(torch.tensor([0.0, 1.0, 0.0, 0.0]), 4, 2)
    assert got.tolist() == pytest.approx([-1 / 3, 1.0, -1 / 3, -1 / 3], rel=1e-5)


@pytest.mark.parametrize("G,k", [(4, 1), (4, 4), (8, 4), (16, 4), (64, 16)])
def test_pkpo_advantages(G, k):
    rewards = _binary_groups(G, seed=1)
    got = pkpo_advantages(torch.tensor(rewards, dtype=F64), G, k)
    assert got.tolist() == pytest.approx(ref_pkpo(rewards, G, k), rel=1e-9, abs=1e-12)


def test_passk_bad_k():
    with pytest.raises(ValueError, match="k"):
        passk_advantages(torch.zeros(8), 4, 5)
    with pytest.raises(ValueError, match="k"):
        pkpo_advantages(torch.zeros(8), 4, 0)


# ------------------------------------------------------------------ EntAdv
def test_entropy_advantages():
    g = torch.Generator().manual_seed(4)
    A = torch.randn(3, 6, generator=g, dtype=F64)
    H = (torch.rand(3, 6, generator=g, dtype=F64) * 3).requires_grad_(True)
    mask = torch.ones(3, 6, dtype=F64)
    mask[2, 4:] = 0
    got = entropy_advantages(A, H, mask, alpha=0.4, kappa=2.0)
    assert not got.requires_grad  # sg(H): no gradient flows into the entropy
    for b in range(3):
        for t in range(6):
            a, h = float(A[b, t]), float(H.detach()[b, t])
            want = a + min(0.4 * h, abs(a) / 2.0) if mask[b, t] else 0.0
            assert float(got[b, t]) == pytest.approx(want, rel=1e-12)
    seq = entropy_advantages(A[:, 0], H, mask)  # [B] advantages broadcast
    for b in range(3):
        for t in range(6):
            a, h = float(A[b, 0]), float(H.detach()[b, t])
            want = a + min(0.4 * h, abs(a) / 2.0) if mask[b, t] else 0.0
            assert float(seq[b, t]) == pytest.approx(want, rel=1e-12)


# ------------------------------------------------------------------ DAPO pieces
def test_overlong_penalty():
    L_max, L_c = 20, 5
    lengths = list(range(0, 26))
    got = overlong_penalty(torch.tensor(lengths), L_max, L_c).tolist()
    for L, v in zip(lengths, got):
        if L <= L_max - L_c:
            want = 0.0
        elif L <= L_max:
            want = ((L_max - L_c) - L) / L_c
        else:
            want = -1.0
        assert v == pytest.approx(want, abs=1e-7), L
    assert got[20] == pytest.approx(-1.0) and got[16] == pytest.approx(-0.2)
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([1]), 10, 0)


def test_dynamic_sampling_mask():
    rewards = torch.tensor([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5000001], dtype=F64)
    got = dynamic_sampling_mask(rewards, 4)
    assert got.tolist() == [False, True, False, False]
    got = dynamic_sampling_mask(rewards, 4, atol=0.0)
    assert got.tolist() == [False, True, False, True]


def test_masked_positions_do_not_leak_into_advantages():
    adv, correct, old, mask = _ds_inputs(2)
    off = mask == 0
    for bad in (float("inf"), float("-inf"), float("nan")):
        old2 = old.clone()
        old2[off] = bad
        for gran in ("token", "seq_mean", "seq_sum"):
            a = ds_reshape_advantages(adv, correct, old, mask, granularity=gran)
            b = ds_reshape_advantages(adv, correct, old2, mask, granularity=gran)
            assert torch.equal(a, b), gran
        H = torch.rand_like(old)
        H2 = H.clone()
        H2[off] = bad
        a = entropy_advantages(adv, H, mask)
        b = entropy_advantages(adv, H2, mask)
        assert torch.equal(a, b)
