"""The controlled bandit (ALGORITHMS.md section 7): analytic targets, the spec's claims, the CLI.

Targets are recomputed here independently from the JSON's own ``pi_old`` / ``pi_ref`` /
``rewards``; the DS closed form is checked against a direct numerical maximisation.
"""
import json
import os

import numpy as np
import pytest
import torch

from openrlhf_div import bandit as B
from openrlhf_div.cli.main import main


def _cli(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


# ------------------------------------------------------------------ the problem and targets
def test_rewards_have_three_separated_modes():
    r = B.bandit_rewards()
    assert r.shape == (50,)
    peaks = [i for i in range(1, 49) if r[i] > r[i - 1] and r[i] > r[i + 1]]
    assert peaks == [8, 25, 41]
    assert r[8] > r[25] > r[41] > 0.5
    # separated: the valleys between the modes are near zero
    assert r[16] < 0.01 and r[33] < 0.01
    ranges = B.bump_ranges()
    assert ranges == [(3, 13), (20, 30), (36, 46)]


def test_lad_target_is_pi_old_times_exp_reward_over_eta():
    g = np.random.default_rng(0)
    pi_old = g.dirichlet(np.ones(50))
    r = B.bandit_rewards()
    for eta in (0.25, 1.0, 3.0):
        q = pi_old * np.exp(r / eta)
        np.testing.assert_allclose(B.lad_target(pi_old, r, eta), q / q.sum(), rtol=1e-12)
        # the baseline E_{pi_old}[R] of A = R - E[R] cancels in the normalisation
        np.testing.assert_allclose(B.lad_target(pi_old, r - (pi_old * r).sum(), eta), q / q.sum(), rtol=1e-10)


def test_ds_closed_form_is_the_kl_regularised_optimum():
    """Lemma B.5, checked by maximising E_pi[R'] - beta KL(pi||pi_ref) numerically."""
    K = 50
    pi_ref = B.reference_policy(K, 1.0, 7)
    r = B.bandit_rewards(K)
    correct = r >= 0.5 * r.max()
    beta, gp, gn = 0.7, 0.3, 0.2
    r_shaped = np.where(correct, r - gp * np.log(pi_ref), r + gn * np.log(pi_ref))
    theta = torch.zeros(K, dtype=torch.float64, requires_grad=True)
    R_t, lref = torch.tensor(r_shaped), torch.tensor(np.log(pi_ref))
    opt = torch.optim.LBFGS([theta], max_iter=1000, tolerance_grad=1e-12, tolerance_change=1e-15,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        lp = torch.log_softmax(theta, 0)
        obj = (lp.exp() * R_t).sum() - beta * (lp.exp() * (lp - lref)).sum()
        (-obj).backward()
        return -obj

    opt.step(closure)
    numeric = torch.softmax(theta, 0).detach().numpy()
    closed = B.ds_target(pi_ref, r, correct, beta, gp, gn)
    assert B.tv_distance(numeric, closed) < 1e-5
    # and it is not the plain-KL optimum
    assert B.tv_distance(closed, B.lad_target(pi_ref, r, beta)) > 0.1


def test_tv_and_modes_kept():
    ranges = B.bump_ranges()
    assert B.modes_kept(np.full(50, 0.02), ranges) == 3
    one = np.zeros(50)
    one[8] = 1.0
    assert B.modes_kept(one, ranges) == 1
    p = np.full(50, 0.0)
    p[8], p[25], p[41], p[0] = 0.5, 0.06, 0.04, 0.4   # the third holds 4% < 5%
    assert B.modes_kept(p, ranges, 0.05) == 2
    assert B.modes_kept(p, ranges, 0.03) == 3
    assert B.tv_distance(one, np.full(50, 0.02)) == pytest.approx(0.98)


# ------------------------------------------------------------------ exact expectation: the library's fixed points
@pytest.mark.parametrize("method", ["lad_js", "lad_kl", "lad_reverse_kl", "lad_jeffreys", "lad_hellinger"])
def test_lad_exact_expectation_reaches_its_analytic_target(method):
    """Without sampling noise every strictly convex LAD divergence lands on pi_old e^{A/eta}/Z,
    phase after phase (one refresh here)."""
    cfg = B.BanditConfig(steps=400, refreshes=1, exact_expectation=True, lr=5e-2)
    res = B.run_bandit(method, cfg)
    pi_old, r = np.array(res["pi_old"]), np.array(res["rewards"])
    assert B.tv_distance(pi_old, np.full(50, 0.02)) > 0.05        # the refresh happened
    q = pi_old * np.exp(r / res["eta"])
    assert B.tv_distance(res["policy"], q / q.sum()) < 1e-3
    assert res["tv"] < 1e-3


@pytest.mark.parametrize("method,plain_min", [("ds_grpo", 0.5), ("ds_positive", 0.3), ("ds_negative", 0.2)])
def test_ds_exact_expectation_matches_closed_form(method, plain_min):
    cfg = B.BanditConfig(steps=400, exact_expectation=True, lr=5e-2)
    res = B.run_bandit(method, cfg)
    pi_ref, r, c = np.array(res["pi_ref"]), np.array(res["rewards"]), np.array(res["correct"])
    assert c.sum() == int((r >= 0.5 * r.max()).sum())
    beta, gp, gn = res["beta"], res["gamma_p"], res["gamma_n"]
    if method == "ds_positive":
        assert gn == 0.0 and gp > 0
    if method == "ds_negative":
        assert gp == 0.0 and gn > 0
    expo = np.where(c, 1 - gp / beta, 1 + gn / beta)
    q = pi_ref ** expo * np.exp(r / beta)
    assert B.tv_distance(res["policy"], q / q.sum()) < 5e-3
    assert res["tv_plain_kl"] > plain_min


def test_ds_sampled_matches_closed_form_better_than_plain_kl():
    res = B.run_bandit("ds_grpo", B.BanditConfig(steps=1500))
    assert res["tv"] < 0.1
    assert res["tv_plain_kl"] > 5 * res["tv"]
    assert res["modes_kept"] == 3


def test_the_losses_come_from_the_library(monkeypatch):
    """Replace the registry's LAD loss by a zero loss: the policy must not move."""
    from openrlhf_div.algorithms import components

    monkeypatch.setattr(components, "lad_loss", lambda lp, *a, **k: lp * 0.0)  # the "lad" component calls it
    res = B.run_bandit("lad_js", B.BanditConfig(steps=50))
    np.testing.assert_allclose(res["policy"], np.full(50, 0.02), atol=1e-12)


# ------------------------------------------------------------------ the spec's claims (sampled, 32 per step)
@pytest.fixture(scope="module")
def default_runs():
    """LAD-JS and GRPO-without-clip on the real default settings (4000 steps, seed 0)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)   # 50-element tensors: threads only add overhead
    try:
        return {m: B.run_bandit(m, B.BanditConfig()) for m in ("lad_js", "grpo_noclip")}
    finally:
        torch.set_num_threads(n)


@pytest.mark.slow
def test_lad_js_default_settings_match_target_and_keep_modes(default_runs):
    res = default_runs["lad_js"]
    assert res["steps"] == 4000 and res["batch"] == 32 and res["temperature"] == 1.5
    assert res["lr"] == 5e-3 and res["refreshes"] == 2 and res["eta"] == 1.0
    pi_old, r = np.array(res["pi_old"]), np.array(res["rewards"])
    q = pi_old * np.exp(r)
    tv = B.tv_distance(res["policy"], q / q.sum())
    assert tv == pytest.approx(res["tv"])
    assert tv < 0.02
    assert res["modes_kept"] == 3
    assert min(res["mode_shares"]) > 0.1
    # three phases, each matched: the end point is uniform * e^{3R} / Z
    assert res["tv_end_target"] < 0.03


@pytest.mark.slow
def test_grpo_without_clip_concentrates(default_runs):
    lad, g = default_runs["lad_js"], default_runs["grpo_noclip"]
    assert g["tv"] > 5 * lad["tv"]
    assert g["modes_kept"] < lad["modes_kept"]
    assert g["max_prob"] > 2 * lad["max_prob"]
    assert g["mode_shares"][0] > 0.7


@pytest.mark.slow
def test_grpo_with_clip_is_held_back_by_the_clip(default_runs):
    """The spec's GRPO (PPO-clip 0.2, KL 1 to pi_old): each phase moves an arm's ratio by at
    most ~1.2, so after three phases it is far from LAD's end point, with a *lower* max prob."""
    lad = default_runs["lad_js"]
    g = B.run_bandit("grpo", B.BanditConfig(steps=900))
    assert g["tv"] > 5 * lad["tv"]
    assert g["tv_end_target"] > 0.15
    assert g["max_prob"] < 0.02 * 1.25 ** 3 < lad["max_prob"]
    assert g["max_prob"] > 0.02 * 1.1 ** 3


# ------------------------------------------------------------------ CLI
def test_cli_json_schema_and_plot(tmp_path, capsys):
    j, p = tmp_path / "out" / "r.json", tmp_path / "r.png"
    rc, out, _ = _cli(["bandit", "--method", "lad_js", "--steps", "60", "--seed", "3", "--eta", "0.5",
                       "--json", str(j), "--plot", str(p), "--no-progress"], capsys)
    assert rc == 0
    assert "lad_js" in out and "TV to target" in out
    d = json.loads(j.read_text())
    for key in ("method", "eta", "rewards", "pi_old", "policy", "target", "tv", "steps", "seed",
                "modes_kept", "mode_shares", "max_prob"):
        assert key in d, key
    assert d["method"] == "lad_js" and d["eta"] == 0.5 and d["steps"] == 60 and d["seed"] == 3
    for key in ("rewards", "pi_old", "policy", "target"):
        assert len(d[key]) == 50
    for key in ("pi_old", "policy", "target"):
        assert sum(d[key]) == pytest.approx(1.0)
    assert d["tv"] == pytest.approx(B.tv_distance(d["policy"], d["target"]))
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [f for f in os.listdir(tmp_path / "out") if f.startswith(".tmp")]


def test_cli_ds_json_has_both_targets(tmp_path, capsys):
    j = tmp_path / "ds.json"
    rc, _, _ = _cli(["bandit", "--method", "ds_grpo", "--steps", "20", "--json", str(j), "--no-progress"], capsys)
    assert rc == 0
    d = json.loads(j.read_text())
    for key in ("pi_ref", "correct", "plain_kl_target", "tv_plain_kl", "beta", "gamma_p", "gamma_n"):
        assert key in d, key
    assert d["tv_plain_kl"] == pytest.approx(B.tv_distance(d["policy"], d["plain_kl_target"]))


def test_cli_same_seed_same_json(tmp_path, capsys):
    paths = [tmp_path / f"{i}.json" for i in range(3)]
    for path, seed in zip(paths, (5, 5, 6)):
        assert _cli(["bandit", "--method", "grpo", "--steps", "150", "--seed", str(seed),
                     "--json", str(path), "--no-progress"], capsys)[0] == 0
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert json.loads(paths[0].read_text())["policy"] != json.loads(paths[2].read_text())["policy"]


def test_cli_all_writes_everything(tmp_path, capsys):
    out_dir = tmp_path / "bandit"
    rc, out, _ = _cli(["bandit", "--all", "--out", str(out_dir), "--steps", "8", "--workers", "1",
                       "--no-progress"], capsys)
    assert rc == 0
    names = set(os.listdir(out_dir))
    for m in B.BANDIT_METHODS:
        assert f"{m}.json" in names and f"{m}.png" in names
        assert m in out
    assert {"summary.json", "summary.md"} <= names
    s = json.loads((out_dir / "summary.json").read_text())
    assert [row["method"] for row in s["rows"]] == list(B.BANDIT_METHODS)
    for row in s["rows"]:
        per = json.loads((out_dir / f"{row['method']}.json").read_text())
        assert row["tv"] == per["tv"] and row["modes_kept"] == per["modes_kept"]
    md = (out_dir / "summary.md").read_text()
    assert md.count("\n| ") == len(B.BANDIT_METHODS) + 1   # header + one row per method
    assert "| lad_js |" in md and "TV to target" in md and "modes kept" in md


@pytest.mark.parametrize("bad", ["nope", "dph_js", "lad_jss"])
def test_cli_unknown_method_lists_bandit_methods(bad, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bandit", "--method", bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"unknown bandit method '{bad}'" in err
    for m in B.BANDIT_METHODS:
        assert m in err
    if bad == "lad_jss":
        assert "Did you mean 'lad_js'" in err


@pytest.mark.parametrize("steps", ["0", "-3", "ten"])
def test_cli_bad_steps(steps, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bandit", "--method", "lad_js", "--steps", steps])
    assert e.value.code == 2
    assert "--steps must be a positive integer" in capsys.readouterr().err


def test_cli_needs_method_or_all(capsys):
    with pytest.raises(SystemExit):
        main(["bandit"])
    assert "--method" in capsys.readouterr().err


def test_library_rejects_bad_config():
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        B.run_bandit("lad_js", B.BanditConfig(steps=0))
    with pytest.raises(ValueError, match="eta must be"):
        B.run_bandit("lad_js", B.BanditConfig(eta=-1.0))
    with pytest.raises(ValueError, match="Valid bandit methods"):
        B.run_bandit("ppo", B.BanditConfig(steps=5))
