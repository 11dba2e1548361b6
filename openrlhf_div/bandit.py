"""The controlled 50-arm bandit (ALGORITHMS.md section 7; LAD Figure 1, DS Lemma B.5).

Pure torch + numpy (matplotlib only for :func:`plot_result`). Every loss comes from the
algorithm library through :func:`openrlhf_div.algorithms.get_method`; each sampled arm is a
length-1 "sequence", so the per-token tensors are ``[B, 1]``.

The problem
-----------
* ``K = 50`` arms, policy ``pi = softmax(theta)``, ``theta`` a free 50-vector.
* Reward ``R(a)``: a mixture of three well separated Gaussian bumps over the arm index
  (:data:`BUMPS`: centres 8, 25, 41, widths 2.5, heights 1.0 / 0.8 / 0.6), three modes.
* Each step draws ``B = 32`` arms from the behaviour policy at temperature ``T = 1.5``,
  ``mu = softmax(theta_old / T)``, and weights each sample by ``w = pi_old(a) / mu(a)``
  (importance weight back to ``pi_old``). The step loss is ``mean_i w_i l(a_i)``, an unbiased
  estimate of ``E_{pi_old}[l]``. Adam, lr ``5e-3``, 4000 steps.
* ``pi_old`` is refreshed to the current policy ``refreshes = 2`` times (3 equal phases).

LAD (``lad_<divergence>``)
    Advantage ``A(a) = R(a) - E_{pi_old}[R]`` (exact expectation over the 50 arms, no std
    division), loss :func:`~openrlhf_div.algorithms.lad_loss` via the method's
    ``online_loss`` with ``lad_eta = eta``. Over the simplex, ``E_{pi_old}[l]`` is the
    f-divergence between ``pi`` and the unnormalised ``pi_old exp(A / eta)``, minimised by

        ``pi*(a) = pi_old(a) exp(R(a) / eta) / Z``        (the "LAD target")

    for every strictly convex ``f`` (``tv`` has a set of minimisers containing it).

GRPO (``grpo``)
    The method's own group-normalised advantages ``(R_i - mean R) / (std R + 1e-6)`` over the
    32 samples, PPO-clip 0.2/0.2 (dual clip 3), plus the exact ``eta * KL(pi || pi_old)``
    (``eta = 1``: weight 1, as in the paper). With *unnormalised* advantages its optimum
    would be the LAD target; the std division lowers its effective temperature and the
    clip limits each phase's move (ratio ~1 +- 0.2 per phase). Two controls separate the
    effects: ``grpo_noclip`` (same, clip range widened to 1e9, no dual clip) and
    ``dr_grpo_noclip`` (``R_i - mean R``, no std division, no clip), whose optimum is the
    LAD target (up to the ``(G-1)/G`` factor of a batch mean that includes the sample).

DS (``ds_grpo``, ``ds_positive``, ``ds_negative``), the check of DS Lemma B.5
    Maximising ``E_pi[R'] - beta KL(pi || pi_ref)`` with the DS reward
    ``R' = R - gamma_p log pi_ref`` on the correct set ``C`` and ``R + gamma_n log pi_ref``
    off it has the closed form

        ``pi*(a) ∝ pi_ref(a)^(1 - gamma_p/beta) exp(R/beta)`` on ``C``,
        ``pi*(a) ∝ pi_ref(a)^(1 + gamma_n/beta) exp(R/beta)`` off ``C``   (the "DS target").

    Set-up (uniform ``pi_ref`` would make the DS terms constant): ``pi_ref`` is a fixed
    non-uniform softmax (logits ``N(0, ds_ref_scale^2)`` drawn with ``ds_ref_seed``) and the
    initial policy; ``C = {a : R(a) >= 0.5 max R}`` (the method's ``is_correct`` with
    ``correct_threshold = 0.5 max R``); ``beta = eta``; ``gamma_p = gamma_n = 0.5`` by default
    (``ds_positive``: ``gamma_n = 0``; ``ds_negative``: ``gamma_p = 0``). Advantages
    ``R - E_{pi_old}[R]`` reshaped by :func:`~openrlhf_div.algorithms.ds_reshape_advantages`
    with the *reference's* log-prob (the theory's form), PPO-clip loss from the method, exact
    ``beta KL(pi || pi_ref)``, and ``pi_old`` refreshed every ``ds_refresh_every = 1`` steps
    so the clip never binds and the surrogate gradient is ``grad E_pi[A']``. Both the DS
    target and the plain-KL target ``pi_ref exp(R/beta) / Z`` are reported; the check passes
    when the policy is much closer to the first.

"Modes kept": a bump is kept when the arms within ``2 sigma`` of its centre hold at least
``mode_share = 5%`` of the policy mass.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from openrlhf_div.algorithms import (
    LossInputs,
    ds_reshape_advantages,
    get_method,
)
from openrlhf_div.io import apply_umask_mode, atomic_write_bytes

LAD_BANDIT_METHODS: Tuple[str, ...] = (
    "lad_js", "lad_kl", "lad_reverse_kl", "lad_jeffreys", "lad_tv", "lad_hellinger",
)
DS_BANDIT_METHODS: Tuple[str, ...] = ("ds_grpo", "ds_positive", "ds_negative")
# ``grpo`` is the spec's (PPO-clip 0.2); the two no-clip controls separate the clip's effect
# from the std normalisation's (see the module docstring).
GRPO_BANDIT_METHODS: Tuple[str, ...] = ("grpo", "grpo_noclip", "dr_grpo_noclip")
BANDIT_METHODS: Tuple[str, ...] = LAD_BANDIT_METHODS + GRPO_BANDIT_METHODS + DS_BANDIT_METHODS
_NO_CLIP = {"eps_low": 1e9, "eps_high": 1e9, "dual_clip": None}

# (centre, width sigma, height) of the three reward bumps over the arm index of 50 arms.
BUMPS: Tuple[Tuple[float, float, float], ...] = ((8.0, 2.5, 1.0), (25.0, 2.5, 0.8), (41.0, 2.5, 0.6))
DEFAULT_ARMS = 50


@dataclass
class BanditConfig:
    """Every knob of the experiment; the defaults are LAD's Figure 1 set-up (section 7)."""

    steps: int = 4000
    seed: int = 0
    eta: float = 1.0               # LAD eta = GRPO's KL weight = DS beta
    n_arms: int = DEFAULT_ARMS
    batch: int = 32
    temperature: float = 1.5
    lr: float = 5e-3
    refreshes: int = 2             # pi_old refreshed this many times: refreshes + 1 phases
    exact_expectation: bool = False  # all arms weighted by pi_old instead of 32 samples
    mode_share: float = 0.05
    # DS mode
    ds_gamma_p: float = 0.5
    ds_gamma_n: float = 0.5
    ds_ref_scale: float = 1.0
    ds_ref_seed: int = 1234
    ds_refresh_every: int = 1
    ds_correct_frac: float = 0.5
    record_every: int = 100

    def validate(self) -> None:
        def _int(name, lo):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")

        _int("steps", 1)
        _int("n_arms", 2)
        _int("batch", 1)
        _int("refreshes", 0)
        _int("ds_refresh_every", 1)
        _int("record_every", 1)
        for name in ("eta", "temperature", "lr"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        for name in ("ds_gamma_p", "ds_gamma_n", "ds_ref_scale"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not 0 < self.mode_share < 1:
            raise ValueError(f"mode_share must be in (0, 1), got {self.mode_share!r}")
        if not 0 < self.ds_correct_frac <= 1:
            raise ValueError(f"ds_correct_frac must be in (0, 1], got {self.ds_correct_frac!r}")
        if self.refreshes >= self.steps:
            raise ValueError(f"refreshes ({self.refreshes}) must be < steps ({self.steps})")


def check_method(name: str) -> str:
    """``name`` if it is a bandit method, else a ValueError listing the valid ones."""
    if name not in BANDIT_METHODS:
        import difflib

        close = difflib.get_close_matches(str(name), BANDIT_METHODS, n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(
            f"unknown bandit method {name!r}.{hint} Valid bandit methods: {', '.join(BANDIT_METHODS)}"
        )
    return name


# ------------------------------------------------------------------ the problem
def _scaled_bumps(n_arms: int) -> List[Tuple[float, float, float]]:
    s = (n_arms - 1) / (DEFAULT_ARMS - 1)
    return [(c * s, max(w * s, 0.5), h) for c, w, h in BUMPS]


def bandit_rewards(n_arms: int = DEFAULT_ARMS) -> np.ndarray:
    """``R(a) = sum_k h_k exp(-(a - c_k)^2 / (2 s_k^2))`` over arm indices (bumps scaled
    to ``n_arms``)."""
    a = np.arange(n_arms, dtype=np.float64)
    r = np.zeros(n_arms)
    for c, w, h in _scaled_bumps(n_arms):
        r += h * np.exp(-0.5 * ((a - c) / w) ** 2)
    return r


def bump_ranges(n_arms: int = DEFAULT_ARMS) -> List[Tuple[int, int]]:
    """Inclusive arm ranges ``[c - 2 s, c + 2 s]`` of the three bumps."""
    out = []
    for c, w, _ in _scaled_bumps(n_arms):
        out.append((max(0, int(math.ceil(c - 2 * w))), min(n_arms - 1, int(math.floor(c + 2 * w)))))
    return out


def reference_policy(n_arms: int, scale: float, seed: int) -> np.ndarray:
    """The DS mode's fixed non-uniform ``pi_ref = softmax(N(0, scale^2) logits)``."""
    g = np.random.default_rng(seed)
    z = g.normal(0.0, scale, size=n_arms)
    return _softmax_np(z)


def _softmax_np(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


def lad_target(pi_old: np.ndarray, rewards: np.ndarray, eta: float) -> np.ndarray:
    """``pi_old exp(A / eta) / Z`` with ``A = R - E_{pi_old}[R]`` (= ``pi_old exp(R/eta) / Z``)."""
    return _softmax_np(np.log(np.asarray(pi_old, dtype=np.float64)) + np.asarray(rewards) / eta)


def ds_target(pi_ref: np.ndarray, rewards: np.ndarray, correct: np.ndarray, beta: float,
              gamma_p: float, gamma_n: float) -> np.ndarray:
    """DS Lemma B.5: ``pi_ref^(1 - gamma_p/beta) e^(R/beta)`` on ``C``,
    ``pi_ref^(1 + gamma_n/beta) e^(R/beta)`` off ``C``, normalised."""
    lr = np.log(np.asarray(pi_ref, dtype=np.float64))
    c = np.asarray(correct, dtype=bool)
    expo = np.where(c, 1.0 - gamma_p / beta, 1.0 + gamma_n / beta)
    return _softmax_np(expo * lr + np.asarray(rewards) / beta)


def tv_distance(p: np.ndarray, q: np.ndarray) -> float:
    """Total variation ``0.5 sum |p - q|``."""
    return float(0.5 * np.abs(np.asarray(p, dtype=np.float64) - np.asarray(q, dtype=np.float64)).sum())


def mode_shares(policy: np.ndarray, ranges: Sequence[Tuple[int, int]]) -> List[float]:
    p = np.asarray(policy, dtype=np.float64)
    return [float(p[lo:hi + 1].sum()) for lo, hi in ranges]


def modes_kept(policy: np.ndarray, ranges: Sequence[Tuple[int, int]], share: float = 0.05) -> int:
    """Number of bumps whose arm range holds at least ``share`` of the policy mass."""
    return int(sum(s >= share for s in mode_shares(policy, ranges)))


# ------------------------------------------------------------------ the run
def _method_for(name: str, cfg: BanditConfig, r_max: float):
    if name.startswith("lad_"):
        return get_method(name, lad_eta=float(cfg.eta))
    if name == "grpo":
        return get_method("grpo")
    if name == "grpo_noclip":
        return get_method("grpo", **_NO_CLIP)
    if name == "dr_grpo_noclip":
        return get_method("dr_grpo", **_NO_CLIP)
    thr = cfg.ds_correct_frac * r_max
    if name == "ds_grpo":
        return get_method(name, gamma_p=cfg.ds_gamma_p, gamma_n=cfg.ds_gamma_n, correct_threshold=thr)
    if name == "ds_positive":
        return get_method(name, gamma_p=cfg.ds_gamma_p, correct_threshold=thr)
    return get_method(name, gamma_n=cfg.ds_gamma_n, correct_threshold=thr)


def _kind(name: str) -> str:
    return "lad" if name.startswith("lad_") else ("grpo" if name in GRPO_BANDIT_METHODS else "ds")


def run_bandit(method: str, config: Optional[BanditConfig] = None,
               progress: Optional[Callable[[int], None]] = None) -> Dict:
    """Train one method on the bandit; returns the JSON-ready result dict.

    ``progress(n)`` is called with the number of steps done since the last call.
    """
    cfg = config or BanditConfig()
    check_method(method)
    cfg.validate()
    kind = _kind(method)
    K = cfg.n_arms
    gen = torch.Generator().manual_seed(int(cfg.seed))
    rewards_np = bandit_rewards(K)
    R = torch.tensor(rewards_np, dtype=torch.float64)
    ranges = bump_ranges(K)
    m = _method_for(method, cfg, float(rewards_np.max()))

    if kind == "ds":
        pi_ref_np = reference_policy(K, cfg.ds_ref_scale, cfg.ds_ref_seed)
        log_ref = torch.tensor(np.log(pi_ref_np), dtype=torch.float64)
        theta0 = log_ref - log_ref.mean()
        correct_all = m.is_correct(R)
        refresh_at = set(range(cfg.ds_refresh_every, cfg.steps, cfg.ds_refresh_every))
    else:
        theta0 = torch.zeros(K, dtype=torch.float64)
        refresh_at = {int(round(cfg.steps * (k + 1) / (cfg.refreshes + 1))) for k in range(cfg.refreshes)}
    theta = theta0.clone().requires_grad_(True)
    theta_old = theta0.clone()
    opt = torch.optim.Adam([theta], lr=cfg.lr)
    beta = float(cfg.eta)

    def _target(pi_old_np):
        if kind == "ds":
            return ds_target(pi_ref_np, rewards_np, correct_all.numpy(), beta,
                             float(m.hparams["gamma_p"]), float(m.hparams["gamma_n"]))
        return lad_target(pi_old_np, rewards_np, cfg.eta)

    history: List[Dict[str, float]] = []
    pending = 0
    for step in range(cfg.steps):
        if step in refresh_at:
            theta_old = theta.detach().clone()
        log_pi_old = torch.log_softmax(theta_old, 0)
        pi_old = log_pi_old.exp()
        if cfg.exact_expectation:
            arms = torch.arange(K)
            w = pi_old * K          # mean_a (K pi_old(a)) l(a) = E_{pi_old}[l]
        else:
            mu = torch.softmax(theta_old / cfg.temperature, 0)
            arms = torch.multinomial(mu, cfg.batch, replacement=True, generator=gen)
            w = (pi_old[arms] / mu[arms])
        n = arms.numel()
        log_pi = torch.log_softmax(theta, 0)
        lp = log_pi[arms].unsqueeze(1)
        old = log_pi_old[arms].unsqueeze(1)
        mask = torch.ones_like(lp)
        r = R[arms]
        if kind == "grpo":
            if cfg.exact_expectation:
                # the bandit's population version of the group statistics: mean and
                # (biased) std of R under pi_old instead of over the 32 samples
                mean = (pi_old * R).sum()
                adv = (r - mean).unsqueeze(1)
                if m.estimator == "grpo":
                    adv = adv / (torch.sqrt((pi_old * (R - mean) ** 2).sum()) + 1e-6)
            else:
                adv = m.advantages(r, n, old_log_probs=old, mask=mask)
        else:
            adv = (r - (pi_old * R).sum()).unsqueeze(1)
            if kind == "ds":
                adv = ds_reshape_advantages(adv, correct_all[arms], log_ref[arms].unsqueeze(1), mask,
                                            float(m.hparams["gamma_p"]), float(m.hparams["gamma_n"]),
                                            "seq_sum")
        per_tok, _ = m.online_loss(LossInputs(log_probs=lp, old_log_probs=old, advantages=adv, mask=mask))
        loss = (w * per_tok[:, 0]).mean()
        pi = log_pi.exp()
        if kind == "grpo":
            loss = loss + cfg.eta * (pi * (log_pi - log_pi_old)).sum()
        elif kind == "ds":
            loss = loss + beta * (pi * (log_pi - log_ref)).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        pending += 1
        if (step + 1) % cfg.record_every == 0 or step + 1 == cfg.steps:
            with torch.no_grad():
                p_now = torch.softmax(theta, 0).numpy()
                p_old_now = pi_old.numpy()
            history.append({"step": step + 1, "tv": tv_distance(p_now, _target(p_old_now)),
                            "max_prob": float(p_now.max())})
            if progress is not None:
                progress(pending)
                pending = 0
    if progress is not None and pending:
        progress(pending)

    with torch.no_grad():
        policy = torch.softmax(theta, 0).numpy().astype(np.float64)
        pi_old_np = torch.softmax(theta_old, 0).numpy().astype(np.float64)
    target = _target(pi_old_np)
    shares = mode_shares(policy, ranges)
    ent = float(-(policy * np.log(np.clip(policy, 1e-300, None))).sum())
    res: Dict = {
        "method": method,
        "kind": kind,
        "eta": float(cfg.eta),
        "steps": int(cfg.steps),
        "seed": int(cfg.seed),
        "n_arms": int(K),
        "batch": int(cfg.batch),
        "temperature": float(cfg.temperature),
        "lr": float(cfg.lr),
        "exact_expectation": bool(cfg.exact_expectation),
        "refreshes": int(cfg.refreshes) if kind != "ds" else len(refresh_at),
        "rewards": rewards_np.tolist(),
        "pi_old": pi_old_np.tolist(),
        "policy": policy.tolist(),
        "target": target.tolist(),
        "tv": tv_distance(policy, target),
        "max_prob": float(policy.max()),
        "argmax_arm": int(policy.argmax()),
        "entropy": ent,
        "bump_ranges": [list(b) for b in ranges],
        "mode_shares": shares,
        "mode_share_threshold": float(cfg.mode_share),
        "modes_kept": int(sum(s >= cfg.mode_share for s in shares)),
        "history": history,
        "method_hparams": {k: v for k, v in m.hparams.items() if v is not None},
    }
    if kind == "ds":
        plain = lad_target(pi_ref_np, rewards_np, beta)   # pi_ref exp(R/beta) / Z
        res.update({
            "target_kind": "ds_closed_form",
            "target_formula": "pi_ref^(1-gamma_p/beta) e^(R/beta) on C, pi_ref^(1+gamma_n/beta) e^(R/beta) off C",
            "beta": beta, "gamma_p": float(m.hparams["gamma_p"]), "gamma_n": float(m.hparams["gamma_n"]),
            "pi_ref": pi_ref_np.tolist(),
            "correct": [bool(c) for c in correct_all.tolist()],
            "plain_kl_target": plain.tolist(),
            "tv_plain_kl": tv_distance(policy, plain),
            "tv_targets": tv_distance(target, plain),
        })
    else:
        # where exact matching in every phase ends: pi_0 e^{(refreshes+1) R / eta} / Z
        end = lad_target(np.full(K, 1.0 / K), rewards_np * (cfg.refreshes + 1), cfg.eta)
        res.update({
            "target_kind": "lad",
            "target_formula": "pi_old exp(A/eta) / Z, A = R - E_{pi_old}[R]",
            "end_target": end.tolist(),
            "end_target_formula": "uniform * exp((refreshes+1) R / eta) / Z (every phase matched exactly)",
            "tv_end_target": tv_distance(policy, end),
        })
    res["config"] = asdict(cfg)
    return res


# ------------------------------------------------------------------ output
def write_json(result: Dict, path: str) -> None:
    atomic_write_bytes(path, (json.dumps(result, indent=1) + "\n").encode())


def plot_result(result: Dict, path: str) -> None:
    """PNG in the style of LAD's Figure 1: bars = learned policy, line = target; rewards in a
    second panel. DS results also show the plain-KL target and the reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    K = len(result["policy"])
    x = np.arange(K)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 5.2), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1.1]})
    ax.bar(x, result["policy"], color="#4C72B0", alpha=0.85, label="learned policy")
    ax.plot(x, result["target"], color="#DD8452", lw=2.2, marker="o", ms=3,
            label="DS closed form" if result["kind"] == "ds" else "target  pi_old e^{A/eta}/Z")
    if result["kind"] == "ds":
        ax.plot(x, result["plain_kl_target"], color="#55A868", lw=1.4, ls="--",
                label="plain-KL target  pi_ref e^{R/beta}/Z")
        ax.plot(x, result["pi_ref"], color="grey", lw=1, ls=":", label="pi_ref")
    elif "end_target" in result:
        ax.plot(x, result["end_target"], color="grey", lw=1.2, ls="--",
                label=f"{result['refreshes'] + 1}-phase optimum  e^{{{result['refreshes'] + 1}R/eta}}/Z")
    for lo, hi in result["bump_ranges"]:
        ax.axvspan(lo - 0.5, hi + 0.5, color="grey", alpha=0.08, lw=0)
    title = (f"{result['method']}: TV to target {result['tv']:.3f}, modes kept "
             f"{result['modes_kept']}/{len(result['bump_ranges'])}, max prob {result['max_prob']:.2f}")
    if result["kind"] == "ds":
        title += f"\nTV to plain-KL target {result['tv_plain_kl']:.3f}"
    elif "tv_end_target" in result:
        title += f"\nTV to the {result['refreshes'] + 1}-phase optimum {result['tv_end_target']:.3f}"
    ax.set_title(title, fontsize=10)
    ax.set_ylabel("probability")
    ax.legend(fontsize=8, loc="upper right")
    top = max(max(result["policy"]), max(result["target"]),
              max(result.get("plain_kl_target", [0])), max(result.get("end_target", [0])))
    ax.set_ylim(0, top * 1.12)
    ax2.plot(x, result["rewards"], color="#C44E52", lw=1.8)
    ax2.fill_between(x, result["rewards"], color="#C44E52", alpha=0.15)
    if result["kind"] == "ds":
        c = np.asarray(result["correct"])
        ax2.scatter(x[c], np.asarray(result["rewards"])[c], s=8, color="k", zorder=3, label="correct set C")
        ax2.legend(fontsize=7, loc="upper right")
    ax2.set_ylabel("reward R(a)")
    ax2.set_xlabel("arm")
    sub = (f"steps {result['steps']}, seed {result['seed']}, eta {result['eta']:g}, "
           f"{'exact expectation' if result['exact_expectation'] else str(result['batch']) + ' samples/step @ T=' + format(result['temperature'], 'g')}")
    fig.text(0.99, 0.005, sub, ha="right", va="bottom", fontsize=7, color="grey")
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, format="png")
        apply_umask_mode(tmp)  # mkstemp made it 0600
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)


SUMMARY_COLUMNS = ("method", "target", "TV to target", "modes kept", "max arm prob",
                   "target max prob", "TV to end optimum", "TV to plain-KL")


def summary_rows(results: Sequence[Dict]) -> List[Dict]:
    rows = []
    for r in results:
        rows.append({
            "method": r["method"],
            "target": "DS closed form" if r["kind"] == "ds" else "pi_old e^(A/eta)",
            "tv": r["tv"],
            "modes_kept": r["modes_kept"],
            "n_modes": len(r["bump_ranges"]),
            "max_prob": r["max_prob"],
            "target_max_prob": float(max(r["target"])),
            "tv_end_target": r.get("tv_end_target"),
            "tv_plain_kl": r.get("tv_plain_kl"),
        })
    return rows


def summary_markdown(results: Sequence[Dict]) -> str:
    lines = ["| " + " | ".join(SUMMARY_COLUMNS) + " |", "|" + "---|" * len(SUMMARY_COLUMNS)]
    for row in summary_rows(results):
        pk = "" if row["tv_plain_kl"] is None else f"{row['tv_plain_kl']:.3f}"
        et = "" if row["tv_end_target"] is None else f"{row['tv_end_target']:.3f}"
        lines.append(f"| {row['method']} | {row['target']} | {row['tv']:.3f} | "
                     f"{row['modes_kept']}/{row['n_modes']} | {row['max_prob']:.3f} | "
                     f"{row['target_max_prob']:.3f} | {et} | {pk} |")
    return "\n".join(lines) + "\n"


def summary_text(results: Sequence[Dict]) -> str:
    """The summary as a fixed-width text table (what the CLI prints)."""
    head = (f"{'method':<15} {'target':<17} {'TV to target':>12} {'modes kept':>10} "
            f"{'max arm prob':>12} {'target max prob':>15} {'TV to end optimum':>17} {'TV to plain-KL':>14}")
    out = [head, "-" * len(head)]
    for row in summary_rows(results):
        pk = "" if row["tv_plain_kl"] is None else f"{row['tv_plain_kl']:.3f}"
        et = "" if row["tv_end_target"] is None else f"{row['tv_end_target']:.3f}"
        out.append(f"{row['method']:<15} {row['target']:<17} {row['tv']:>12.3f} "
                   f"{str(row['modes_kept']) + '/' + str(row['n_modes']):>10} {row['max_prob']:>12.3f} "
                   f"{row['target_max_prob']:>15.3f} {et:>17} {pk:>14}")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ the whole table
def _run_and_write(method: str, cfg: BanditConfig, out_dir: str, queue=None) -> Dict:
    """Worker: one method, its JSON and PNG under ``out_dir``; progress goes to ``queue``."""
    torch.set_num_threads(1)
    cb = (lambda n: queue.put(n)) if queue is not None else None
    res = run_bandit(method, cfg, progress=cb)
    write_json(res, os.path.join(out_dir, f"{method}.json"))
    plot_result(res, os.path.join(out_dir, f"{method}.png"))
    return res


def run_all(out_dir: str = "runs/bandit", config: Optional[BanditConfig] = None,
            methods: Sequence[str] = BANDIT_METHODS, workers: int = 1,
            show_progress: bool = True) -> List[Dict]:
    """Every method in ``methods``: ``<out_dir>/<method>.json`` and ``.png``, then
    ``summary.json`` and ``summary.md``. ``workers > 1`` runs methods in parallel processes
    (each single-threaded); results do not depend on ``workers``."""
    import time

    from openrlhf_div.progress import progress_bar

    cfg = config or BanditConfig()
    cfg.validate()
    methods = [check_method(m) for m in methods]
    os.makedirs(out_dir, exist_ok=True)
    total = cfg.steps * len(methods)
    t0 = time.time()
    bar = progress_bar(total=total, desc=f"bandit x{len(methods)}", unit="step", unit_scale=True, mininterval=0.5,
                       disable=not show_progress, dynamic_ncols=True)
    results: Dict[str, Dict] = {}
    try:
        if workers <= 1:
            for m in methods:
                bar.set_postfix_str(m)
                results[m] = _run_one_inline(m, cfg, out_dir, bar)
        else:
            import multiprocessing as mp
            from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

            ctx = mp.get_context("spawn")
            with ctx.Manager() as manager, ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as ex:
                q = manager.Queue()
                futs = {ex.submit(_run_and_write, m, cfg, out_dir, q): m for m in methods}
                pending = set(futs)
                while pending:
                    done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                    while not q.empty():
                        bar.update(q.get())
                    for f in done:
                        results[futs[f]] = f.result()
                        bar.set_postfix_str(f"done {futs[f]}")
                while not q.empty():
                    bar.update(q.get())
    finally:
        bar.close()
    ordered = [results[m] for m in methods]
    summary = {
        "config": asdict(cfg),
        "elapsed_s": round(time.time() - t0, 2),
        "columns": list(SUMMARY_COLUMNS),
        "rows": summary_rows(ordered),
    }
    write_json(summary, os.path.join(out_dir, "summary.json"))
    md = ("# Controlled bandit (ALGORITHMS.md section 7)\n\n"
          f"{cfg.steps} steps, seed {cfg.seed}, eta/beta {cfg.eta:g}, "
          + ("exact expectation over the arms" if cfg.exact_expectation
             else f"{cfg.batch} samples/step from pi_old at T={cfg.temperature:g}")
          + f", Adam lr {cfg.lr:g}, {cfg.refreshes} pi_old refreshes (DS: every "
          f"{cfg.ds_refresh_every} step(s)). Modes kept: bumps holding >= {cfg.mode_share:.0%} "
          "of the policy mass.\n\n" + summary_markdown(ordered))
    atomic_write_bytes(os.path.join(out_dir, "summary.md"), md.encode())
    return ordered


def _run_one_inline(method: str, cfg: BanditConfig, out_dir: str, bar) -> Dict:
    res = run_bandit(method, cfg, progress=bar.update)
    write_json(res, os.path.join(out_dir, f"{method}.json"))
    plot_result(res, os.path.join(out_dir, f"{method}.png"))
    return res
