"""The method registry: presets, the papers' defaults (ALGORITHMS.md), Needs, and that
Method.loss / Method.advantages compute the spec's formulas (independent float64 loops)."""
import inspect
import math

import pytest
import torch

import openrlhf_div.algorithms as alg
from openrlhf_div.algorithms import AnchorInputs, LossInputs, get_method, list_methods

F64 = torch.float64

PRESETS = ["grpo", "dr_grpo", "rloo", "dapo", "rkl", "dph_f", "dph_js", "dph_alpha", "dph_js_def",
           "ds_grpo", "ds_positive", "ds_negative", "entropy_bonus", "entropy_penalty",
           "diff_entropy", "cispo", "clip_cov", "kl_cov", "entadv", "flowrl", "unlikeliness",
           "passk", "pkpo", "lad_kl", "lad_reverse_kl", "lad_jeffreys", "lad_tv", "lad_hellinger",
           "lad_js"]

# the papers' defaults as ALGORITHMS.md states them
DEFAULTS = {
    "grpo": {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": 3.0},
    "dapo": {"eps_high": 0.28},
    "rkl": {"kl_coef": 0.01, "eps_high": 0.28, "kl_estimator": "k3"},
    "dph_f": {"anchor_eta": 0.01},
    "dph_js": {"anchor_eta": 0.2},
    "dph_alpha": {"anchor_eta": 0.01, "anchor_alpha": 0.5},
    "ds_grpo": {"gamma_p": 0.01, "gamma_n": 0.01, "ds_granularity": "token"},
    "ds_positive": {"gamma_p": 0.01, "gamma_n": 0.0},
    "ds_negative": {"gamma_p": 0.0, "gamma_n": 0.01},
    "lad_js": {"lad_divergence": "js", "lad_eta": 0.25, "lad_granularity": "token", "lad_clip": None},
    "unlikeliness": {"unlikeliness_beta": 0.25},
    "passk": {"passk_k": 4},
    "pkpo": {"passk_k": 4},
    "entadv": {"entadv_alpha": 0.4, "entadv_kappa": 2.0},
    "clip_cov": {"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
    "kl_cov": {"kl_cov_ratio": 2e-3, "kl_cov_k": 1.0},
    "flowrl": {"flowrl_beta": 15.0},
}
for _d in ("kl", "reverse_kl", "jeffreys", "tv", "hellinger"):
    DEFAULTS[f"lad_{_d}"] = {"lad_divergence": _d, "lad_eta": 0.25}


def test_all_presets_present():
    names = set(list_methods())
    missing = [p for p in PRESETS if p not in names]
    assert not missing, missing
    assert len(PRESETS) == 29


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_paper_defaults(name):
    h = get_method(name).hparams
    for k, v in DEFAULTS[name].items():
        assert h[k] == v, (name, k, h[k], v)


def test_method_structure_matches_spec():
    assert get_method("dapo").dynamic_sampling and get_method("dapo").aggregation == "token-mean"
    assert get_method("dapo").regularizers == ()  # no KL
    assert get_method("dr_grpo").estimator == "dr_grpo" and get_method("rloo").estimator == "rloo"
    for n in ("grpo", "dph_f", "dph_js", "dph_alpha", "ds_grpo", "lad_js"):
        assert get_method(n).estimator == "grpo", n  # GRPO advantages
    for n in ("dph_f", "dph_js", "dph_alpha"):
        m = get_method(n)
        assert m.regularizers == () and m.policy_loss == "ppo_clip", n  # PPO-clip, no KL on D_exp
    for n in PRESETS:
        if n.startswith("lad_"):
            assert get_method(n).policy_loss == "lad"
    assert get_method("entropy_bonus").hparams["entropy_coef"] > 0
    assert get_method("entropy_penalty").hparams["entropy_coef"] < 0


def test_functional_api_defaults():
    """Section 8's signatures and the papers' defaults on the pure functions too."""
    def defaults(fn):
        return {k: p.default for k, p in inspect.signature(fn).parameters.items()
                if p.default is not inspect.Parameter.empty}
    assert defaults(alg.dph_anchor_loss) == {"divergence": "forward_kl", "alpha": 0.5}
    assert {k: v for k, v in defaults(alg.lad_loss).items() if k in ("divergence", "eta")} == \
        {"divergence": "js", "eta": 0.25}
    assert defaults(alg.ds_reshape_advantages) == {"gamma_p": 0.01, "gamma_n": 0.01, "granularity": "token"}
    assert defaults(alg.group_advantages) == {"estimator": "grpo"}
    assert defaults(alg.unlikeliness_rewards) == {"beta": 0.25}
    assert defaults(alg.passk_advantages) == {"k": 4}
    assert defaults(alg.entropy_advantages) == {"alpha": 0.4, "kappa": 2.0}
    d = defaults(alg.clip_cov_loss)
    assert (d["ratio"], d["lb"], d["ub"]) == (2e-4, 1.0, 5.0)
    d = defaults(alg.kl_cov_loss)
    assert (d["ratio"], d["k"]) == (2e-3, 1.0)
    d = defaults(alg.ppo_clip_loss)
    assert (d["eps_low"], d["eps_high"], d["dual_clip"]) == (0.2, 0.2, 3.0)
    assert defaults(alg.flowrl_loss)["beta"] == 15.0
    assert list(inspect.signature(alg.f_divergence).parameters) == ["name", "log_u", "alpha"]


@pytest.mark.parametrize("name", PRESETS)
def test_needs(name):
    n = get_method(name).needs
    assert n.ref_log_probs == (name in ("rkl", "dph_js_def", "flowrl")), name
    assert n.anchor_batch == name.startswith("dph_"), name
    assert n.entropy == (name in ("entropy_bonus", "entropy_penalty", "diff_entropy", "entadv")), name
    assert n.prompt_hidden == (name == "flowrl"), name
    assert n.old_log_probs


# ------------------------------------------------------------------ references
def clamp(v, lo, hi):
    return max(lo, min(hi, v))


def ref_ppo(lp, old, A, el, eh, c=3.0):
    r = math.exp(clamp(lp - old, -20, 20))
    l = max(-A * r, -A * clamp(r, 1 - el, 1 + eh))
    return min(l, -c * A) if A < 0 else l


def token_mean(values, mask):
    num = sum(v * m for rv, rm in zip(values, mask) for v, m in zip(rv, rm))
    return num / sum(sum(rm) for rm in mask)


def per_token(fn, *tensors):
    rows = [t.tolist() for t in tensors]
    B, T = len(rows[0]), len(rows[0][0])
    return [[fn(*(r[b][t] for r in rows), b) for t in range(T)] for b in range(B)]


def f_dph(div, lu, a=0.5):
    lu = clamp(lu, -20, 20)
    u = math.exp(lu)
    if div == "dph_f":
        return clamp(u - 1 - lu, -10, 10)
    if div == "dph_js":
        return u * lu - (u + 1) * math.log((u + 1) / 2)
    return (u ** (1 - a) - (1 - a) * u - a) / (a * (a - 1))


def batch(seed, B=4, T=6, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=F64) * 3
    old = lp + spread * torch.randn(B, T, generator=g, dtype=F64)
    ref = lp + spread * torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.ones(B, T, dtype=F64)
    for b in range(B):
        mask[b, T - b % 3:] = 0
    adv = torch.randn(B, generator=g, dtype=F64).unsqueeze(-1) * mask
    return lp, old, ref, adv, mask


# ------------------------------------------------------------------ Method.loss
@pytest.mark.parametrize("name,div", [("dph_f", "dph_f"), ("dph_js", "dph_js"), ("dph_alpha", "dph_alpha")])
def test_dph_method_loss_is_l_exp_plus_eta_l_pef(name, div):
    m = get_method(name)
    h = m.hparams
    lp, old, _, adv, mask = batch(1, B=4, T=6)
    alp, aref, _, _, amask = batch(2, B=3, T=9, spread=1.0)
    aref = alp - 1.5 * torch.randn(3, 9, generator=torch.Generator().manual_seed(5), dtype=F64)
    lp = lp.clone().requires_grad_(True)
    alp = alp.clone().requires_grad_(True)
    total, metrics = m.loss(online=LossInputs(lp, old, adv, mask), anchor=AnchorInputs(alp, aref, amask))
    l_exp = token_mean(per_token(lambda a, o, A, b: ref_ppo(a, o, A, h["eps_low"], h["eps_high"]),
                                 lp.detach(), old, adv), mask.tolist())
    l_pef = token_mean(per_token(lambda a, r, b: f_dph(div, a - r, h.get("anchor_alpha", 0.5)),
                                 alp.detach(), aref), amask.tolist())
    eta = {"dph_f": 0.01, "dph_js": 0.2, "dph_alpha": 0.01}[name]
    assert float(total.detach()) == pytest.approx(l_exp + eta * l_pef, rel=1e-12)
    assert metrics["loss_exp"] == pytest.approx(l_exp, rel=1e-12)
    assert metrics["loss_pef"] == pytest.approx(l_pef, rel=1e-12)

    # micro-batches with the global token counts add up to the full loss (and gradients)
    total.backward()
    n_on, n_an = float(mask.sum()), float(amask.sum())
    parts = []
    lp2 = lp.detach().clone().requires_grad_(True)
    alp2 = alp.detach().clone().requires_grad_(True)
    for on_rows, an_rows in ((slice(0, 1), slice(0, 2)), (slice(1, 4), slice(2, 3))):
        part, _ = m.loss(online=LossInputs(lp2[on_rows], old[on_rows], adv[on_rows], mask[on_rows]),
                         anchor=AnchorInputs(alp2[an_rows], aref[an_rows], amask[an_rows]),
                         num_online_tokens=n_on, num_anchor_tokens=n_an)
        part.backward()
        parts.append(float(part.detach()))
    assert sum(parts) == pytest.approx(float(total.detach()), rel=1e-12)
    assert torch.allclose(lp2.grad, lp.grad, rtol=1e-12, atol=1e-16)
    assert torch.allclose(alp2.grad, alp.grad, rtol=1e-12, atol=1e-16)
    # an anchor-only micro-batch (the two kinds need not share one)
    only_anchor, _ = m.loss(anchor=AnchorInputs(alp.detach(), aref, amask))
    assert float(only_anchor) == pytest.approx(eta * l_pef, rel=1e-12)


def test_dph_js_def_method_loss():
    m = get_method("dph_js_def")
    h = m.hparams
    lp, old, ref, adv, mask = batch(3)
    alp, aref, _, _, amask = batch(4, B=2, T=5, spread=0.8)
    aref = alp + 0.8 * torch.randn(2, 5, generator=torch.Generator().manual_seed(1), dtype=F64)
    total, _ = m.loss(online=LossInputs(lp, old, adv, mask, ref_log_probs=ref),
                      anchor=AnchorInputs(alp, aref, amask))

    def kl_est(d):
        return math.exp(d) - d - 1

    def log_m(a, b):
        return math.log(0.5 * (math.exp(a) + math.exp(b)))

    eta, lam = h["anchor_eta"], h["js_def_lambda"]
    assert eta == 0.2 and lam == pytest.approx(256 / (128 * 16))  # B_pef / (B_exp * n)
    online = per_token(lambda a, o, A, r, b: ref_ppo(a, o, A, h["eps_low"], h["eps_high"])
                       + eta * lam * kl_est(log_m(r, a) - a), lp, old, adv, ref)
    anchor = per_token(lambda a, r, b: kl_est(log_m(r, a) - r), alp, aref)
    want = token_mean(online, mask.tolist()) + eta * token_mean(anchor, amask.tolist())
    assert float(total) == pytest.approx(want, rel=1e-12)


def test_rkl_method_loss():
    m = get_method("rkl")
    lp, old, ref, adv, mask = batch(5)
    total, metrics = m.loss(online=LossInputs(lp, old, adv, mask, ref_log_probs=ref))

    def tok(a, o, A, r, b):
        d = clamp(r - a, -20, 20)
        return ref_ppo(a, o, A, 0.2, 0.28) + 0.01 * clamp(math.exp(d) - d - 1, -10, 10)
    assert float(total) == pytest.approx(token_mean(per_token(tok, lp, old, adv, ref), mask.tolist()), rel=1e-12)
    with pytest.raises(ValueError, match="ref_log_probs"):
        m.loss(online=LossInputs(lp, old, adv, mask))


@pytest.mark.parametrize("name", ["entropy_bonus", "entropy_penalty", "diff_entropy", "entadv"])
def test_entropy_methods_loss(name):
    m = get_method(name)
    h = m.hparams
    lp, old, _, adv, mask = batch(6)
    H = torch.rand(4, 6, generator=torch.Generator().manual_seed(2), dtype=F64) * 2
    correct = torch.tensor([True, False, True, False])
    total, _ = m.loss(online=LossInputs(lp, old, adv, mask, correct=correct, entropy=H))

    def tok(a, o, A, Ht, b):
        if name == "entadv":
            A = A + min(0.4 * Ht, abs(A) / 2.0)
            return ref_ppo(a, o, A, h["eps_low"], h["eps_high"])
        base = ref_ppo(a, o, A, h["eps_low"], h["eps_high"])
        if name == "diff_entropy":
            return base + (-h["entropy_coef_pos"] * Ht if correct[b] else h["entropy_coef_neg"] * Ht)
        return base - h["entropy_coef"] * Ht
    want = token_mean(per_token(tok, lp, old, adv, H), mask.tolist())
    assert float(total) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="entropy"):
        m.loss(online=LossInputs(lp, old, adv, mask, correct=correct))


def test_lad_js_and_flowrl_method_loss():
    lp, old, ref, adv, mask = batch(7)
    total, _ = get_method("lad_js").loss(online=LossInputs(lp, old, adv, mask))

    def lad(a, o, A, b):
        z = clamp(A / 0.25, -20, 20)
        x = math.exp(clamp(a - o - z, -20, 20))
        return math.exp(z) * 0.5 * (x * math.log(x) - (x + 1) * math.log((x + 1) / 2))
    assert float(total) == pytest.approx(token_mean(per_token(lad, lp, old, adv), mask.tolist()), rel=1e-12)

    m = get_method("flowrl")
    log_z = torch.tensor([0.1, -0.3, 0.7, 0.0], dtype=F64)
    total, _ = m.loss(online=LossInputs(lp, old, adv, mask, ref_log_probs=ref, log_z=log_z))
    want = 0.0
    for b in range(4):
        idx = [t for t in range(6) if mask[b, t]]
        n = len(idx)
        A = sum(float(adv[b, t]) for t in idx) / n
        delta = float(log_z[b]) + sum(float(lp[b, t] - ref[b, t]) for t in idx) / n - 15.0 * A
        w = min(math.exp(sum(float(lp[b, t] - old[b, t]) for t in idx)), 10.0)
        want += w * delta**2 / 4
    assert float(total) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="log_z"):
        m.loss(online=LossInputs(lp, old, adv, mask, ref_log_probs=ref))


def test_clip_cov_method_uses_the_generator():
    m = get_method("clip_cov", clip_cov_ratio=0.05, clip_cov_lb=-1e9, clip_cov_ub=1e9)
    lp0, old, _, adv, mask = batch(8, B=4, T=30, spread=0.05)
    grads = []
    for seed in (3, 3):
        lp = lp0.clone().requires_grad_(True)
        loss, _ = m.loss(online=LossInputs(lp, old, adv, mask, generator=torch.Generator().manual_seed(seed)))
        loss.backward()
        grads.append(lp.grad)
    assert torch.equal(grads[0], grads[1])
    n_zero = int(((grads[0] == 0) & (mask > 0)).sum())
    assert n_zero == math.floor(0.05 * float(mask.sum()))


# ------------------------------------------------------------------ Method.advantages
@pytest.mark.parametrize("name,gp,gn", [("ds_grpo", 0.01, 0.01), ("ds_positive", 0.01, 0.0),
                                        ("ds_negative", 0.0, 0.01)])
def test_ds_method_advantages(name, gp, gn):
    G = 4
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    _, old, _, _, mask = batch(9, B=8, T=5)
    got = get_method(name).advantages(torch.tensor(rewards), G, old_log_probs=old, mask=mask)
    for gi in range(2):
        grp = rewards[gi * G:(gi + 1) * G]
        mean = sum(grp) / G
        std = math.sqrt(sum((r - mean) ** 2 for r in grp) / (G - 1))
        for j, r in enumerate(grp):
            b = gi * G + j
            A = (r - mean) / (std + 1e-6)
            for t in range(5):
                o = float(old[b, t])
                want = (A - gp * o if r >= 1 else A + gn * o) if mask[b, t] else 0.0
                assert float(got[b, t]) == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_plain_method_advantages_and_reward_pipeline():
    G = 4
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    _, old, _, _, mask = batch(10, B=8, T=3)
    adv = get_method("rloo").advantages(rewards, G, old_log_probs=old, mask=mask)
    assert float(adv[0, 0]) == pytest.approx(1.0 - 0.0, rel=1e-6)
    assert float(adv[1, 0]) == pytest.approx(0.0 - 1 / 3, rel=1e-6)
    assert torch.all(adv[4:] == 0)
    # passk with k = 2: n = 4, c = 1 -> rho = 1/2, sigma = 1/2: correct 1, incorrect -1/3
    pk = get_method("passk", passk_k=2).sequence_advantages(torch.tensor([0.0, 1.0, 0.0, 0.0]), G)
    assert pk.tolist() == pytest.approx([-1 / 3, 1.0, -1 / 3, -1 / 3], rel=1e-5)
    # DAPO: dynamic sampling drops the all-correct group; overlong shaping adds the penalty
    dapo = get_method("dapo", overlong_max_len=20, overlong_cache_len=5)
    assert dapo.keep_groups(rewards, G).tolist() == [True, False]
    shaped = dapo.shape_rewards(torch.tensor([1.0, 1.0, 0.0]), 3, lengths=torch.tensor([10, 18, 30]))
    assert shaped.tolist() == pytest.approx([1.0, 1.0 - 0.6, -1.0])
    assert get_method("grpo").keep_groups(rewards, G).tolist() == [True, True]
    # unlikeliness: rank by seq-mean old log-prob
    u = get_method("unlikeliness").shape_rewards(
        torch.tensor([1.0, 1.0, 1.0, 0.0]), 4, seq_mean_old_log_probs=torch.tensor([-0.1, -2.0, -1.0, -3.0]))
    assert u.tolist() == pytest.approx([1 - 0.25 * 3 / 4, 1 - 0.25 * 1 / 4, 1 - 0.25 * 2 / 4, 0.0])


# ------------------------------------------------------------------ bad input
def test_unknown_method_lists_valid_names():
    with pytest.raises(ValueError) as e:
        get_method("grpoo")
    msg = str(e.value)
    assert "grpoo" in msg
    for p in PRESETS:
        assert p in msg


def test_unknown_override_names_the_key():
    with pytest.raises(ValueError) as e:
        get_method("dph_js", anchor_etaa=0.1)
    assert "anchor_etaa" in str(e.value) and "anchor_eta" in str(e.value)
    with pytest.raises(ValueError, match="kl_coef"):
        get_method("grpo", kl_coef=0.1)  # GRPO has no KL term
    with pytest.raises(ValueError, match="aggregation"):
        get_method("grpo", aggregation="mean")


def test_bad_hyperparameter_values_refused():
    with pytest.raises(ValueError, match="alpha"):
        get_method("dph_alpha", anchor_alpha=1.5)
    with pytest.raises(ValueError, match="alpha"):
        get_method("dph_alpha", anchor_alpha=0.0)
    with pytest.raises(ValueError, match="lad_eta"):
        get_method("lad_js", lad_eta=0.0)
    assert get_method("dph_alpha", anchor_alpha=0.3).hparams["anchor_alpha"] == 0.3


def test_overrides_do_not_leak_into_the_registry():
    a = get_method("dph_js", anchor_eta=0.5)
    assert a.hparams["anchor_eta"] == 0.5
    assert get_method("dph_js").hparams["anchor_eta"] == 0.2


def test_method_loss_input_errors():
    m = get_method("grpo")
    with pytest.raises(ValueError, match="anchor"):
        m.loss(anchor=AnchorInputs(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2)))
    with pytest.raises(ValueError):
        m.loss()
    lp = torch.zeros(2, 3, dtype=F64)
    with pytest.raises(ValueError, match="old_log_probs"):
        m.loss(online=LossInputs(lp, torch.zeros(2, 4, dtype=F64), torch.zeros(2, dtype=F64), torch.ones(2, 3)))
    with pytest.raises(ValueError, match="mask"):
        m.advantages(torch.zeros(2), 2, old_log_probs=lp, mask=torch.ones(2, 4))


def test_lad_sequence_granularity_averages_per_sequence():
    """A sequence-level LAD loss sits on every token of its response; the method then
    aggregates seq-mean-token-mean so the batch loss is the mean over sequences."""
    import torch
    from openrlhf_div.algorithms import LossInputs, get_method

    m = get_method("lad_js", lad_granularity="sequence")
    assert m.aggregation == "seq-mean-token-mean"
    assert get_method("lad_js", lad_granularity="sequence", aggregation="token-mean").aggregation == "token-mean"
    torch.manual_seed(0)
    lp = torch.randn(3, 5, dtype=torch.float64) * 0.1 - 1
    old = lp + 0.05 * torch.randn(3, 5, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([0.5, -0.3, 1.0], dtype=torch.float64)
    loss, _ = m.loss(LossInputs(lp, old, adv, mask))
    # independent: one value per sequence, mean over sequences
    import math
    vals = []
    for i in range(3):
        n = int(mask[i].sum())
        log_x = sum(float(lp[i, t] - old[i, t]) for t in range(n)) - float(adv[i]) / 0.25
        x = math.exp(log_x)
        f = 0.5 * (x * math.log(x) - (x + 1) * math.log((x + 1) / 2))
        vals.append(math.exp(float(adv[i]) / 0.25) * f)
    assert abs(float(loss) - sum(vals) / 3) < 1e-10
