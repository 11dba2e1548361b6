"""The library's losses against independent reference expressions of the spec's formulas,
written here with ``torch.where`` masking and autograd's own derivatives; plus gradcheck in
float64, the registry's composition and its logged metrics, and Clip-Cov's random pick.
(The hand-fused losses these tests were written for have left the library, issue 11; the
expectations are unchanged.)"""
import math

import pytest
import torch

from openrlhf_div.algorithms import (
    AnchorInputs,
    LossInputs,
    cispo_loss,
    clip_cov_loss,
    dph_anchor_loss,
    dph_js_def_loss,
    entropy_advantages,
    f_divergence,
    get_method,
    kl_cov_loss,
    kl_estimate,
    lad_loss,
    list_methods,
    ppo_clip_loss,
)

F64 = torch.float64


# ------------------------------------------------------------------ autograd references
def _w(mask, x):
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype))


def ref_ppo(lp, old, A, mask, el=0.2, eh=0.2, c=3.0):
    """PPO-clip written by the sign of the advantage, as the PPO paper states its clipped
    surrogate case by case (not the library's max-of-two-terms): A >= 0 caps the ratio from
    above, ``-A min(r, 1 + eh)``; A < 0 from below, ``-A max(r, 1 - el)``, then the dual clip
    bounds that case by ``-c A``. With crossed bounds (1 - el > 1 + eh) the clip interval is the
    single point 1 + eh (clip's usual convention), so the A < 0 floor is min(1 - el, 1 + eh)."""
    A = _w(mask, A)
    r = torch.exp(_w(mask, lp - old).clamp(-20, 20))
    pos = -A * torch.minimum(r, torch.full_like(r, 1 + eh))
    neg = -A * torch.maximum(r, torch.full_like(r, min(1 - el, 1 + eh)))
    if c is not None:
        neg = torch.minimum(neg, -c * A)
    return _w(mask, torch.where(A >= 0, pos, neg))


def ref_k3(lp, ref, mask, clamp=10.0):
    """The spec's k3 = exp(ref - lp) - (ref - lp) - 1, as written (exp, not expm1)."""
    lr = _w(mask, lp - ref).clamp(-20, 20)
    return _w(mask, ((torch.exp(-lr) - 1) + lr).clamp(-clamp, clamp))


def ref_js_def(lp, ref, mask, on):
    log_m = torch.logsumexp(torch.stack([ref, lp]), 0) - math.log(2.0)
    s = _w(mask, log_m - (ref if on == "anchor" else lp)).clamp(-20, 20)
    return _w(mask, torch.exp(s) - s - 1)


def ref_cispo(lp, old, A, mask, el=1.0, eh=0.28):
    r = torch.exp(_w(mask, lp - old).clamp(-20, 20))
    w = r.clamp(1 - el, 1 + eh).detach()
    return _w(mask, -w * _w(mask, A) * lp)


def ref_kl_cov(lp, old, A, mask, ratio=2e-3, k=1.0):
    A = _w(mask, A)
    log_r = _w(mask, lp - old).clamp(-20, 20)
    loss = -A * torch.exp(log_r)
    valid = mask.bool()
    n_pick = int(math.floor(ratio * int(valid.sum())))
    if n_pick > 0:
        lpd = lp.detach()
        cov = (A - A.sum() / mask.sum()) * (lpd - _w(mask, lpd).sum() / mask.sum())
        top = torch.topk(cov.masked_fill(~valid, -math.inf).reshape(-1), n_pick).indices
        sel = torch.zeros(loss.numel(), dtype=loss.dtype)
        sel[top] = 1.0
        loss = loss + k * log_r.abs() * sel.view_as(loss)
    return _w(mask, loss)


def ref_lad(lp, old, A, mask, div, eta=0.25, clip_eps=None):
    A = _w(mask, A)
    log_r = _w(mask, lp - old)
    z = (A / eta).clamp(-20, 20)
    loss = torch.exp(z) * f_divergence(div, (log_r - z).clamp(-20, 20))
    if clip_eps is not None:
        r = torch.exp(log_r.detach().clamp(-20, 20))
        clipped = ((A > 0) & (r > 1 + clip_eps[1])) | ((A < 0) & (r < 1 - clip_eps[0]))
        loss = torch.where(clipped, loss.detach(), loss)
    return _w(mask, loss)


def ref_dph(lp, ref, mask, div, alpha=0.5):
    name = {"forward_kl": "dph_forward_kl", "js": "dph_js", "alpha": "dph_alpha"}[div]
    return _w(mask, f_divergence(name, _w(mask, lp - ref.detach()), alpha=alpha))


def inputs(seed=0, B=6, T=11, spread=0.6, dtype=F64, extremes=True):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=F64) * 4
    old = lp + spread * torch.randn(B, T, generator=g, dtype=F64)
    ref = lp + spread * torch.randn(B, T, generator=g, dtype=F64)
    A = torch.randn(B, generator=g, dtype=F64)
    A[0] = 0.0  # a group whose rewards were all equal
    mask = torch.ones(B, T, dtype=F64)
    for b in range(B):
        mask[b, T - 1 - b % 4:] = 0
    A = A.unsqueeze(-1) * mask
    A[1, 0] = -A[1, 0]  # token-level advantages of both signs in one row
    # clamps that bind: |lp - old| > 20, r > dual clip, |lp - ref| > 20
    if extremes:
        old[2, 0], old[3, 1], ref[4, 0], ref[5, 1] = lp[2, 0] + 25, lp[3, 1] - 1.5, lp[4, 0] + 30, lp[5, 1] - 30
        A[3, 1] = -abs(A[3, 1]) - 0.1
    return {k: v.to(dtype) for k, v in dict(lp=lp, old=old, ref=ref, A=A, mask=mask).items()}


def value_and_grad(fn, i, *extra_leaves):
    lp = i["lp"].clone().requires_grad_(True)
    leaves = [lp] + [i[k].clone().requires_grad_(True) for k in extra_leaves]
    kw = dict(i, lp=lp, **dict(zip(extra_leaves, leaves[1:])))
    out = fn(kw)
    out.backward(torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).view_as(out))
    return out.detach(), [x.grad for x in leaves]


def assert_close(a, b, rtol=1e-12, atol=1e-14):
    assert torch.allclose(a, b, rtol=rtol, atol=atol), (a - b).abs().max()


# ------------------------------------------------------------------ PPO-clip
@pytest.mark.parametrize("el,eh,c", [(0.2, 0.2, 3.0), (0.2, 0.28, 3.0), (0.1, 0.3, None), (1.0, 0.28, 3.0),
                                     (-0.5, 0.2, 3.0)])  # the last: bounds cross (lo > hi)
def test_ppo_matches_autograd(el, eh, c):
    i = inputs(1)
    got, (g,) = value_and_grad(lambda k: ppo_clip_loss(k["lp"], k["old"], k["A"], k["mask"], el, eh, c), i)
    want, (gw,) = value_and_grad(lambda k: ref_ppo(k["lp"], k["old"], k["A"], k["mask"], el, eh, c), i)
    assert torch.equal(got, want)  # the same products, picked by sign instead of max / min
    assert_close(g, gw)


def test_ppo_gradient_reaches_old_log_probs_and_mixed_dtypes():
    i = inputs(2)
    _, (g_lp, g_old) = value_and_grad(lambda k: ppo_clip_loss(k["lp"], k["old"], k["A"], k["mask"]), i, "old")
    _, (w_lp, w_old) = value_and_grad(lambda k: ref_ppo(k["lp"], k["old"], k["A"], k["mask"]), i, "old")
    assert_close(g_lp, w_lp)
    assert_close(g_old, w_old)
    # bfloat16 log-probs with float32 old log-probs: float32 loss, bfloat16 gradient
    lp = i["lp"].to(torch.bfloat16).requires_grad_(True)
    out = ppo_clip_loss(lp, i["old"].float(), i["A"].float(), i["mask"].float())
    out.sum().backward()
    assert out.dtype == torch.float32 and lp.grad.dtype == torch.bfloat16


def test_ppo_without_grad_gives_the_same_value():
    i = inputs(3)
    with torch.no_grad():
        a = ppo_clip_loss(i["lp"].requires_grad_(True), i["old"], i["A"], i["mask"])
    b = ppo_clip_loss(i["lp"], i["old"], i["A"], i["mask"])
    assert torch.equal(a, b) and not a.requires_grad


def test_ppo_clipfrac_metric_is_ppo_clip_mask():
    i = inputs(4)
    m = get_method("grpo", eps_high=0.28)
    _, metrics = m.loss(online=LossInputs(i["lp"], i["old"], i["A"], i["mask"]))
    r = torch.exp(_w(i["mask"], i["lp"] - i["old"]).clamp(-20, 20))
    A = i["A"]
    want = _w(i["mask"], (((A > 0) & (r > 1.28)) | ((A < 0) & (r < 0.8))).to(F64))
    assert metrics["clipfrac"] == pytest.approx(float(want.sum() / i["mask"].sum()), rel=1e-12)


# ------------------------------------------------------------------ k3 and JS-definition
@pytest.mark.parametrize("clamp", [10.0, 1.0, 25.0])  # 25: the log-ratio clamp binds on its own
def test_k3_matches_autograd(clamp):
    i = inputs(5)
    got, (g, gr) = value_and_grad(lambda k: kl_estimate(k["lp"], k["ref"], k["mask"], "k3", clamp), i, "ref")
    want, (gw, grw) = value_and_grad(lambda k: ref_k3(k["lp"], k["ref"], k["mask"], clamp), i, "ref")
    assert torch.equal(got, want)
    assert_close(g, gw)
    assert_close(gr, grw)


@pytest.mark.parametrize("on", ["anchor", "online"])
def test_js_def_matches_autograd(on):
    i = inputs(6, spread=1.5)
    i["ref"][0, 0] = i["lp"][0, 0] + (25.0 if on == "online" else -25.0)  # s clamped at 20
    got, (g,) = value_and_grad(lambda k: dph_js_def_loss(k["lp"], k["ref"], k["mask"], on), i)
    want, (gw,) = value_and_grad(lambda k: ref_js_def(k["lp"], k["ref"].detach(), k["mask"], on), i)
    assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_close(g, gw, rtol=1e-10, atol=1e-12)
    assert float(g[0, 0]) == 0.0 and float(got[0, 0]) == pytest.approx(math.expm1(20) - 20, rel=1e-12)


def test_float32_accuracy_no_worse_than_the_plain_expressions():
    # (the fused code's own bound of 2.5e-7 is gone with it: the reference expressions
    # themselves reach 2.8e-7 on the JS-definition gradient, and the library now is them)
    i32 = {k: v.float() for k, v in inputs(7, B=32, T=64, spread=0.3, extremes=False).items()}
    i64 = {k: v.double() for k, v in i32.items()}  # the same (rounded) inputs, exactly
    pairs = [(lambda k: kl_estimate(k["lp"], k["ref"], k["mask"], "k3"), lambda k: ref_k3(k["lp"], k["ref"], k["mask"]))]
    for on in ("online", "anchor"):
        pairs.append(((lambda o: lambda k: dph_js_def_loss(k["lp"], k["ref"], k["mask"], o))(on),
                      (lambda o: lambda k: ref_js_def(k["lp"], k["ref"], k["mask"], o))(on)))
    for n, (fn, ref) in enumerate(pairs):
        v64, (g64,) = value_and_grad(ref, i64)
        errs = []
        for f in (fn, ref):
            v32, (g32,) = value_and_grad(f, i32)
            errs.append(((v32.double() - v64).abs().max(), (g32.double() - g64).abs().max()))
        (ev, eg), (rv, rg) = errs
        assert ev <= 2 * rv + 1e-8 and eg <= 2 * rg + 1e-8, errs


@pytest.mark.parametrize("name", ["ppo", "k3", "k3_clamp25", "js_anchor", "js_online", "clip_cov_none"])
def test_gradcheck(name):
    i = inputs(8, B=3, T=5, spread=0.4, extremes=False)
    fns = {
        "ppo": lambda x: ppo_clip_loss(x, i["old"], i["A"], i["mask"], 0.2, 0.28),
        "k3": lambda x: kl_estimate(x, i["ref"], i["mask"], "k3"),
        "k3_clamp25": lambda x: kl_estimate(x, i["ref"], i["mask"], "k3", 25.0),
        "js_anchor": lambda x: dph_js_def_loss(x, i["ref"], i["mask"], "anchor"),
        "js_online": lambda x: dph_js_def_loss(x, i["ref"], i["mask"], "online"),
        "clip_cov_none": lambda x: clip_cov_loss(x, i["old"], i["A"], i["mask"], lb=1e6, ub=1e7),
    }
    lp = i["lp"].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(fns[name], (lp,), eps=1e-6, atol=1e-6)


# ------------------------------------------------------------------ the other losses
def test_cispo_matches_autograd():
    i = inputs(12)
    got, (g,) = value_and_grad(lambda k: cispo_loss(k["lp"], k["old"], k["A"], k["mask"], 0.2, 0.28), i)
    want, (gw,) = value_and_grad(lambda k: ref_cispo(k["lp"], k["old"], k["A"], k["mask"], 0.2, 0.28), i)
    assert torch.equal(got, want)
    assert_close(g, gw)


@pytest.mark.parametrize("masked_top", [False, True])
def test_kl_cov_matches_autograd(masked_top):
    i = inputs(13, B=8, T=40, spread=0.3)
    if masked_top:  # every masked token's covariance, (0 - mean A)(0 - mean lp), beats the valid ones
        i["A"] = i["A"].abs() * -0.01
        i["A"][0, :10] = -5.0
    got, (g, go) = value_and_grad(lambda k: kl_cov_loss(k["lp"], k["old"], k["A"], k["mask"], 0.05, 1.5), i, "old")
    want, (gw, gow) = value_and_grad(lambda k: ref_kl_cov(k["lp"], k["old"], k["A"], k["mask"], 0.05, 1.5), i, "old")
    assert torch.equal(got, want)
    assert_close(g, gw)
    assert_close(go, gow)


@pytest.mark.parametrize("div", ["kl", "reverse_kl", "jeffreys", "tv", "hellinger", "js"])
@pytest.mark.parametrize("clip_eps", [None, (0.2, 0.28)])
def test_lad_matches_autograd(div, clip_eps):
    i = inputs(14)
    i["lp"][1, 1] = i["old"][1, 1] + 30.0  # the clamp of log x binds
    got, (g,) = value_and_grad(lambda k: lad_loss(k["lp"], k["old"], k["A"], k["mask"], div, 0.25,
                                                  clip_eps=clip_eps), i)
    want, (gw,) = value_and_grad(lambda k: ref_lad(k["lp"], k["old"], k["A"], k["mask"], div, 0.25, clip_eps), i)
    if div == "js":  # log1p(exp(.)) for softplus, within an ulp
        assert_close(got, want, rtol=1e-14, atol=1e-15)
    else:
        assert torch.equal(got, want)
    assert_close(g, gw, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("div", ["forward_kl", "js", "alpha"])
def test_dph_anchor_matches_autograd(div):
    i = inputs(15, spread=1.5)
    got, (g,) = value_and_grad(lambda k: dph_anchor_loss(k["lp"], k["ref"], k["mask"], div, alpha=0.3), i)
    want, (gw,) = value_and_grad(lambda k: ref_dph(k["lp"], k["ref"], k["mask"], div, alpha=0.3), i)
    if div == "js":  # log1p(exp(.)) stands for softplus: the same within an ulp, not always equal
        assert_close(got, want, rtol=1e-14, atol=1e-15)
    else:
        assert torch.equal(got, want)
    assert_close(g, gw, rtol=1e-10, atol=1e-12)


def test_entropy_advantages_in_place_path_is_the_same():
    i = inputs(16)
    H = torch.rand(6, 11, dtype=F64) * 2
    H[i["mask"] == 0] = math.nan
    got = entropy_advantages(i["A"], H, i["mask"])
    A = _w(i["mask"], i["A"])  # the expression it replaces
    want = _w(i["mask"], A + torch.minimum(0.4 * _w(i["mask"], H), A.abs() / 2.0))
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["cispo", "kl_cov", "lad_js", "lad_tv", "dph_js", "dph_alpha"])
def test_gradcheck_more(name):
    i = inputs(17, B=3, T=5, spread=0.4, extremes=False)
    fns = {
        "cispo": lambda x: cispo_loss(x, i["old"], i["A"], i["mask"], 0.2, 0.28),
        "kl_cov": lambda x: kl_cov_loss(x, i["old"], i["A"], i["mask"], 0.2),
        "lad_js": lambda x: lad_loss(x, i["old"], i["A"], i["mask"], "js"),
        "lad_tv": lambda x: lad_loss(x, i["old"], i["A"], i["mask"], "tv"),
        "dph_js": lambda x: dph_anchor_loss(x, i["ref"], i["mask"], "js"),
        "dph_alpha": lambda x: dph_anchor_loss(x, i["ref"], i["mask"], "alpha"),
    }
    lp = i["lp"].clone().requires_grad_(True)
    if name == "cispo":  # its weight is detached: gradcheck where it is constant (r clipped)
        i["old"] = i["lp"] - 0.5
    assert torch.autograd.gradcheck(fns[name], (lp,), eps=1e-6, atol=1e-6)


# ------------------------------------------------------------------ Clip-Cov's pick
def test_clip_cov_pick_is_uniform_distinct_and_seeded():
    """Clip-Cov detaches ``max(1, floor(ratio N))`` candidates, uniformly among them, seeded."""
    B, T = 4, 100
    lp = torch.full((B, T), -1.0, dtype=F64)
    A = torch.zeros(B, T, dtype=F64)
    A[:, ::7] = 1.0  # covariance > 0 only where A > 0 and lp above its mean
    lp[:, ::7] = 0.0
    old = lp.clone()  # r = 1: nothing clipped
    mask = torch.ones(B, T, dtype=F64)
    cand = torch.zeros(B, T, dtype=torch.bool)
    cand[:, ::7] = True
    n = int(cand.sum())
    counts = torch.zeros(B, T)
    for seed in range(300):
        x = lp.clone().requires_grad_(True)
        clip_cov_loss(x, old, A, mask, ratio=5.5 / (B * T), lb=0.5, ub=1e9,
                      generator=torch.Generator().manual_seed(seed)).sum().backward()
        picked = (x.grad == 0) & cand
        assert int(picked.sum()) == 5 and not bool(((x.grad == 0) & ~cand & (A != 0)).any())
        counts += picked
    c = counts[cand]
    expect = 300 * 5 / n
    chi2 = float(((c - expect) ** 2 / expect).sum())
    assert chi2 < 110, chi2  # n - 1 = 59 degrees of freedom


# ------------------------------------------------------------------ the registry's composition
def _metrics_reference(m, lp, old, A, mask, ref):
    h = m.hparams
    r = torch.exp(_w(mask, lp - old).clamp(-20, 20))
    el, eh = h.get("eps_low", 0.2), h.get("eps_high", 0.2)
    clip = ((A > 0) & (r > 1 + eh)) | ((A < 0) & (r < 1 - el))
    n = mask.sum()
    out = {"clipfrac": float(_w(mask, clip.to(F64)).sum() / n)}
    pol = ref_ppo(lp, old, A, mask, el, eh, h.get("dual_clip", 3.0))
    out["policy_loss"] = float(pol.sum() / n)
    if "kl" in m.regularizers:
        out["kl"] = float(ref_k3(lp, ref, mask).sum() / n)
    if "js_def_online" in m.regularizers:
        out["js_def_online"] = float(ref_js_def(lp, ref, mask, "online").sum() / n)
    return out


@pytest.mark.parametrize("name", ["grpo", "rkl", "dph_js_def", "clip_cov"])
def test_registry_loss_metrics_and_gradients(name):
    m = get_method(name)
    i = inputs(10)
    lp = i["lp"].clone().requires_grad_(True)
    gen = torch.Generator().manual_seed(0)
    total, metrics = m.loss(online=LossInputs(lp, i["old"], i["A"], i["mask"], ref_log_probs=i["ref"],
                                              generator=gen))
    total.backward()
    want = _metrics_reference(m, i["lp"], i["old"], i["A"], i["mask"], i["ref"])
    for k, v in want.items():
        assert metrics[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    assert tuple(metrics)[:len(m.metric_names())] == m.metric_names() and list(metrics)[:2] == ["policy_loss", "clipfrac"]
    # the unfused composition (a gradient wanted for old_log_probs turns the fusion off)
    lp2 = i["lp"].clone().requires_grad_(True)
    old2 = i["old"].clone().requires_grad_(True)
    total2, metrics2 = m.loss(online=LossInputs(lp2, old2, i["A"], i["mask"], ref_log_probs=i["ref"],
                                                generator=torch.Generator().manual_seed(0)))
    total2.backward()
    assert float(total2.detach()) == pytest.approx(float(total.detach()), rel=1e-12)
    for k, v in metrics.items():
        assert metrics2[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    if name != "clip_cov":  # clip_cov: its random pick differs between the two paths' draws
        assert_close(lp.grad, lp2.grad)
    assert_close(old2.grad[i["mask"] > 0], -lp2.grad[i["mask"] > 0]) if name == "grpo" else None


def _policy_reference(m, lp, old, A, mask):
    h = m.hparams
    if m.policy_loss == "cispo":
        return ref_cispo(lp, old, A, mask, h["eps_low"], h["eps_high"])
    if m.policy_loss == "kl_cov":
        return ref_kl_cov(lp, old, A, mask, h["kl_cov_ratio"], h["kl_cov_k"])
    if m.policy_loss == "lad":
        return ref_lad(lp, old, A, mask, h["lad_divergence"], h["lad_eta"], h["lad_clip"])
    return ref_ppo(lp, old, A, mask, h["eps_low"], h["eps_high"], h["dual_clip"])


@pytest.mark.parametrize("name", ["cispo", "kl_cov", "lad_js", "lad_hellinger", "entropy_bonus", "entropy_penalty",
                                  "diff_entropy", "entadv"])
def test_registry_other_methods(name):
    m = get_method(name, **({"kl_cov_ratio": 0.05} if name == "kl_cov" else {}))
    h = m.hparams
    i = inputs(18)
    H0 = torch.rand(6, 11, generator=torch.Generator().manual_seed(1), dtype=F64) * 2
    correct = torch.tensor([True, False, True, True, False, False])
    lp, H = i["lp"].clone().requires_grad_(True), H0.clone().requires_grad_(True)
    total, metrics = m.loss(online=LossInputs(lp, i["old"], i["A"], i["mask"], correct=correct, entropy=H))
    total.backward()
    # reference: autograd expressions, token mean
    lp2, H2 = i["lp"].clone().requires_grad_(True), H0.clone().requires_grad_(True)
    mask = i["mask"]
    A = i["A"]
    if name == "entadv":
        A = _w(mask, A + torch.minimum(0.4 * _w(mask, H2.detach()), A.abs() / 2.0))
    pol = _policy_reference(m, lp2, i["old"], A, mask)
    per_tok = pol
    if name.startswith("entropy"):
        per_tok = per_tok + _w(mask, -h["entropy_coef"] * H2)
    if name == "diff_entropy":
        per_tok = per_tok + _w(mask, torch.where(correct.unsqueeze(-1), -h["entropy_coef_pos"] * H2,
                                                 h["entropy_coef_neg"] * H2))
    want = per_tok.sum() / mask.sum()
    want.backward()
    assert float(total.detach()) == pytest.approx(float(want.detach()), rel=1e-12)
    assert_close(lp.grad, lp2.grad)
    if name in ("entropy_bonus", "entropy_penalty", "diff_entropy"):
        assert_close(H.grad, H2.grad)
        assert metrics["entropy"] == pytest.approx(float(_w(mask, H0).sum() / mask.sum()), rel=1e-12)
    r = torch.exp(_w(mask, i["lp"] - i["old"]).clamp(-20, 20))
    el, eh = h.get("eps_low", 0.2), h.get("eps_high", 0.2)
    clip = _w(mask, (((A > 0) & (r > 1 + eh)) | ((A < 0) & (r < 1 - el))).to(F64))
    if m.policy_loss in ("ppo_clip", "cispo", "clip_cov"):  # the losses that clip report how often
        assert metrics["clipfrac"] == pytest.approx(float(clip.sum() / mask.sum()), rel=1e-12, abs=1e-15)
    else:  # KL-Cov does not clip: no clip fraction
        assert "clipfrac" not in metrics
    assert metrics["policy_loss"] == pytest.approx(float(pol.detach().sum() / mask.sum()), rel=1e-12)


def test_registry_anchor_losses():
    i = inputs(19, spread=1.0)
    for name, div in (("dph_f", "forward_kl"), ("dph_js", "js"), ("dph_alpha", "alpha")):
        m = get_method(name)
        lp = i["lp"].clone().requires_grad_(True)
        total, metrics = m.loss(anchor=AnchorInputs(lp, i["ref"], i["mask"]))
        total.backward()
        lp2 = i["lp"].clone().requires_grad_(True)
        want = m.anchor_weight * ref_dph(lp2, i["ref"], i["mask"], div, m.hparams.get("anchor_alpha", 0.5)).sum() \
            / i["mask"].sum()
        want.backward()
        assert float(total.detach()) == pytest.approx(float(want.detach()), rel=1e-12)
        assert_close(lp.grad, lp2.grad)


def test_registry_masked_garbage_changes_nothing():
    m = get_method("rkl")
    i = inputs(11)
    outs = []
    for fill in (0.0, float("nan"), float("inf")):
        j = {k: v.clone() for k, v in i.items()}
        off = j["mask"] == 0
        for k in ("lp", "old", "ref", "A"):
            j[k][off] = fill
        lp = j["lp"].requires_grad_(True)
        total, metrics = m.loss(online=LossInputs(lp, j["old"], j["A"], j["mask"], ref_log_probs=j["ref"]))
        total.backward()
        outs.append((float(total.detach()), metrics, lp.grad))
    for t, mt, g in outs[1:]:
        assert t == outs[0][0] and mt == outs[0][1] and torch.equal(g, outs[0][2])


@pytest.mark.parametrize("name", list_methods())
def test_every_method_any_memory_layout_and_bfloat16(name):
    """Column-major (transposed-contiguous) inputs give the same loss and gradient as row-major;
    bfloat16 inputs run and stay close (float32 reference)."""
    over = {"clip_cov_ratio": 0.05, "clip_cov_lb": -1e9, "clip_cov_ub": 1e9} if name == "clip_cov" else {}
    m = get_method(name, **over)
    i = inputs(20, B=6, T=40, spread=0.3, dtype=torch.float32, extremes=False)
    H = torch.rand(6, 40, generator=torch.Generator().manual_seed(2))
    res = {}
    for key in ("rows", "cols", "bf16"):
        j = dict(i, H=H)
        if key == "cols":
            j = {k: v.t().contiguous().t() for k, v in j.items()}
        if key == "bf16":
            j = {k: v.to(torch.bfloat16) for k, v in j.items()}
        lp = j["lp"].detach().requires_grad_(True)
        on = LossInputs(lp, j["old"], j["A"], j["mask"], correct=torch.tensor([1, 0, 1, 0, 1, 0]).bool(),
                        entropy=j["H"].detach().requires_grad_(True), ref_log_probs=j["ref"],
                        log_z=torch.zeros(6, dtype=lp.dtype), generator=torch.Generator().manual_seed(0))
        an = AnchorInputs(lp, j["ref"], j["mask"]) if m.needs.anchor_batch else None
        total, _ = m.loss(online=on, anchor=an)
        total.backward()
        res[key] = (float(total.detach()), lp.grad.float())
    assert res["cols"][0] == pytest.approx(res["rows"][0], rel=1e-5)
    assert torch.allclose(res["cols"][1], res["rows"][1], rtol=1e-5, atol=1e-7)
    assert res["bf16"][0] == pytest.approx(res["rows"][0], rel=0.05, abs=1e-2)


@pytest.mark.slow
def test_compiled_losses_equal_the_plain_ones():
    """``compile_losses(True)`` (torch.compile, dynamic shapes): the same values and gradients,
    also when a method with other float hyperparameters follows (eps_high 0.2 -> 0.28 -> 0.2)."""
    from openrlhf_div.algorithms import compile_losses

    i = {k: v.float() for k, v in inputs(21, extremes=False).items()}
    out = {}
    try:
        for on in (False, True):
            compile_losses(on)
            for name in ("grpo", "rkl", "grpo"):
                lp = i["lp"].clone().requires_grad_(True)
                total, _ = get_method(name).loss(online=LossInputs(lp, i["old"], i["A"], i["mask"],
                                                                   ref_log_probs=i["ref"]))
                total.backward()
                out.setdefault(name, []).append((float(total.detach()), lp.grad))
    finally:
        compile_losses(False)
    for name, runs in out.items():
        plain = runs[: len(runs) // 2]
        compiled = runs[len(runs) // 2:]
        for (v0, g0), (v1, g1) in zip(plain, compiled):
            assert v1 == pytest.approx(v0, rel=1e-6, abs=1e-7), name
            assert torch.allclose(g1, g0, rtol=1e-5, atol=1e-7), name
