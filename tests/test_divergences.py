"""f-divergence generators, DPH anchor losses and KL estimators against ALGORITHMS.md 4-5.

Every reference here is written from the spec text in float64 with ``math`` and plain
loops; nothing in this file calls the code under test to build an expected value.
"""
import math

import pytest
import torch

from openrlhf_div.algorithms import dph_anchor_loss, f_divergence, get_method, kl_estimate
from openrlhf_div.algorithms.losses import dph_js_def_loss

LOG2 = math.log(2.0)


# ------------------------------------------------------------------ references (spec text)
def clamp(v, lo, hi):
    return max(lo, min(hi, v))


def ref_generator(name, log_u, alpha=None):
    """``f(u)`` of ALGORITHMS.md's tables; ``log u`` is clamped to [-20, 20] first (spec:
    every exp of a log-ratio clamps its exponent)."""
    lu = clamp(log_u, -20.0, 20.0)
    u = math.exp(lu)
    if name == "kl":
        return u * lu
    if name == "reverse_kl":
        return -lu
    if name == "jeffreys":
        return (u - 1.0) * lu
    if name == "tv":
        return abs(u - 1.0)
    if name == "hellinger":
        return 0.5 * (math.sqrt(u) - 1.0) ** 2
    if name == "js":
        return 0.5 * (u * lu - (u + 1.0) * math.log((u + 1.0) / 2.0))
    if name == "dph_forward_kl":
        return clamp(u - 1.0 - lu, -10.0, 10.0)
    if name == "dph_js":
        return u * lu - (u + 1.0) * math.log((u + 1.0) / 2.0)
    if name == "dph_alpha":
        a = alpha
        return (u ** (1.0 - a) - (1.0 - a) * u - a) / (a * (a - 1.0))
    raise AssertionError(name)


ALL_NAMES = ["kl", "reverse_kl", "jeffreys", "tv", "hellinger", "js",
             "dph_forward_kl", "dph_js", "dph_alpha"]
LOG_U_GRID = [-60.0, -25.0, -20.0, -12.0, -3.0, -1.0, -0.3, -1e-3, 0.0, 1e-3, 0.2, 0.7,
              1.5, 2.3, 4.0, 9.0, 19.5, 20.0, 33.0, 60.0]


def t64(x):
    return torch.tensor(x, dtype=torch.float64)


def assert_close_list(got, want, rtol=1e-9, atol=1e-10):
    got = [float(g) for g in got]
    for g, w in zip(got, want):
        assert math.isfinite(g), (got, want)
        assert abs(g - w) <= atol + rtol * abs(w), f"got {g}, want {w}\nall got {got}\nall want {want}"


# ------------------------------------------------------------------ f_divergence
@pytest.mark.parametrize("name", ALL_NAMES)
def test_f_divergence_matches_spec_tables(name):
    alpha = 0.5 if name == "dph_alpha" else None
    got = f_divergence(name, t64(LOG_U_GRID), alpha=alpha)
    assert got.dtype == torch.float64 and got.shape == (len(LOG_U_GRID),)
    want = [ref_generator(name, lu, alpha) for lu in LOG_U_GRID]
    assert_close_list(got, want)


@pytest.mark.parametrize("alpha", [0.1, 0.3, 0.77, 0.95])
def test_f_divergence_alpha_values(alpha):
    got = f_divergence("dph_alpha", t64(LOG_U_GRID), alpha=alpha)
    assert_close_list(got, [ref_generator("dph_alpha", lu, alpha) for lu in LOG_U_GRID])


@pytest.mark.parametrize("name", ALL_NAMES)
def test_generators_vanish_at_one(name):
    # every f-divergence generator has f(1) = 0
    got = f_divergence(name, t64([0.0]), alpha=0.5 if name == "dph_alpha" else None)
    assert float(got[0]) == pytest.approx(0.0, abs=1e-15)


def test_divergence_estimates_on_discrete_distributions():
    """The 'divergence it estimates' column: E_{y~pi_ref} f(pi_theta/pi_ref)."""
    g = torch.Generator().manual_seed(3)
    p_ref = torch.softmax(torch.randn(12, generator=g, dtype=torch.float64), 0).tolist()
    p_th = torch.softmax(torch.randn(12, generator=g, dtype=torch.float64), 0).tolist()
    log_u = t64([math.log(q / p) for p, q in zip(p_ref, p_th)])

    def expect(name, alpha=None):
        f = f_divergence(name, log_u, alpha=alpha).tolist()
        return sum(p * fv for p, fv in zip(p_ref, f))

    kl_ref_th = sum(p * math.log(p / q) for p, q in zip(p_ref, p_th))  # forward KL
    kl_th_ref = sum(q * math.log(q / p) for p, q in zip(p_ref, p_th))  # reverse KL
    mix = [(p + q) / 2 for p, q in zip(p_ref, p_th)]
    js = 0.5 * sum(p * math.log(p / m) for p, m in zip(p_ref, mix)) + \
        0.5 * sum(q * math.log(q / m) for q, m in zip(p_th, mix))
    assert expect("dph_forward_kl") == pytest.approx(kl_ref_th, rel=1e-10)
    assert expect("dph_js") == pytest.approx(2 * js, rel=1e-10)
    # alpha -> 1 forward KL, alpha -> 0 reverse KL (first-order error in the distance)
    assert expect("dph_alpha", 1 - 1e-5) == pytest.approx(kl_ref_th, rel=1e-3)
    assert expect("dph_alpha", 1e-5) == pytest.approx(kl_th_ref, rel=1e-3)


def test_dph_alpha_tends_to_forward_kl_as_alpha_to_one():
    grid = [-5.0, -2.0, -0.5, -0.01, 0.01, 0.4, 1.0, 2.0]  # unclamped range of dph_forward_kl
    near = f_divergence("dph_alpha", t64(grid), alpha=1 - 1e-4).tolist()
    fkl = [math.exp(lu) - 1 - lu for lu in grid]
    assert all(v < 10 for v in fkl)
    for a, b in zip(near, fkl):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-9)
    # and the code's dph_forward_kl agrees with both
    code_fkl = f_divergence("dph_forward_kl", t64(grid)).tolist()
    for a, b in zip(code_fkl, fkl):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-15)


def test_dph_alpha_tends_to_reverse_kl_generator_as_alpha_to_zero():
    # Pointwise, alpha -> 0 gives f(u) = u log u - u + 1, the generator whose expectation under
    # pi_ref is KL(pi_theta || pi_ref) (the spec's "reverse KL"). Note it is NOT -log u
    # pointwise (that is forward KL's generator up to the u - 1 term); the expectation test
    # above checks the divergence itself.
    grid = [-3.0, -1.0, -0.2, -0.01, 0.01, 0.3, 1.0, 2.0]
    near = f_divergence("dph_alpha", t64(grid), alpha=1e-4).tolist()
    for lu, v in zip(grid, near):
        u = math.exp(lu)
        assert v == pytest.approx(u * lu - u + 1, rel=2e-3, abs=1e-9)


# ------------------------------------------------------------------ dph_anchor_loss
def _tok(g, B=3, T=6, scale=1.0):
    return (scale * torch.randn(B, T, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("div,gen,alpha", [("forward_kl", "dph_forward_kl", None),
                                           ("js", "dph_js", None),
                                           ("alpha", "dph_alpha", 0.5),
                                           ("alpha", "dph_alpha", 0.2)])
def test_dph_anchor_loss_values(div, gen, alpha):
    g = torch.Generator().manual_seed(11)
    ref = -torch.rand(3, 6, generator=g, dtype=torch.float64) * 3
    lp = ref + _tok(g, scale=4.0)  # log u up to ~ +-12: hits forward_kl's clamp
    lp[0, 0] = ref[0, 0] + 30.0   # beyond the +-20 clamp
    lp[0, 1] = ref[0, 1] - 30.0
    mask = torch.ones(3, 6, dtype=torch.float64)
    mask[1, 4:] = 0
    mask[2, 5] = 0
    kw = {} if alpha is None else {"alpha": alpha}
    got = dph_anchor_loss(lp, ref, mask, divergence=div, **kw)
    for b in range(3):
        for t in range(6):
            want = 0.0 if mask[b, t] == 0 else ref_generator(gen, float(lp[b, t] - ref[b, t]), alpha or 0.5)
            assert float(got[b, t]) == pytest.approx(want, rel=1e-9, abs=1e-10)


def test_dph_forward_kl_clamp_and_its_gradient():
    ref = torch.zeros(1, 6, dtype=torch.float64)
    lu = t64([[-15.0, -11.5, -5.0, 0.5, 2.0, 4.0]])
    lp = (ref + lu).requires_grad_(True)
    loss = dph_anchor_loss(lp, ref, torch.ones_like(ref), "forward_kl")
    raw = [math.exp(v) - 1 - v for v in lu[0].tolist()]
    want = [clamp(v, -10, 10) for v in raw]
    assert loss[0].tolist() == pytest.approx(want, rel=1e-12)
    loss.sum().backward()
    # d/dlp (u - 1 - log u) = u - 1 inside the clamp, 0 where the clamp binds
    want_g = [0.0 if r > 10 else math.exp(v) - 1 for r, v in zip(raw, lu[0].tolist())]
    assert lp.grad[0].tolist() == pytest.approx(want_g, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("div", ["forward_kl", "js", "alpha"])
def test_dph_anchor_zero_when_policy_equals_reference(div):
    g = torch.Generator().manual_seed(5)
    ref = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 5
    lp = ref.clone().requires_grad_(True)
    mask = (torch.rand(4, 7, generator=g) > 0.2).double()
    loss = dph_anchor_loss(lp, ref, mask, div)
    loss.sum().backward()
    assert torch.all(loss.abs() < 1e-15)
    assert torch.all(lp.grad.abs() < 1e-12)


@pytest.mark.parametrize("div,alpha", [("forward_kl", None), ("js", None), ("alpha", 0.5), ("alpha", 0.8)])
def test_dph_anchor_gradient_formula(div, alpha):
    """d f(u) / d lp = u f'(u): forward KL u - 1; JS u log(2u/(u+1)); alpha (u - u^(1-a)) / a."""
    g = torch.Generator().manual_seed(8)
    ref = -torch.rand(2, 5, generator=g, dtype=torch.float64) * 3
    lp = (ref + _tok(g, 2, 5, scale=1.0)).requires_grad_(True)
    kw = {} if alpha is None else {"alpha": alpha}
    dph_anchor_loss(lp, ref, torch.ones_like(ref), div, **kw).sum().backward()
    for b in range(2):
        for t in range(5):
            lu = float(lp[b, t].detach() - ref[b, t])
            u = math.exp(lu)
            if div == "forward_kl":
                want = u - 1
            elif div == "js":
                want = u * math.log(2 * u / (u + 1))
            else:
                want = (u - u ** (1 - alpha)) / alpha
            assert float(lp.grad[b, t]) == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_dph_anchor_does_not_backprop_into_reference():
    g = torch.Generator().manual_seed(1)
    ref = (-torch.rand(2, 4, generator=g, dtype=torch.float64)).requires_grad_(True)
    lp = (-torch.rand(2, 4, generator=g, dtype=torch.float64)).requires_grad_(True)
    dph_anchor_loss(lp, ref, torch.ones(2, 4, dtype=torch.float64), "js").sum().backward()
    assert ref.grad is None or torch.all(ref.grad == 0)


# ------------------------------------------------------------------ dph_js_def_loss
def test_dph_js_def_both_sides():
    g = torch.Generator().manual_seed(21)
    ref = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 4
    lp = ref + _tok(g, 3, 5, scale=2.0)
    mask = torch.ones(3, 5, dtype=torch.float64)
    mask[2, 3:] = 0
    anchor = dph_js_def_loss(lp, ref, mask, on="anchor")
    online = dph_js_def_loss(lp, ref, mask, on="online")
    for b in range(3):
        for t in range(5):
            r, p = float(ref[b, t]), float(lp[b, t])
            log_m = math.log(0.5 * (math.exp(r) + math.exp(p)))
            da, do = log_m - r, log_m - p
            wa = math.exp(da) - da - 1  # estimates KL(pi_ref || M)
            wo = math.exp(do) - do - 1  # estimates KL(pi_theta || M)
            if mask[b, t] == 0:
                wa = wo = 0.0
            assert float(anchor[b, t]) == pytest.approx(wa, rel=1e-9, abs=1e-13)
            assert float(online[b, t]) == pytest.approx(wo, rel=1e-9, abs=1e-13)


def test_dph_js_def_sum_of_halves_is_js_on_discrete_distributions():
    # E_ref[KL-estimator(ref||M)] + E_theta[KL-estimator(theta||M)] = 2 JS(ref, theta)
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(9, generator=g, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(9, generator=g, dtype=torch.float64), 0)
    lp, ref = q.log().unsqueeze(0), p.log().unsqueeze(0)
    ones = torch.ones_like(lp)
    a = float((p * dph_js_def_loss(lp, ref, ones, on="anchor")[0]).sum())
    o = float((q * dph_js_def_loss(lp, ref, ones, on="online")[0]).sum())
    m = 0.5 * (p + q)
    js = 0.5 * float((p * (p / m).log()).sum()) + 0.5 * float((q * (q / m).log()).sum())
    assert a + o == pytest.approx(2 * js, rel=1e-10)


def test_dph_js_def_gradcheck_and_zero_at_reference():
    g = torch.Generator().manual_seed(2)
    ref = -torch.rand(2, 4, generator=g, dtype=torch.float64) * 3
    lp = (ref + _tok(g, 2, 4)).requires_grad_(True)
    mask = torch.ones(2, 4, dtype=torch.float64)
    for side in ("anchor", "online"):
        assert torch.autograd.gradcheck(lambda x: dph_js_def_loss(x, ref, mask, on=side), (lp,))
        same = ref.clone().requires_grad_(True)
        l = dph_js_def_loss(same, ref, mask, on=side)
        l.sum().backward()
        assert torch.all(l.abs() < 1e-15) and torch.all(same.grad.abs() < 1e-12)


# ------------------------------------------------------------------ KL estimators
def test_kl_estimators_k1_k2_k3():
    g = torch.Generator().manual_seed(9)
    ref = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3
    lp = ref + _tok(g, 3, 5, scale=3.0)
    lp[0, 0] = ref[0, 0] - 40.0  # k3 clamp at 10 and log-ratio clamp at 20
    lp[0, 1] = ref[0, 1] + 40.0
    mask = torch.ones(3, 5, dtype=torch.float64)
    mask[1, 2] = 0
    for est in ("k1", "k2", "k3"):
        got = kl_estimate(lp, ref, mask, est)
        for b in range(3):
            for t in range(5):
                lr = clamp(float(lp[b, t] - ref[b, t]), -20, 20)
                want = {"k1": lr, "k2": 0.5 * lr * lr,
                        # spec: k3 = exp(ref - lp) - (ref - lp) - 1, clamped to [-10, 10]
                        "k3": clamp(math.exp(-lr) + lr - 1, -10, 10)}[est]
                if mask[b, t] == 0:
                    want = 0.0
                assert float(got[b, t]) == pytest.approx(want, rel=1e-10, abs=1e-13), (est, b, t)


# ------------------------------------------------------------------ bad input
def test_unknown_divergence_names_list_valid_ones():
    with pytest.raises(ValueError) as e:
        f_divergence("jensen", t64([0.0]))
    for n in ALL_NAMES:
        assert n in str(e.value)
    with pytest.raises(ValueError) as e:
        dph_anchor_loss(t64([[0.0]]), t64([[0.0]]), t64([[1.0]]), divergence="kl")
    for n in ("forward_kl", "js", "alpha"):
        assert n in str(e.value)
    with pytest.raises(ValueError) as e:
        kl_estimate(t64([[0.0]]), t64([[0.0]]), None, "k4")
    for n in ("k1", "k2", "k3"):
        assert n in str(e.value)
    with pytest.raises(ValueError) as e:
        dph_js_def_loss(t64([[0.0]]), t64([[0.0]]), t64([[1.0]]), on="both")
    assert "anchor" in str(e.value) and "online" in str(e.value)


@pytest.mark.parametrize("alpha", [0.0, 1.0, 1.5, -0.3, None])
def test_alpha_outside_open_unit_interval_is_refused(alpha):
    x = t64([[0.1, -0.2]])
    with pytest.raises(ValueError, match="alpha"):
        f_divergence("dph_alpha", x, alpha=alpha)
    if alpha is not None:
        with pytest.raises(ValueError, match="alpha"):
            dph_anchor_loss(x, x * 0, torch.ones_like(x), "alpha", alpha=alpha)
        with pytest.raises(ValueError, match="alpha"):
            get_method("dph_alpha", anchor_alpha=alpha)


def test_shape_mismatch_names_the_tensor():
    lp = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="ref_log_probs"):
        dph_anchor_loss(lp, torch.zeros(2, 4, dtype=torch.float64), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        dph_anchor_loss(lp, lp, torch.ones(3, 3))
    with pytest.raises(ValueError, match="ref_log_probs"):
        kl_estimate(lp, torch.zeros(2, 2, dtype=torch.float64), None)
    with pytest.raises(ValueError, match="mask"):
        dph_js_def_loss(lp, lp, torch.ones(2, 2))
