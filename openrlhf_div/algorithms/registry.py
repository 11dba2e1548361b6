"""The method registry: the one seam between methods and engines (ARCHITECTURE.md).

A :class:`Method` is data: an advantage estimator, optional reward shaping and advantage
reshaping, one policy loss, optional regularizers, an optional ``D_pef`` anchor loss, and
the hyperparameters of each. From those it derives :class:`Needs`, what it asks of an
engine. Engines never branch on a method's name: they read ``method.needs``, hand the
method tensors, and apply what it returns::

    method = get_method("dph_js", anchor_eta=0.1)
    rewards = method.shape_rewards(raw_rewards, G, seq_mean_old_log_probs=..., lengths=...)
    keep = method.keep_groups(rewards, G)            # dynamic sampling (all True if off)
    adv = method.advantages(rewards, G, old_log_probs=old, mask=mask)      # [N, T]
    ...                                                # per micro-batch, training forward:
    loss, metrics = method.loss(
        online=LossInputs(log_probs=lp, old_log_probs=old, advantages=adv, mask=mask,
                          correct=method.is_correct(rewards), entropy=H, ref_log_probs=ref),
        anchor=AnchorInputs(log_probs=alp, ref_log_probs=stored_ref, mask=amask),
        num_online_tokens=..., num_anchor_tokens=...)  # global counts, for grad accumulation
    loss.backward()

``L = L_exp + eta * L_pef``, each aggregated over its own tokens (ALGORITHMS.md 4).
Adding a method is one :func:`register_method` call; every engine gets it.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from ._fused import (
    Keep,
    _js_def,
    _k3,
    cispo_terms,
    clipped_count,
    kl_cov_terms,
    lad_terms,
    per_token,
    ppo_clip_terms,
)
from ._utils import broadcast_seq, check_same_shape, masked_mean, masked_sum, unknown_name_error
from .advantages import (
    ds_reshape_advantages,
    dynamic_sampling_mask,
    entropy_advantages,
    group_advantages,
    overlong_penalty,
    passk_advantages,
    pkpo_advantages,
    unlikeliness_rewards,
)
from .authors import (
    ANCHOR_WEIGHTINGS,
    JS_DEF_ONLINE_MODES,
    LOG_Z_HEADS,
    MICRO_BATCH_TOKEN_MEAN,
    anchor_weight,
    authors_modes,
    clamp_k3,
    js_def_online_gate,
)
from .kl import kl_estimate
from .losses import (
    AGGREGATIONS,
    aggregate_loss,
    cispo_loss,
    clip_cov_loss,
    clip_cov_terms,
    diff_entropy_loss,
    diff_entropy_weights,
    dph_anchor_loss,
    dph_js_def_loss,
    entropy_loss,
    flowrl_loss,
    kl_cov_loss,
    lad_loss,
    ppo_clip_loss,
)
from .divergences import check_alpha

# ------------------------------------------------------------------ components
# Each component owns its hyperparameters (name -> default). A method accepts exactly the
# hyperparameters of its components, so a typo is an error, not a silent no-op.
COMMON_HPARAMS: Dict[str, Any] = {
    "correct_threshold": 1.0,   # correct_i = (R_i >= threshold) for binary verifiable rewards
    "overlong_max_len": None,   # DAPO overlong shaping L_max (None: off)
    "overlong_cache_len": None,  # DAPO overlong shaping L_c
    "micro_batch_seqs": 2,      # sequences per micro-batch of aggregation "micro-batch-token-mean"
}
ESTIMATORS: Dict[str, Dict[str, Any]] = {
    "grpo": {}, "dr_grpo": {}, "rloo": {},
    "passk": {"passk_k": 4},
    "pkpo": {"passk_k": 4},
}
REWARD_SHAPING: Dict[str, Dict[str, Any]] = {
    "unlikeliness": {"unlikeliness_beta": 0.25},
}
ADV_RESHAPING: Dict[str, Dict[str, Any]] = {
    "ds": {"gamma_p": 0.01, "gamma_n": 0.01, "ds_granularity": "token"},
    "entadv": {"entadv_alpha": 0.4, "entadv_kappa": 2.0},
}
POLICY_LOSSES: Dict[str, Dict[str, Any]] = {
    "ppo_clip": {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": 3.0},
    "cispo": {"eps_low": 1.0, "eps_high": 0.28},
    "clip_cov": {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": 3.0,
                 "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
    "kl_cov": {"kl_cov_ratio": 2e-3, "kl_cov_k": 1.0, "kl_cov_min_one": False},
    "lad": {"lad_divergence": "js", "lad_eta": 0.25, "lad_granularity": "token", "lad_clip": None,
            "lad_hellinger_half": True},
    "flowrl": {"flowrl_beta": 15.0, "flowrl_max_weight": 10.0, "log_z_head": "small_detached"},
}
REGULARIZERS: Dict[str, Dict[str, Any]] = {
    "kl": {"kl_coef": 0.01, "kl_estimator": "k3"},
    "entropy": {"entropy_coef": 1e-3},
    "diff_entropy": {"entropy_coef_pos": 1e-3, "entropy_coef_neg": 1e-3},
    "js_def_online": {"js_def_lambda": 0.125, "js_def_online": "fixed", "js_def_ratio": 1, "js_def_clamp": None},
}
# anchor_weighting (docs/ALGORITHMS.md section 9, row 1): "token_mean" is L_exp + eta L_pef;
# "microbatch_share" is the DPH-RL authors' code, eta x #anchor / #online sequences of the step
_AW = {"anchor_weighting": "token_mean"}
ANCHORS: Dict[str, Dict[str, Any]] = {
    "forward_kl": {"anchor_eta": 0.01, **_AW},
    "js": {"anchor_eta": 0.2, **_AW},
    "alpha": {"anchor_eta": 0.01, "anchor_alpha": 0.5, **_AW},
    "js_def": {"anchor_eta": 0.2, "js_def_clamp": None, **_AW},
}


# the metric each regularizer logs (its masked mean)
_REG_METRIC = {"kl": "kl", "entropy": "entropy", "diff_entropy": "entropy", "js_def_online": "js_def_online"}


@dataclass(frozen=True)
class Needs:
    """What a method asks of an engine."""

    ref_log_probs: bool = False   # an online reference-model forward on rollouts
    anchor_batch: bool = False    # D_pef anchor samples with their stored base log-probs
    entropy: bool = False         # full-vocabulary entropy at the training forward
    old_log_probs: bool = True    # behaviour-policy log-probs of the rollouts
    prompt_hidden: bool = False   # prompt hidden states, for FlowRL's log Z head


@dataclass
class LossInputs:
    """Per-token tensors of online rollouts for one (micro-)batch, all ``[B, T]``."""

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor          # [B, T] (from Method.advantages) or [B]
    mask: torch.Tensor
    correct: Optional[torch.Tensor] = None       # [B] bool; needed by diff_entropy
    ref_log_probs: Optional[torch.Tensor] = None  # needs.ref_log_probs
    entropy: Optional[torch.Tensor] = None        # needs.entropy
    log_z: Optional[torch.Tensor] = None          # [B], FlowRL's log Z head output
    generator: Optional[torch.Generator] = None   # Clip-Cov's random token choice


@dataclass
class AnchorInputs:
    """A ``D_pef`` micro-batch: current log-probs and the stored base log-probs."""

    log_probs: torch.Tensor
    ref_log_probs: torch.Tensor
    mask: torch.Tensor


def _require(inputs: LossInputs, field_name: str, method: str, need: str):
    val = getattr(inputs, field_name)
    if val is None:
        raise ValueError(
            f"method {method!r} needs LossInputs.{field_name} (declared in Method.needs.{need}); got None"
        )
    return val


@dataclass
class Method:
    """A training method as data. Build one with :func:`get_method`."""

    name: str
    summary: str
    estimator: str = "grpo"
    reward_shaping: Tuple[str, ...] = ()
    adv_reshaping: Tuple[str, ...] = ()
    policy_loss: str = "ppo_clip"
    regularizers: Tuple[str, ...] = ()
    anchor: Optional[str] = None
    aggregation: str = "token-mean"
    dynamic_sampling: bool = False
    hparams: Dict[str, Any] = field(default_factory=dict)
    paper: str = ""

    # -------------------------------------------------------------- declaration
    def hparam_defaults(self) -> Dict[str, Any]:
        d = dict(COMMON_HPARAMS)
        d.update(ESTIMATORS[self.estimator])
        for r in self.reward_shaping:
            d.update(REWARD_SHAPING[r])
        for r in self.adv_reshaping:
            d.update(ADV_RESHAPING[r])
        d.update(POLICY_LOSSES[self.policy_loss])
        for r in self.regularizers:
            d.update(REGULARIZERS[r])
        if self.anchor is not None:
            d.update(ANCHORS[self.anchor])
        return d

    @property
    def needs(self) -> Needs:
        return Needs(
            ref_log_probs="kl" in self.regularizers or "js_def_online" in self.regularizers
            or self.policy_loss == "flowrl",
            anchor_batch=self.anchor is not None,
            entropy=bool({"entropy", "diff_entropy"} & set(self.regularizers))
            or "entadv" in self.adv_reshaping,
            old_log_probs=True,
            prompt_hidden=self.policy_loss == "flowrl",
        )

    @property
    def anchor_weight(self) -> float:
        """``eta`` of ``L = L_exp + eta * L_pef`` (0 without an anchor)."""
        return float(self.hparams["anchor_eta"]) if self.anchor is not None else 0.0

    def effective_anchor_weight(self, num_online_seqs: Optional[float] = None,
                                num_anchor_seqs: Optional[float] = None) -> float:
        """The weight of ``L_pef`` in one optimiser step: ``eta`` (``anchor_weighting:
        token_mean``) or ``eta x num_anchor_seqs / num_online_seqs`` (``microbatch_share``, the
        DPH-RL authors' code; :func:`~.authors.anchor_weight`)."""
        if self.anchor is None:
            return 0.0
        return anchor_weight(self.anchor_weight, self.hparams.get("anchor_weighting", "token_mean"),
                             num_online_seqs=num_online_seqs, num_anchor_seqs=num_anchor_seqs)

    def describe(self) -> Dict[str, Any]:
        return {
            "name": self.name, "summary": self.summary, "estimator": self.estimator,
            "reward_shaping": list(self.reward_shaping), "adv_reshaping": list(self.adv_reshaping),
            "policy_loss": self.policy_loss, "regularizers": list(self.regularizers),
            "anchor": self.anchor, "aggregation": self.aggregation,
            "dynamic_sampling": self.dynamic_sampling, "hparams": dict(self.hparams),
            "needs": dataclasses.asdict(self.needs), "paper": self.paper,
            "authors_modes": authors_modes(self),
        }

    def with_overrides(self, **overrides) -> "Method":
        """A copy with hyperparameters (or ``aggregation`` / ``dynamic_sampling``) replaced."""
        m = copy.deepcopy(self)
        if overrides.get("lad_granularity") == "sequence" and "aggregation" not in overrides:
            # a sequence-level LAD loss is broadcast to every token of its response: averaging
            # per sequence first keeps long responses from weighing more (mean over sequences)
            overrides["aggregation"] = "seq-mean-token-mean"
        for key in ("aggregation", "dynamic_sampling"):
            if key in overrides:
                setattr(m, key, overrides.pop(key))
        valid = m.hparam_defaults()
        for k, v in overrides.items():
            if k not in valid:
                close = difflib.get_close_matches(k, list(valid) + ["aggregation", "dynamic_sampling"], n=3)
                hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
                raise ValueError(
                    f"method {m.name!r} has no hyperparameter {k!r}.{hint} "
                    f"Valid: {', '.join(sorted(valid))}, aggregation, dynamic_sampling"
                )
            m.hparams[k] = v
        m.validate()
        return m

    def validate(self) -> None:
        h = self.hparams
        if self.aggregation not in AGGREGATIONS:
            raise unknown_name_error("loss aggregation", self.aggregation, AGGREGATIONS)
        if self.anchor == "alpha":
            check_alpha(h["anchor_alpha"])
        if self.policy_loss == "lad" and not float(h["lad_eta"]) > 0:
            raise ValueError(f"lad_eta must be > 0, got {h['lad_eta']}")
        if "anchor_eta" in h and float(h["anchor_eta"]) < 0:
            raise ValueError(f"anchor_eta must be >= 0, got {h['anchor_eta']}")
        for key, valid in (("anchor_weighting", ANCHOR_WEIGHTINGS), ("js_def_online", JS_DEF_ONLINE_MODES),
                           ("log_z_head", LOG_Z_HEADS)):
            if key in h and h[key] not in valid:
                raise unknown_name_error(key, h[key], valid)
        if int(h["micro_batch_seqs"]) < 1:
            raise ValueError(f"micro_batch_seqs must be >= 1, got {h['micro_batch_seqs']}")
        if h.get("js_def_clamp") is not None and not float(h["js_def_clamp"]) > 0:
            raise ValueError(f"js_def_clamp must be > 0 or null, got {h['js_def_clamp']}")
        if h.get("flowrl_max_weight") is not None and not float(h["flowrl_max_weight"]) > 0:
            raise ValueError(f"flowrl_max_weight must be > 0 or null (unclipped), got {h['flowrl_max_weight']}")

    # -------------------------------------------------------------- rollout side
    def is_correct(self, rewards: torch.Tensor) -> torch.Tensor:
        """``correct_i = (R_i >= correct_threshold)`` on the task rewards (before shaping)."""
        return torch.as_tensor(rewards) >= float(self.hparams["correct_threshold"])

    def shape_rewards(
        self, rewards: torch.Tensor, group_size: int, *,
        seq_mean_old_log_probs: Optional[torch.Tensor] = None,
        lengths: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Reward shaping before the advantage estimator: DAPO overlong (when the method
        sets ``overlong_max_len`` and ``lengths`` are given) and the unlikeliness reward."""
        r = torch.as_tensor(rewards, dtype=torch.float32).clone()
        h = self.hparams
        if h.get("overlong_max_len") is not None and lengths is not None:
            r = r + overlong_penalty(lengths, int(h["overlong_max_len"]), int(h["overlong_cache_len"]))
        if "unlikeliness" in self.reward_shaping:
            if seq_mean_old_log_probs is None:
                raise ValueError(f"method {self.name!r} needs seq_mean_old_log_probs for the unlikeliness reward")
            r = unlikeliness_rewards(r, seq_mean_old_log_probs, group_size, h["unlikeliness_beta"])
        return r

    def keep_groups(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """``[B]`` bool: groups to train on (dynamic sampling drops all-equal groups)."""
        r = torch.as_tensor(rewards, dtype=torch.float32)
        if not self.dynamic_sampling:
            return torch.ones(r.numel() // group_size, dtype=torch.bool)
        return dynamic_sampling_mask(r, group_size)

    def sequence_advantages(self, rewards: torch.Tensor, group_size: int,
                            correct: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[N]`` advantages from (shaped) rewards by the method's estimator."""
        r = torch.as_tensor(rewards, dtype=torch.float32)
        if self.estimator == "passk":
            return passk_advantages(self._binary(r, correct), group_size, int(self.hparams["passk_k"]))
        if self.estimator == "pkpo":
            return pkpo_advantages(self._binary(r, correct), group_size, int(self.hparams["passk_k"]))
        return group_advantages(r, group_size, self.estimator)

    def _binary(self, r, correct):
        c = self.is_correct(r) if correct is None else torch.as_tensor(correct)
        return c.to(torch.float32)

    def advantages(
        self, rewards: torch.Tensor, group_size: int, *,
        old_log_probs: torch.Tensor, mask: torch.Tensor,
        correct: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Token-level advantages ``[N, T]``: estimator, then DS reshaping if the method has it.

        ``rewards`` are the shaped rewards; ``correct`` defaults to ``is_correct(rewards)``
        (pass the task rewards' correctness when shaping changed them). EntAdv, which needs
        the training forward's entropy, is applied inside :meth:`loss`.
        """
        check_same_shape("old_log_probs", old_log_probs, mask=mask)
        seq = self.sequence_advantages(rewards, group_size, correct)
        if "ds" in self.adv_reshaping:
            c = self.is_correct(rewards) if correct is None else torch.as_tensor(correct)
            h = self.hparams
            return ds_reshape_advantages(seq, c, old_log_probs, mask, float(h["gamma_p"]),
                                         float(h["gamma_n"]), h["ds_granularity"])
        return seq.to(old_log_probs.dtype).unsqueeze(-1) * mask.to(old_log_probs.dtype)

    # -------------------------------------------------------------- training side
    def online_loss(self, b: LossInputs) -> Tuple[torch.Tensor, Dict[str, float]]:
        """Per-token loss ``[B, T]`` on rollout tokens: policy loss + regularizers.

        The policy loss and the regularizers run as one fused per-token loss where they can
        (``_fused``: value and hand-derived gradient, one backward product for all of them;
        every policy loss but FlowRL and sequence-level LAD, and the k3 KL, the online
        JS-definition term and the entropy terms); the logged metrics reuse its intermediate
        sums. The rest goes through autograd. Metrics are masked means over valid tokens, read
        back to the host in one transfer.
        """
        h = self.hparams
        name = self.name
        adv = b.advantages
        if adv.dim() == 1:
            adv = adv.to(b.log_probs.dtype).unsqueeze(-1).expand_as(b.log_probs)
        if "entadv" in self.adv_reshaping:
            H = _require(b, "entropy", name, "entropy")
            adv = entropy_advantages(adv, H, b.mask, float(h["entadv_alpha"]), float(h["entadv_kappa"]))
        check_same_shape("log_probs", b.log_probs, old_log_probs=b.old_log_probs, mask=b.mask)
        keep = Keep(b.mask)
        sums: Dict[str, torch.Tensor] = {}  # metric -> sum over valid tokens
        fused = self._fused_regularizers(b)
        pl = self.policy_loss
        if fused is not None:
            A = broadcast_seq("advantages", adv, b.log_probs).detach()
            others = (b.entropy,) if {"entropy", "diff_entropy"} & set(fused) else ()
            loss = per_token(lambda need_coef: self._fused_online(b, A, keep, fused, need_coef, sums),
                             b.log_probs, others=others)
        else:
            fused = ()
            if pl == "ppo_clip":
                loss = ppo_clip_loss(b.log_probs, b.old_log_probs, adv, b.mask,
                                     h["eps_low"], h["eps_high"], h["dual_clip"])
            elif pl == "cispo":
                loss = cispo_loss(b.log_probs, b.old_log_probs, adv, b.mask, h["eps_low"], h["eps_high"])
            elif pl == "clip_cov":
                loss = clip_cov_loss(b.log_probs, b.old_log_probs, adv, b.mask, h["eps_low"], h["eps_high"],
                                     h["dual_clip"], h["clip_cov_ratio"], h["clip_cov_lb"], h["clip_cov_ub"],
                                     generator=b.generator)
            elif pl == "kl_cov":
                loss = kl_cov_loss(b.log_probs, b.old_log_probs, adv, b.mask, self._kl_cov_ratio(b), h["kl_cov_k"])
            elif pl == "lad":
                clip = h["lad_clip"]
                loss = lad_loss(b.log_probs, b.old_log_probs, adv, b.mask, h["lad_divergence"],
                                float(h["lad_eta"]), h["lad_granularity"], tuple(clip) if clip is not None else None)
                loss = loss * self._lad_scale()
            elif pl == "flowrl":
                ref = _require(b, "ref_log_probs", name, "ref_log_probs")
                log_z = _require(b, "log_z", name, "prompt_hidden")
                seq_adv = masked_mean(adv, b.mask, dim=1)
                loss = flowrl_loss(b.log_probs, b.old_log_probs, ref, seq_adv, log_z, b.mask,
                                   float(h["flowrl_beta"]),
                                   None if h["flowrl_max_weight"] is None else float(h["flowrl_max_weight"]))
            else:  # pragma: no cover - guarded by register_method
                raise unknown_name_error("policy loss", pl, POLICY_LOSSES)
            with torch.no_grad():
                A = broadcast_seq("advantages", adv, b.log_probs)
                sums["clipfrac"] = clipped_count(b.log_probs, b.old_log_probs, A, keep,
                                                 float(h.get("eps_low", 0.2)), float(h.get("eps_high", 0.2)))
                sums["policy_loss"] = loss.detach().sum()  # every policy loss is 0 at masked tokens
        for reg in self.regularizers:
            if reg in fused:
                continue
            if reg == "kl":
                ref = _require(b, "ref_log_probs", name, "ref_log_probs")
                kl = kl_estimate(b.log_probs, ref, b.mask, h["kl_estimator"])
                loss = loss + float(h["kl_coef"]) * kl
                sums["kl"] = kl.detach().sum()
            elif reg == "entropy":
                H = _require(b, "entropy", name, "entropy")
                loss = loss + entropy_loss(H, b.mask, float(h["entropy_coef"]))
                sums["entropy"] = masked_sum(H.detach(), b.mask)
            elif reg == "diff_entropy":
                H = _require(b, "entropy", name, "entropy")
                c = _require(b, "correct", name, "correct")
                loss = loss + diff_entropy_loss(H, c, b.mask, float(h["entropy_coef_pos"]),
                                                float(h["entropy_coef_neg"]))
                sums["entropy"] = masked_sum(H.detach(), b.mask)
            elif reg == "js_def_online":
                ref = _require(b, "ref_log_probs", name, "ref_log_probs")
                js = dph_js_def_loss(b.log_probs, ref, b.mask, on="online")
                if h["js_def_clamp"] is not None:  # verl's kl_penalty clamp (docs/ALGORITHMS.md 9, row 3a)
                    js = clamp_k3(js, float(h["js_def_clamp"]))
                loss = loss + self._js_def_online_weight(b) * js
                sums["js_def_online"] = js.detach().sum()
        # masked means, in the order the components were listed (one device -> host copy)
        keys = ["clipfrac", "policy_loss"] + [k for k in dict.fromkeys(_REG_METRIC[r] for r in self.regularizers)]
        with torch.no_grad():
            n = b.mask.to(b.log_probs.dtype).sum().clamp(min=1.0).double()
            vals = (torch.stack([sums[k].double() for k in keys]) / n).tolist()
        return loss, dict(zip(keys, vals))

    def _kl_cov_ratio(self, b: LossInputs) -> float:
        """KL-Cov's ratio; with ``kl_cov_min_one`` at least one token is penalised (verl's
        ``max(1, int(N * ratio))``, docs/ALGORITHMS.md 9 row 9c)."""
        ratio = float(self.hparams["kl_cov_ratio"])
        if self.hparams.get("kl_cov_min_one"):
            n = float(b.mask.sum())
            if n >= 1 and math.floor(ratio * n) < 1:
                return (1.0 + 1e-9) / n
        return ratio

    def _lad_scale(self) -> float:
        """2 for Hellinger without the 1/2 (``lad_hellinger_half: false``, LAD Table 5's loss column)."""
        h = self.hparams
        return 2.0 if h["lad_divergence"] == "hellinger" and not h.get("lad_hellinger_half", True) else 1.0

    def _js_def_online_weight(self, b: LossInputs) -> float:
        """Weight of the online ``KL(pi || M)`` half: ``eta x js_def_lambda`` (``fixed``), or the
        DPH-RL authors' ``eta`` on a micro-batch when ``randint(1, 10) <= js_def_ratio`` and 0
        otherwise (``stochastic``, drawn from ``LossInputs.generator``)."""
        h = self.hparams
        if h["js_def_online"] == "fixed":
            return self.anchor_weight * float(h["js_def_lambda"])
        if b.generator is None:
            raise ValueError(f"method {self.name!r} with js_def_online='stochastic' needs LossInputs.generator "
                             "(a seeded torch.Generator; both engines pass theirs)")
        return self.anchor_weight if js_def_online_gate(b.generator, int(h["js_def_ratio"])) else 0.0

    def _fused_regularizers(self, b: LossInputs) -> Optional[Tuple[str, ...]]:
        """The regularizers that join the fused policy loss (the others go through autograd),
        or None when the policy loss itself is not fused (FlowRL, sequence-level LAD, or a
        gradient wanted for the old log-probs)."""
        h = self.hparams
        if (self.policy_loss == "flowrl" or (self.policy_loss == "lad" and h["lad_granularity"] != "token")
                or b.old_log_probs.requires_grad):
            return None
        regs = []
        for reg in self.regularizers:
            if reg == "js_def_online" and (h["js_def_online"] != "fixed" or h["js_def_clamp"] is not None):
                continue  # the authors' options go through autograd
            if reg == "js_def_online" or (reg == "kl" and h["kl_estimator"] == "k3"):
                ref = _require(b, "ref_log_probs", self.name, "ref_log_probs")
                check_same_shape("log_probs", b.log_probs, ref_log_probs=ref)
                if not ref.requires_grad:
                    regs.append(reg)
            elif reg in ("entropy", "diff_entropy"):
                H = _require(b, "entropy", self.name, "entropy")
                check_same_shape("entropy", H, mask=b.mask)
                if reg == "diff_entropy":
                    _require(b, "correct", self.name, "correct")
                regs.append(reg)
        return tuple(regs)

    def _fused_online(self, b, A, keep, regs, need_coef, sums):
        """``(value, coef, extras)`` of the policy loss plus the fused regularizers (``_fused``);
        ``extras``: the entropy's gradient, when an entropy term is fused."""
        h = self.hparams
        pl = self.policy_loss
        lp, old = b.log_probs.detach(), b.old_log_probs.detach()
        clip_eps = (float(h.get("eps_low", 0.2)), float(h.get("eps_high", 0.2)))  # clipfrac's
        stats: Dict[str, torch.Tensor] = {}
        if pl in ("ppo_clip", "clip_cov") and h["dual_clip"] is not None and h["dual_clip"] <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {h['dual_clip']}")
        if pl == "ppo_clip":
            value, coef = ppo_clip_terms(lp, old, A, keep, h["eps_low"], h["eps_high"], h["dual_clip"],
                                         need_coef, stats)
        elif pl == "clip_cov":
            value, coef = clip_cov_terms(lp, old, A, keep, h["eps_low"], h["eps_high"], h["dual_clip"],
                                         h["clip_cov_ratio"], h["clip_cov_lb"], h["clip_cov_ub"],
                                         b.generator, need_coef, stats)
        elif pl == "cispo":
            value, coef = cispo_terms(lp, old, A, keep, h["eps_low"], h["eps_high"], need_coef, stats, clip_eps)
        elif pl == "kl_cov":
            value, coef = kl_cov_terms(lp, old, A, keep, self._kl_cov_ratio(b), h["kl_cov_k"], need_coef, stats,
                                       clip_eps)
        else:  # lad, token granularity
            clip = h["lad_clip"]
            value, coef = lad_terms(lp, old, A, keep, h["lad_divergence"], float(h["lad_eta"]),
                                    tuple(clip) if clip is not None else None, need_coef, stats, clip_eps)
            scale = self._lad_scale()
            if scale != 1.0:
                value = value * scale
                coef = None if coef is None else coef * scale
        if "clipped" in stats:
            sums["clipfrac"] = stats["clipped"].sum()
        elif "clip_count" in stats:
            sums["clipfrac"] = stats["clip_count"]
        else:  # a term that does not report it
            sums["clipfrac"] = clipped_count(lp, old, A, keep, *clip_eps)
        sums["policy_loss"] = value.sum()
        extras = []
        H_f = None
        for reg in regs:
            if reg in ("kl", "js_def_online"):
                ref = b.ref_log_probs.detach()
                if reg == "kl":  # k3; the sign of its coefficient is folded into the weight
                    v, c = _k3(lp, ref, keep, 10.0, need_coef)
                    w, cw = float(h["kl_coef"]), -float(h["kl_coef"])
                else:
                    v, c, sign = _js_def(lp, ref, keep, "online", need_coef)
                    w = self.anchor_weight * float(h["js_def_lambda"])
                    cw = sign * w
                sums[_REG_METRIC[reg]] = v.sum()
                value.add_(v, alpha=w)
                if need_coef:
                    coef.add_(c, alpha=cw)
                continue
            # entropy terms: -c_H H (entropy), -c_pos H / +c_neg H by correctness (diff_entropy);
            # no gradient to log_probs, d / d H = that weight at valid tokens
            if H_f is None:
                H_f = keep.filled(b.entropy.detach())
                sums["entropy"] = H_f.sum()
            if reg == "entropy":
                w = -float(h["entropy_coef"])
                value.add_(H_f, alpha=w)
            else:
                w = diff_entropy_weights(b.correct, H_f, float(h["entropy_coef_pos"]), float(h["entropy_coef_neg"]))
                value.addcmul_(H_f, w)
            extras.append(w)
        if extras:  # the entropy's gradient: the weights summed, at valid tokens
            def grad_entropy(g, ws=tuple(extras)):
                gf = keep.filled(g)
                out = gf * ws[0]
                for w in ws[1:]:
                    out.add_(gf * w)
                return out
            return value, coef, (grad_entropy,)
        return value, coef

    def anchor_loss(self, a: AnchorInputs) -> torch.Tensor:
        """Unweighted per-token anchor loss ``[B, T]`` on ``D_pef`` tokens."""
        if self.anchor is None:
            raise ValueError(f"method {self.name!r} has no anchor loss (needs.anchor_batch is False)")
        if self.anchor == "js_def":
            loss = dph_js_def_loss(a.log_probs, a.ref_log_probs, a.mask, on="anchor")
            c = self.hparams.get("js_def_clamp")
            return loss if c is None else clamp_k3(loss, float(c))
        return dph_anchor_loss(a.log_probs, a.ref_log_probs, a.mask, self.anchor,
                               alpha=self.hparams.get("anchor_alpha", 0.5))

    def loss(
        self,
        online: Optional[LossInputs] = None,
        anchor: Optional[AnchorInputs] = None,
        num_online_tokens: Optional[float] = None,
        num_anchor_tokens: Optional[float] = None,
        num_online_seqs: Optional[float] = None,
        num_anchor_seqs: Optional[float] = None,
    ) -> Tuple[torch.Tensor, Dict[str, float]]:
        """Scalar ``L = L_exp + eta * L_pef`` for one micro-batch (either part may be absent).

        Each part is aggregated over its own tokens; the ``num_*`` arguments give the
        global counts of the optimiser step so micro-batch losses add up exactly. With
        ``anchor_weighting: microbatch_share`` the anchor weight is ``eta x num_anchor_seqs /
        num_online_seqs`` (both default to this micro-batch's rows); with aggregation
        ``micro-batch-token-mean`` both parts are means of ``micro_batch_seqs``-sequence
        token-means (docs/ALGORITHMS.md section 9).
        """
        if num_online_seqs is None and online is not None:
            num_online_seqs = float(online.log_probs.shape[0])
        if num_anchor_seqs is None and anchor is not None:
            num_anchor_seqs = float(anchor.log_probs.shape[0])
        k = int(self.hparams["micro_batch_seqs"])
        total = None
        metrics: Dict[str, float] = {}
        parts: Dict[str, torch.Tensor] = {}
        if online is not None:
            per_tok, metrics = self.online_loss(online)
            l_exp = aggregate_loss(per_tok, online.mask, self.aggregation, num_online_tokens, num_online_seqs,
                                   masked_zero=True, micro_batch_seqs=k)
            parts["loss_exp"] = l_exp.detach()
            total = l_exp
        if anchor is not None:
            per_tok = self.anchor_loss(anchor)
            agg = MICRO_BATCH_TOKEN_MEAN if self.aggregation == MICRO_BATCH_TOKEN_MEAN else "token-mean"
            l_pef = aggregate_loss(per_tok, anchor.mask, agg, num_anchor_tokens, num_anchor_seqs, masked_zero=True,
                                   micro_batch_seqs=k)
            parts["loss_pef"] = l_pef.detach()
            weighted = self.effective_anchor_weight(num_online_seqs, num_anchor_seqs) * l_pef
            total = weighted if total is None else total + weighted
        if total is None:
            raise ValueError("Method.loss needs online inputs, anchor inputs, or both")
        parts["loss"] = total.detach()
        metrics.update(zip(parts, torch.stack([p.double() for p in parts.values()]).tolist()))
        return total, metrics


# ------------------------------------------------------------------ the registry
_REGISTRY: Dict[str, Method] = {}


def register_method(method: Method, overwrite: bool = False) -> Method:
    """Add a method (its hyperparameters are completed with the components' defaults)."""
    if method.name in _REGISTRY and not overwrite:
        raise ValueError(f"method {method.name!r} is already registered")
    for kind, val, table in (("estimator", method.estimator, ESTIMATORS),
                             ("policy loss", method.policy_loss, POLICY_LOSSES)):
        if val not in table:
            raise unknown_name_error(kind, val, table)
    for kind, vals, table in (("reward shaping", method.reward_shaping, REWARD_SHAPING),
                              ("advantage reshaping", method.adv_reshaping, ADV_RESHAPING),
                              ("regularizer", method.regularizers, REGULARIZERS)):
        for v in vals:
            if v not in table:
                raise unknown_name_error(kind, v, table)
    if method.anchor is not None and method.anchor not in ANCHORS:
        raise unknown_name_error("anchor divergence", method.anchor, ANCHORS)
    given = dict(method.hparams)
    method.hparams = method.hparam_defaults()
    full = method.with_overrides(**given)
    _REGISTRY[method.name] = full
    return full


def get_method(name: str, **overrides) -> Method:
    """A fresh copy of the named preset, with hyperparameter ``overrides`` applied."""
    if name not in _REGISTRY:
        raise unknown_name_error("method", name, _REGISTRY)
    return _REGISTRY[name].with_overrides(**overrides)


def list_methods() -> Tuple[str, ...]:
    return tuple(_REGISTRY)


def method_table() -> Mapping[str, Dict[str, Any]]:
    return {n: m.describe() for n, m in _REGISTRY.items()}


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
