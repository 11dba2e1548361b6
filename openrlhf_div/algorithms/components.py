"""The built-in components (ALGORITHMS.md sections 1-5), each registered by name, and the
preset methods composed of them. Every component is a thin call of the functional API
(``losses``, ``kl``, ``advantages``): plain autograd, the spec's formulas.

A user's component looks the same, in any module::

    @register_policy_loss("my_loss", defaults={"my_eps": 0.2})
    def my_loss(b: LossInputs, my_eps):
        r = torch.exp((b.log_probs - b.old_log_probs).clamp(-20, 20))
        return zero_masked(-b.advantages * r.clamp(max=1 + my_eps), b.mask), {}

    register_method(Method("my_method", "PPO without the lower clip", policy_loss="my_loss"))
"""
from __future__ import annotations

import torch

from ._utils import masked_mean, unknown_name_error
from .authors import JS_DEF_ONLINE_MODES, LOG_Z_HEADS, clamp_k3, js_def_online_gate
from .advantages import (
    ds_reshape_advantages,
    entropy_advantages,
    group_advantages,
    passk_advantages,
    pkpo_advantages,
    unlikeliness_rewards,
)
from .divergences import check_alpha
from .kl import kl_estimate
from .losses import (
    cispo_loss,
    clip_cov_loss,
    diff_entropy_loss,
    dph_anchor_loss,
    dph_js_def_loss,
    entropy_loss,
    flowrl_loss,
    kl_cov_loss,
    lad_loss,
    ppo_clip_loss,
    ppo_clip_mask,
)
from .registry import (
    LossInputs,
    Method,
    Needs,
    register_adv_reshaping,
    register_anchor,
    register_estimator,
    register_method,
    register_policy_loss,
    register_regularizer,
    register_reward_shaping,
)
from .registry import ANCHOR_HELP

REF = Needs(ref_log_probs=True)
ENTROPY = Needs(entropy=True)


# ------------------------------------------------------------------ estimators (section 1)
# openrlhf_estimator: OpenRLHF's critic-free flag the Ray driver sets (topology only)
for _name, _flag in (("grpo", "group_norm"), ("dr_grpo", "dr_grpo"), ("rloo", "rloo")):
    register_estimator(_name, openrlhf_estimator=_flag)((lambda est: lambda rewards, group_size, correct:
                                                         group_advantages(rewards, group_size, est))(_name))


_PASSK_HELP = {"passk_k": ("k of the pass@k objective the advantage targets (k <= group size)",
                          "Pass@k training (Chen et al. 2025) analytical advantage; PKPO (Walder & Karkhanis 2025); "
                          "docs/ALGORITHMS.md section 3")}


@register_estimator("passk", defaults={"passk_k": 4}, help=_PASSK_HELP)
def passk(rewards, group_size, correct, passk_k):
    return passk_advantages(correct.to(torch.float32), group_size, int(passk_k))


@register_estimator("pkpo", defaults={"passk_k": 4}, openrlhf_estimator="rloo", help=_PASSK_HELP)
def pkpo(rewards, group_size, correct, passk_k):
    return pkpo_advantages(correct.to(torch.float32), group_size, int(passk_k))


# ------------------------------------------------------------------ reward shaping (section 3)
@register_reward_shaping("unlikeliness", defaults={"unlikeliness_beta": 0.25}, help={
    "unlikeliness_beta": ("beta_u of R_i <- R_i (1 - beta_u rank_i / G), ranks by length-normalised old log-prob",
                          "Unlikeliness reward (He et al. 2025); docs/ALGORITHMS.md section 3")})
def unlikeliness(rewards, group_size, *, seq_mean_old_log_probs, lengths, unlikeliness_beta):
    if seq_mean_old_log_probs is None:
        raise ValueError("the unlikeliness reward needs seq_mean_old_log_probs (the responses' mean old log-prob)")
    return unlikeliness_rewards(rewards, seq_mean_old_log_probs, group_size, unlikeliness_beta)


# ------------------------------------------------------------------ advantage reshaping (section 3)
@register_adv_reshaping("ds", defaults={"gamma_p": 0.01, "gamma_n": 0.01, "ds_granularity": "token"}, help={
    "gamma_p": ("correct responses: A'_t = A - gamma_p old_t",
                "Differential Smoothing (seed 002) Sec. 4.2, Qwen2.5-Math runs; docs/ALGORITHMS.md section 3"),
    "gamma_n": ("incorrect responses: A'_t = A + gamma_n old_t",
                "Differential Smoothing (seed 002) Sec. 4.2, Qwen2.5-Math runs; docs/ALGORITHMS.md section 3"),
    "ds_granularity": ("the log-probability DS reshapes with: token (old_t), seq_mean (mean_t old_t) or seq_sum "
                       "(log pi_old(y))", "Differential Smoothing (seed 002) Eq. 6 (seq_sum); docs/ALGORITHMS.md "
                                          "section 3 and section 9 row 8a")})
def ds(advantages, *, correct, old_log_probs, mask, gamma_p, gamma_n, ds_granularity):
    return ds_reshape_advantages(advantages, correct, old_log_probs, mask, float(gamma_p), float(gamma_n),
                                 ds_granularity)


@register_adv_reshaping("entadv", defaults={"entadv_alpha": 0.4, "entadv_kappa": 2.0}, needs=ENTROPY, at="loss", help={
    "entadv_alpha": ("alpha of A_t <- A_t + min(alpha sg(H_t), |A_t| / kappa)",
                     "EntAdv (Cheng et al. 2025); docs/ALGORITHMS.md section 2"),
    "entadv_kappa": ("kappa of A_t <- A_t + min(alpha sg(H_t), |A_t| / kappa): the bonus is at most |A| / kappa",
                     "EntAdv (Cheng et al. 2025); docs/ALGORITHMS.md section 2")})
def entadv(advantages, b: LossInputs, entadv_alpha, entadv_kappa):
    return entropy_advantages(advantages, b.entropy, b.mask, float(entadv_alpha), float(entadv_kappa))


# ------------------------------------------------------------------ policy losses (sections 2 and 5)
def _clipfrac(b: LossInputs, eps_low, eps_high) -> torch.Tensor:
    """``[B, T]`` 1 where the ratio is on PPO-clip's clipped branch at ``eps_low`` / ``eps_high``
    (its mean over valid tokens is the ``clipfrac`` metric of the losses that clip)."""
    with torch.no_grad():
        r = torch.exp((b.log_probs - b.old_log_probs).clamp(-20, 20))
        return ppo_clip_mask(r, b.advantages, float(eps_low), float(eps_high)).to(b.log_probs.dtype)


_CLIP_HELP = {
    "eps_low": ("lower clip range: the ratio r_t is clipped at 1 - eps_low",
                "PPO (Schulman et al. 2017) Eq. 7; GRPO 0.2; docs/ALGORITHMS.md section 2"),
    "eps_high": ("upper clip range: the ratio r_t is clipped at 1 + eps_high (clip-higher: 0.28)",
                 "DAPO (Yu et al. 2025) Sec. 3.1 clip-higher; DPH-RL App. D Table 5; docs/ALGORITHMS.md section 2"),
    "dual_clip": ("dual clip c for A < 0: l_t = min(l_t, -c A) (null: off)",
                  "dual-clip PPO (Ye et al. 2020), c = 3; docs/ALGORITHMS.md section 2"),
}


@register_policy_loss("ppo_clip", defaults={"eps_low": 0.2, "eps_high": 0.2, "dual_clip": 3.0},
                      metrics=("clipfrac",), help=_CLIP_HELP)
def ppo_clip(b: LossInputs, eps_low, eps_high, dual_clip):
    return (ppo_clip_loss(b.log_probs, b.old_log_probs, b.advantages, b.mask, eps_low, eps_high, dual_clip),
            {"clipfrac": _clipfrac(b, eps_low, eps_high)})


@register_policy_loss("cispo", defaults={"eps_low": 1.0, "eps_high": 0.28}, metrics=("clipfrac",), help={
    "eps_low": ("lower clip of CISPO's detached IS weight sg(clip(r_t, 1 - eps_low, 1 + eps_high)) (1: none)",
                "CISPO (MiniMax-M1, 2025); docs/ALGORITHMS.md section 2 and section 9 row 9b"),
    "eps_high": ("upper clip of CISPO's detached IS weight",
                 "CISPO (MiniMax-M1, 2025); volcengine/verl examples/cispo_trainer (0.2); docs/ALGORITHMS.md "
                 "section 9 row 9b")})
def cispo(b: LossInputs, eps_low, eps_high):
    """``clipfrac``: the tokens whose importance weight CISPO clips (and detaches)."""
    return (cispo_loss(b.log_probs, b.old_log_probs, b.advantages, b.mask, eps_low, eps_high),
            {"clipfrac": _clipfrac(b, eps_low, eps_high)})


@register_policy_loss("clip_cov", defaults={"eps_low": 0.2, "eps_high": 0.2, "dual_clip": 3.0,
                                            "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
                      metrics=("clipfrac",), batch_statistics=True, help={
    **_CLIP_HELP,
    "clip_cov_ratio": ("share of tokens Clip-Cov detaches: max(1, floor(ratio N)) among lb < Cov_t < ub",
                       "Clip-Cov (Cui et al. 2025); docs/ALGORITHMS.md section 2"),
    "clip_cov_lb": ("lower bound of the covariance window Clip-Cov picks tokens from",
                    "Clip-Cov (Cui et al. 2025); docs/ALGORITHMS.md section 2"),
    "clip_cov_ub": ("upper bound of the covariance window Clip-Cov picks tokens from",
                    "Clip-Cov (Cui et al. 2025); docs/ALGORITHMS.md section 2")})
def clip_cov(b: LossInputs, eps_low, eps_high, dual_clip, clip_cov_ratio, clip_cov_lb, clip_cov_ub):
    return (clip_cov_loss(b.log_probs, b.old_log_probs, b.advantages, b.mask, eps_low, eps_high, dual_clip,
                          clip_cov_ratio, clip_cov_lb, clip_cov_ub, generator=b.generator),
            {"clipfrac": _clipfrac(b, eps_low, eps_high)})


@register_policy_loss("kl_cov", defaults={"kl_cov_ratio": 2e-3, "kl_cov_k": 1.0, "kl_cov_min_one": False},
                      batch_statistics=True, help={
    "kl_cov_ratio": ("share of tokens KL-Cov penalises: the top floor(ratio N) by covariance Cov_t",
                     "KL-Cov (Cui et al. 2025); docs/ALGORITHMS.md section 2"),
    "kl_cov_k": ("k of the penalty -A r_t + k |log r_t| on the selected tokens",
                 "KL-Cov (Cui et al. 2025); docs/ALGORITHMS.md section 2"),
    "kl_cov_min_one": ("penalise at least one token (max(1, ...)), as verl does",
                       "volcengine/verl core_algos.py compute_policy_loss_kl_cov; docs/ALGORITHMS.md section 9 "
                       "row 9c")})
def kl_cov(b: LossInputs, kl_cov_ratio, kl_cov_k, kl_cov_min_one):
    """``kl_cov_min_one``: penalise at least one token, as verl (docs/ALGORITHMS.md 9, row 9c)."""
    return kl_cov_loss(b.log_probs, b.old_log_probs, b.advantages, b.mask, kl_cov_ratio, kl_cov_k,
                       bool(kl_cov_min_one)), {}


def _check_lad(h):
    if not float(h["lad_eta"]) > 0:
        raise ValueError(f"lad_eta must be > 0, got {h['lad_eta']}")


@register_policy_loss("lad", defaults={"lad_divergence": "js", "lad_eta": 0.25, "lad_granularity": "token",
                                       "lad_clip": None, "lad_hellinger_half": True}, check=_check_lad, help={
    "lad_divergence": ("the f-divergence of LAD: kl, reverse_kl, jeffreys, tv, hellinger or js",
                       "LAD (seed 003) Table 5; docs/ALGORITHMS.md section 5"),
    "lad_eta": ("eta of z_t = A_t / eta (1 / eta = 4 the paper's best)",
                "LAD (seed 003) Table 6; docs/ALGORITHMS.md section 5"),
    "lad_granularity": ("token: per-token log-ratios; sequence: the log-ratio summed over the response",
                        "LAD (seed 003); docs/ALGORITHMS.md section 5"),
    "lad_clip": ("[low, high]: zero the gradient where PPO-clip would (clip-higher); null: no clip",
                 "LAD (seed 003) App. C.2 (DAPO clip-higher for every method); docs/ALGORITHMS.md section 9 row 6a"),
    "lad_hellinger_half": ("Hellinger with the 1/2 of the generator (false: the paper's Table 5 loss column)",
                           "LAD (seed 003) Table 5; docs/ALGORITHMS.md section 9 row 6b")})
def lad(b: LossInputs, lad_divergence, lad_eta, lad_granularity, lad_clip, lad_hellinger_half):
    """``lad_hellinger_half: false``: Hellinger without the 1/2, as the LAD paper's Table 5 loss
    column writes it (twice the loss and gradient; docs/ALGORITHMS.md 9, row 6b)."""
    loss = lad_loss(b.log_probs, b.old_log_probs, b.advantages, b.mask, lad_divergence, float(lad_eta),
                    lad_granularity, tuple(lad_clip) if lad_clip is not None else None)
    if lad_divergence == "hellinger" and not lad_hellinger_half:
        loss = 2.0 * loss
    return loss, {}


def _check_flowrl(h):
    if h["log_z_head"] not in LOG_Z_HEADS:
        raise unknown_name_error("log_z_head", h["log_z_head"], LOG_Z_HEADS)
    if h["flowrl_max_weight"] is not None and not float(h["flowrl_max_weight"]) > 0:
        raise ValueError(f"flowrl_max_weight must be > 0 or null (unclipped), got {h['flowrl_max_weight']}")


@register_policy_loss("flowrl", defaults={"flowrl_beta": 15.0, "flowrl_max_weight": 10.0,
                                          "log_z_head": "small_detached"},
                      needs=Needs(ref_log_probs=True, prompt_hidden=True), check=_check_flowrl, help={
    "flowrl_beta": ("beta_f of delta = logZ(x) + mean_t lp_t - beta_f A - mean_t ref_t",
                    "FlowRL (Zhu et al. 2025), beta 15; docs/ALGORITHMS.md section 2"),
    "flowrl_max_weight": ("clip of the detached importance weight w = min(exp(sum_t (lp_t - old_t)), this) "
                          "(null: unclipped, as the authors' code)",
                          "Xuekai-Zhu/FlowRL dp_actor.py compute_flowrl_objective; docs/ALGORITHMS.md section 9 row 7b"),
    "log_z_head": ("the log Z head: small_detached (a small MLP on detached prompt states) or authors (their 3-layer "
                   "ProjZModule, not detached)", "Xuekai-Zhu/FlowRL verl/workers/fsdp_workers.py ProjZModule; "
                                                 "docs/ALGORITHMS.md section 9 row 7a")})
def flowrl(b: LossInputs, flowrl_beta, flowrl_max_weight, log_z_head):
    """``flowrl_max_weight: null``: the unclipped importance weight of the authors' code;
    ``log_z_head`` is read by the engines when they build the head (heads.make_log_z_head)."""
    seq_adv = masked_mean(b.advantages, b.mask, dim=1)
    return flowrl_loss(b.log_probs, b.old_log_probs, b.ref_log_probs, seq_adv, b.log_z, b.mask,
                       float(flowrl_beta), None if flowrl_max_weight is None else float(flowrl_max_weight)), {}


# ------------------------------------------------------------------ regularizers (sections 2, 4, 5)
@register_regularizer("kl", defaults={"kl_coef": 0.01, "kl_estimator": "k3"}, needs=REF, metrics=("kl",), help={
    "kl_coef": ("beta of the reverse-KL term beta k3 to the online reference",
                "DPH-RL (seed 000) App. D Table 5 (RKL baseline, 0.01); docs/ALGORITHMS.md section 2"),
    "kl_estimator": ("estimator of KL(pi_theta || pi_ref) on policy samples: k1, k2 or k3",
                     "Schulman 2020, Approximating KL divergence (k3); docs/ALGORITHMS.md section 2")})
def kl(b: LossInputs, kl_coef, kl_estimator):
    k = kl_estimate(b.log_probs, b.ref_log_probs, b.mask, kl_estimator)
    return float(kl_coef) * k, {"kl": k}


@register_regularizer("entropy", defaults={"entropy_coef": 1e-3}, needs=ENTROPY, metrics=("entropy",), help={
    "entropy_coef": ("c_H of l_t -= c_H H_t (> 0: bonus, < 0: penalty)",
                     "Differential Smoothing (seed 002) entropy baselines; docs/ALGORITHMS.md section 2")})
def entropy(b: LossInputs, entropy_coef):
    return entropy_loss(b.entropy, b.mask, float(entropy_coef)), {"entropy": b.entropy}


@register_regularizer("diff_entropy", defaults={"entropy_coef_pos": 1e-3, "entropy_coef_neg": 1e-3}, needs=ENTROPY,
                      metrics=("entropy",), help={
    "entropy_coef_pos": ("entropy bonus c_H on tokens of correct responses",
                         "Differential Smoothing (seed 002) Sec. 4.8.2; docs/ALGORITHMS.md section 2"),
    "entropy_coef_neg": ("entropy penalty c_H' on tokens of incorrect responses",
                         "Differential Smoothing (seed 002) Sec. 4.8.2; docs/ALGORITHMS.md section 2")})
def diff_entropy(b: LossInputs, entropy_coef_pos, entropy_coef_neg):
    if b.correct is None:
        raise ValueError("the diff_entropy regularizer needs LossInputs.correct ([B] bool); got None")
    loss = diff_entropy_loss(b.entropy, b.correct, b.mask, float(entropy_coef_pos), float(entropy_coef_neg))
    return loss, {"entropy": b.entropy}


def _check_js_def(h):
    if h["js_def_online"] not in JS_DEF_ONLINE_MODES:
        raise unknown_name_error("js_def_online", h["js_def_online"], JS_DEF_ONLINE_MODES)
    if h.get("js_def_clamp") is not None and not float(h["js_def_clamp"]) > 0:
        raise ValueError(f"js_def_clamp must be > 0 or null, got {h['js_def_clamp']}")


@register_regularizer("js_def_online", defaults={"js_def_lambda": 0.125, "anchor_eta": 0.2, "js_def_online": "fixed",
                                                 "js_def_ratio": 1, "js_def_clamp": None},
                      needs=REF, check=_check_js_def, metrics=("js_def_online",), help={
    "js_def_lambda": ("lambda of the rollout half eta lambda KL(pi || M) (default B_pef / (B_exp n))",
                      "DPH-RL (seed 000) JS by definition; docs/ALGORITHMS.md section 4"),
    "anchor_eta": ANCHOR_HELP["anchor_eta"],
    "js_def_online": ("fixed: eta lambda KL(pi || M) every micro-batch; stochastic: eta KL(pi || M) when "
                      "randint(1, 10) <= js_def_ratio, as the authors' code",
                      "seamoke/DPH-RL dp_actor.py update_policy; docs/ALGORITHMS.md section 9 row 3b"),
    "js_def_ratio": ("js_def_online stochastic: the online term is added when randint(1, 10) <= this",
                     "seamoke/DPH-RL verl/trainer/config/ppo_trainer.yaml js_ratio: 1; docs/ALGORITHMS.md section 9 "
                     "row 3b"),
    "js_def_clamp": ("clamp of the k3 value to [-c, c] (null: none)",
                     "seamoke/DPH-RL core_algos.py kl_penalty('low_var_kl') clamps at 10; docs/ALGORITHMS.md "
                     "section 9 row 3a")})
def js_def_online(b: LossInputs, js_def_lambda, anchor_eta, js_def_online, js_def_ratio, js_def_clamp):
    """``eta * lambda * KL(pi || M)`` on rollout tokens, with the anchor's weight ``eta``. The
    DPH-RL authors' code (docs/ALGORITHMS.md 9, rows 3a-b): ``js_def_online: stochastic`` adds
    ``eta * KL(pi || M)`` to a micro-batch when ``randint(1, 10) <= js_def_ratio`` (drawn from
    ``LossInputs.generator``) and nothing otherwise; ``js_def_clamp`` clamps the k3 value."""
    js = dph_js_def_loss(b.log_probs, b.ref_log_probs, b.mask, on="online")
    if js_def_clamp is not None:
        js = clamp_k3(js, float(js_def_clamp))
    if js_def_online == "fixed":
        w = float(anchor_eta) * float(js_def_lambda)
    else:
        if b.generator is None:
            raise ValueError("js_def_online='stochastic' needs LossInputs.generator (a seeded torch.Generator; "
                             "both engines pass theirs)")
        w = float(anchor_eta) if js_def_online_gate(b.generator, int(js_def_ratio)) else 0.0
    return w * js, {"js_def_online": js}


# ------------------------------------------------------------------ D_pef anchors (section 4)
for _name, _eta in (("forward_kl", 0.01), ("js", 0.2)):
    register_anchor(_name, eta=_eta)((lambda div: lambda a: dph_anchor_loss(
        a.log_probs, a.ref_log_probs, a.mask, div))(_name))


@register_anchor("alpha", defaults={"anchor_alpha": 0.5}, eta=0.01, check=lambda h: check_alpha(h["anchor_alpha"]),
                 help={"anchor_alpha": ("a of the alpha-divergence generator (u^(1-a) - (1-a) u - a) / (a (a-1)), "
                                        "a in (0, 1)", "DPH-RL (seed 000) App. D Table 5; seamoke/DPH-RL "
                                                       "scripts/llama/alpha.sh; docs/ALGORITHMS.md section 4")})
def alpha(a, anchor_alpha):
    return dph_anchor_loss(a.log_probs, a.ref_log_probs, a.mask, "alpha", alpha=anchor_alpha)


@register_anchor("js_def", defaults={"js_def_clamp": None}, eta=0.2, help={
    "js_def_clamp": ("clamp of the k3 value to [-c, c] (null: none)",
                     "seamoke/DPH-RL core_algos.py kl_penalty('low_var_kl') clamps at 10; docs/ALGORITHMS.md "
                     "section 9 row 3a")})
def js_def(a, js_def_clamp):
    loss = dph_js_def_loss(a.log_probs, a.ref_log_probs, a.mask, on="anchor")
    return loss if js_def_clamp is None else clamp_k3(loss, float(js_def_clamp))


# ------------------------------------------------------------------ preset methods
def _presets() -> None:
    D, S, L = ("DPH-RL (seed 000)", "Differential Smoothing (seed 002)", "LAD (seed 003)")
    P = [
        Method("grpo", "GRPO: group-normalised advantages, PPO-clip 0.2/0.2, no KL"),
        Method("dr_grpo", "Dr. GRPO: mean-centred advantages without std division", estimator="dr_grpo"),
        Method("rloo", "RLOO: leave-one-out baseline", estimator="rloo"),
        Method("dapo", "DAPO: clip-higher 0.28, token-mean, dynamic sampling, overlong shaping",
               dynamic_sampling=True,
               hparams={"eps_high": 0.28, "overlong_max_len": 20480, "overlong_cache_len": 4096}),
        Method("rkl", "GRPO + reverse KL (k3) to the online reference, beta 0.01",
               regularizers=("kl",), hparams={"eps_high": 0.28, "kl_coef": 0.01}, paper=D),
        Method("dph_f", "DPH-RL forward KL: PPO-clip without KL on D_exp + generator-form "
               "KL(pi_ref||pi) on D_pef, eta 0.01", anchor="forward_kl",
               hparams={"eps_high": 0.28}, paper=D),
        Method("dph_js", "DPH-RL Jensen-Shannon generator anchor on D_pef, eta 0.2", anchor="js",
               hparams={"eps_high": 0.28}, paper=D),
        Method("dph_alpha", "DPH-RL alpha-divergence anchor (alpha 0.5), eta 0.01", anchor="alpha",
               hparams={"eps_high": 0.28}, paper=D),
        Method("dph_js_def", "DPH-RL JS by definition: KL(ref||M) on D_pef + KL(pi||M) on rollouts "
               "(needs the online reference)", anchor="js_def", regularizers=("js_def_online",),
               hparams={"eps_high": 0.28}, paper=D),
        Method("ds_grpo", "DS-GRPO: A - gamma_p old_t on correct, A + gamma_n old_t on incorrect",
               adv_reshaping=("ds",), hparams={"eps_high": 0.25}, paper=S),
        Method("ds_grpo_seq", "DS-GRPO as the paper's Eq. 6 writes it: gamma x log pi_old(y) of the whole response",
               adv_reshaping=("ds",), hparams={"eps_high": 0.25, "ds_granularity": "seq_sum"}, paper=S),
        Method("ds_positive", "DS ablation: reshape correct responses only (gamma_n = 0)",
               adv_reshaping=("ds",), hparams={"eps_high": 0.25, "gamma_n": 0.0}, paper=S),
        Method("ds_negative", "DS ablation: reshape incorrect responses only (gamma_p = 0)",
               adv_reshaping=("ds",), hparams={"eps_high": 0.25, "gamma_p": 0.0}, paper=S),
        Method("entropy_bonus", "GRPO + entropy bonus c_H H (c_H = 1e-3)", regularizers=("entropy",),
               hparams={"eps_high": 0.25, "entropy_coef": 1e-3}, paper=S),
        Method("entropy_penalty", "GRPO + entropy penalty (c_H = -1e-3)", regularizers=("entropy",),
               hparams={"eps_high": 0.25, "entropy_coef": -1e-3}, paper=S),
        Method("diff_entropy", "Differential entropy control: bonus on correct, penalty on incorrect",
               regularizers=("diff_entropy",), hparams={"eps_high": 0.25}, paper=S),
        Method("cispo", "CISPO: clipped, detached IS weight times A log pi", policy_loss="cispo"),
        Method("clip_cov", "Clip-Cov: detach random high-covariance tokens", policy_loss="clip_cov"),
        Method("kl_cov", "KL-Cov: |log r| penalty on the top-covariance tokens", policy_loss="kl_cov"),
        Method("entadv", "EntAdv: A + min(alpha sg(H), |A|/kappa)", adv_reshaping=("entadv",)),
        Method("flowrl", "FlowRL: length-normalised trajectory balance with a learned log Z",
               policy_loss="flowrl", aggregation="seq-mean-token-mean"),
        Method("unlikeliness", "Unlikeliness reward: discount likely correct answers by rank",
               reward_shaping=("unlikeliness",)),
        Method("passk", "Pass@k training, analytical advantage (k = 4)", estimator="passk"),
        Method("pkpo", "PKPO: unbiased pass@k reward transform + leave-one-out baseline", estimator="pkpo"),
    ]
    for div in ("kl", "reverse_kl", "jeffreys", "tv", "hellinger", "js"):
        P.append(Method(f"lad_{div}", f"LAD with the {div} f-divergence, eta 0.25, no PPO clip",
                        policy_loss="lad", hparams={"lad_divergence": div}, paper=L))
    for m in P:
        register_method(m)


_presets()
