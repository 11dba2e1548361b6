"""The registries: components by name, and methods composed of them (docs/plugins.md: the
registration signatures and a worked example each for a method, an estimator and a task).

A **component** is a plain autograd function registered under a name, with the
hyperparameters it takes (``defaults``) and what it asks of an engine (:class:`Needs`):

* ``@register_policy_loss(name, defaults=..., needs=..., metrics=(...))``:
  ``fn(inputs: LossInputs, **hparams) -> (per_token_loss [B, T], metrics)``; ``metrics`` names
  what it reports (e.g. ``clipfrac`` for the losses that clip; returning an undeclared metric,
  or missing a declared one, is an error naming the component)
* ``@register_regularizer(..., metrics=(...))``: the same shape; its loss is added to the policy
  loss (weighted by its own coefficient, which it declares).
* ``@register_anchor(name, defaults=..., eta=...)``: ``fn(inputs: AnchorInputs, **hparams)
  -> per_token_loss``; ``eta`` is the default of the method's ``anchor_eta`` weight.
* ``@register_estimator(..., group=True, openrlhf_estimator="group_norm")``: ``fn(rewards [N],
  group_size, correct [N] bool, **hparams) -> [N]`` sequence advantages; ``group``: its
  advantages need at least 2 responses per prompt (the engines refuse ``group_size < 2``);
  ``openrlhf_estimator``: the critic-free ``--algo.advantage.estimator`` the OpenRLHF driver
  sets (topology only: the advantages come from ``fn``).
* ``@register_reward_shaping(...)``: ``fn(rewards [N], group_size, *, seq_mean_old_log_probs,
  lengths, **hparams) -> [N]``.
* ``@register_adv_reshaping(name, ..., at="rollout" | "loss")``: at rollout time
  ``fn(advantages [N] or [N, T], *, correct, old_log_probs, mask, **hparams) -> [N, T]``; at
  loss time ``fn(advantages [B, T], inputs: LossInputs, **hparams) -> [B, T]``.

Each function is called with its own declared hyperparameters (the keys of ``defaults``) as
keyword arguments. Per-token tensors are ``[B, T]``, losses zero where the mask is 0. A
metric is a scalar or a ``[B, T]`` tensor (logged as its mean over valid tokens).

A :class:`Method` names its components; it accepts exactly their hyperparameters (a typo is
an error with a "did you mean"), and ``Method.needs`` is the union of their needs. Engines
never branch on a method's name: they read ``method.needs``, hand the method tensors, and
apply what it returns::

    method = get_method("dph_js", anchor_eta=0.1)
    out = method.rollout(raw_rewards, G, old_log_probs=old, mask=mask, lengths=lengths)
    ...                                               # per micro-batch, training forward:
    loss, metrics = method.loss(
        online=LossInputs(log_probs=lp, old_log_probs=old, advantages=out.advantages, mask=mask,
                          correct=out.correct, entropy=H, ref_log_probs=ref),
        anchor=AnchorInputs(log_probs=alp, ref_log_probs=stored_ref, mask=amask),
        num_online_tokens=..., num_anchor_tokens=...)  # global counts, for grad accumulation
    loss.backward()

``L = L_exp + eta * L_pef``, each aggregated over its own tokens (ALGORITHMS.md 4). A new
policy loss is one decorated function; a new method one :func:`register_method` call.
``OPENRLHF_DIV_COMPILE=1`` (or :func:`compile_losses`) runs the per-token loss functions
through ``torch.compile(dynamic=True)``; off by default (docs/benchmarks.md).
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Tuple

import torch

from ._utils import broadcast_seq, check_same_shape, fill_masked, masked_mean, unknown_name_error
from .advantages import dynamic_sampling_mask, overlong_penalty
from .authors import (ANCHOR_WEIGHTINGS, AUTHORS_RUN_SETTINGS, MICRO_BATCH_TOKEN_MEAN, anchor_weight,
                      authors_modes, micro_batch_loss)
from .losses import AGGREGATIONS, aggregate_loss


@dataclass(frozen=True)
class Needs:
    """What a method (the union of its components) asks of an engine."""

    ref_log_probs: bool = False   # an online reference-model forward on rollouts
    anchor_batch: bool = False    # D_pef anchor samples with their stored base log-probs
    entropy: bool = False         # full-vocabulary entropy at the training forward
    old_log_probs: bool = True    # behaviour-policy log-probs of the rollouts
    prompt_hidden: bool = False   # prompt hidden states, for FlowRL's log Z head

    def __or__(self, other: "Needs") -> "Needs":
        return Needs(**{f.name: getattr(self, f.name) or getattr(other, f.name) for f in fields(self)})


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


# ------------------------------------------------------------------ components
_INPUT_OF_NEED = {"ref_log_probs": "ref_log_probs", "entropy": "entropy", "prompt_hidden": "log_z"}


@dataclass(frozen=True)
class Component:
    """A registered function with its hyperparameter defaults and needs."""

    kind: str
    name: str
    fn: Callable
    defaults: Mapping[str, Any]
    needs: Needs
    check: Optional[Callable[[Dict[str, Any]], None]] = None  # validates the method's hparams
    at: str = "loss"            # adv reshaping: "rollout" or "loss"
    passed: Optional[Tuple[str, ...]] = None  # the hyperparameters fn takes (None: all of defaults)
    metrics: Tuple[str, ...] = ()  # policy loss / regularizer: the metric names fn returns
    group: bool = True          # estimator: advantages need >= 2 responses per prompt
    openrlhf_estimator: str = "group_norm"  # estimator: OpenRLHF's critic-free estimator flag
    help: Mapping[str, Tuple[str, str]] = field(default_factory=dict)  # hparam -> (one line, its source)
    batch_statistics: bool = False  # policy loss / regularizer: its per-token loss depends on the other
    #                                 rows of its micro-batch (Clip-Cov, KL-Cov); engines keep such grouping

    def check_metrics(self, metrics: Mapping[str, Any]) -> None:
        """The metrics ``fn`` returned are exactly the ones it declared."""
        got = set(metrics)
        if got != set(self.metrics):
            extra, missing = sorted(got - set(self.metrics)), sorted(set(self.metrics) - got)
            raise ValueError(f"{self.kind} {self.name!r} returned metrics {sorted(got)} but declares "
                             f"{list(self.metrics)}" + (f" (undeclared: {extra})" if extra else "")
                             + (f" (missing: {missing})" if missing else "")
                             + f"; register it with metrics={tuple(sorted(got))!r}")

    def kwargs(self, hparams: Mapping[str, Any]) -> Dict[str, Any]:
        return {k: hparams[k] for k in (self.defaults if self.passed is None else self.passed)}

    def require(self, inputs, method: str) -> None:
        """A clear error when ``inputs`` lack a tensor this component declared it needs."""
        for need, attr in _INPUT_OF_NEED.items():
            if getattr(self.needs, need) and getattr(inputs, attr, None) is None:
                raise ValueError(f"method {method!r} ({self.kind} {self.name!r}) needs LossInputs.{attr} "
                                 f"(declared in Method.needs.{need}); got None")


#: one line of help and its source (paper equation, authors' script) per hyperparameter, declared
#: at registration (``register_*(..., help={name: (line, source)})``); ``--help``, ``openrlhf-div
#: methods NAME`` and docs/hyperparameters.md read them (:func:`hparam_help`)
COMMON_HELP: Dict[str, Tuple[str, str]] = {
    "correct_threshold": ("a response is correct when its task reward R >= this (binary verifiable rewards)",
                          "docs/ALGORITHMS.md Notation: correct_i = (R_i >= 1)"),
    "overlong_max_len": ("DAPO overlong reward shaping: L_max in tokens (null: no shaping)",
                         "DAPO (Yu et al. 2025) Sec. 3.4 soft overlong punishment; docs/ALGORITHMS.md section 2"),
    "overlong_cache_len": ("DAPO overlong reward shaping: the cache L_c before L_max where the penalty ramps",
                           "DAPO (Yu et al. 2025) Sec. 3.4; docs/ALGORITHMS.md section 2"),
    "micro_batch_seqs": ("sequences per group of aggregation micro-batch-token-mean (the engines' micro-batch rows "
                         "under it)", "seamoke/DPH-RL scripts/llama/*.sh ppo_micro_batch_size_per_gpu=2; "
                                      "docs/ALGORITHMS.md section 9 row 2"),
}
COMMON_HPARAMS: Dict[str, Any] = {
    "correct_threshold": 1.0,   # correct_i = (R_i >= threshold) for binary verifiable rewards
    "overlong_max_len": None,   # DAPO overlong shaping L_max (None: off)
    "overlong_cache_len": None,  # DAPO overlong shaping L_c
    "micro_batch_seqs": 2,      # sequences per group of aggregation "micro-batch-token-mean"
}
# micro-batch layout, not method hyperparameters: an experiment's `layout:` section
# (openrlhf_div.engines.layout; docs/ALGORITHMS.md section 9 rows 1, 1b)
ENGINE_LAYOUT_KEYS = ("step_layout", "micro_batch_tokens", "authors_world_size", "mixed_micro_batches")
ESTIMATORS: Dict[str, Component] = {}
REWARD_SHAPING: Dict[str, Component] = {}
ADV_RESHAPING: Dict[str, Component] = {}
POLICY_LOSSES: Dict[str, Component] = {}
REGULARIZERS: Dict[str, Component] = {}
ANCHORS: Dict[str, Component] = {}


def _check_help(kind: str, name: str, defaults: Mapping[str, Any], help) -> Dict[str, Tuple[str, str]]:
    """``help`` of a registration: ``{hparam: (one line, source)}`` for hyperparameters it declares."""
    out: Dict[str, Tuple[str, str]] = {}
    for k, v in dict(help or {}).items():
        if k not in defaults:
            raise ValueError(f"{kind} {name!r}: help for {k!r}, which is not one of its hyperparameters "
                             f"{sorted(defaults)}")
        if not (isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(x, str) and x.strip()
                                                                     and "\n" not in x for x in v)):
            raise ValueError(f"{kind} {name!r}: help[{k!r}] takes (one line of help, its source), got {v!r}")
        out[k] = (v[0], v[1])
    return out


def _registrar(kind: str, table: Dict[str, Component]):
    def register(name: str, defaults: Optional[Mapping[str, Any]] = None, needs: Optional[Needs] = None,
                 check: Optional[Callable] = None, overwrite: bool = False, help=None, **extra):
        d = dict(defaults or {})
        helps = _check_help(kind, name, d, help)

        def deco(fn: Callable) -> Callable:
            if name in table and not overwrite:
                raise ValueError(f"{kind} {name!r} is already registered (pass overwrite=True to replace it)")
            if "metrics" in extra:
                extra["metrics"] = tuple(extra["metrics"] or ())
            table[name] = Component(kind, name, fn, d, needs or Needs(), check, help=helps, **extra)
            return fn
        return deco
    register.__name__ = f"register_{kind.replace(' ', '_')}"
    register.__doc__ = f"Decorator: register ``fn`` as the {kind} ``name`` (see the module docstring)."
    return register


register_estimator = _registrar("estimator", ESTIMATORS)
register_reward_shaping = _registrar("reward shaping", REWARD_SHAPING)
register_policy_loss = _registrar("policy loss", POLICY_LOSSES)
register_regularizer = _registrar("regularizer", REGULARIZERS)


def register_adv_reshaping(name: str, defaults=None, needs=None, check=None, at: str = "rollout",
                           overwrite: bool = False, help=None):
    """Decorator: an advantage reshaping applied at rollout time (``at="rollout"``, on the
    estimator's output) or at the training forward (``at="loss"``, e.g. with the entropy)."""
    if at not in ("rollout", "loss"):
        raise unknown_name_error("advantage reshaping stage", at, ("rollout", "loss"))
    return _registrar("advantage reshaping", ADV_RESHAPING)(name, defaults, needs, check, overwrite, help=help, at=at)


ANCHOR_HELP: Dict[str, Tuple[str, str]] = {
    "anchor_eta": ("eta of L = L_exp + eta L_pef: the weight of the D_pef anchor loss",
                   "DPH-RL (seed 000) App. D Table 5 (DPH-F 0.01, DPH-JS 0.2); docs/ALGORITHMS.md section 4"),
    "anchor_weighting": ("token_mean: L_exp + eta L_pef, each a token-mean; microbatch_share: eta x #anchor / "
                         "#online sequences of the step, as the authors' code",
                         "seamoke/DPH-RL verl/workers/actor/dp_actor.py update_policy; docs/ALGORITHMS.md "
                         "section 9 row 1"),
}


def register_anchor(name: str, defaults=None, eta: float = 0.01, check=None, overwrite: bool = False, help=None):
    """Decorator: a ``D_pef`` anchor loss; ``eta`` is the default weight ``anchor_eta``. Every
    anchor also has ``anchor_weighting`` (``token_mean``: ``L_exp + eta L_pef``;
    ``microbatch_share``: the DPH-RL authors' ``eta x #anchor / #online`` sequences of the step,
    docs/ALGORITHMS.md section 9 row 1)."""
    d = dict(defaults or {})
    return _registrar("anchor", ANCHORS)(name, {"anchor_eta": eta, "anchor_weighting": "token_mean", **d},
                                         Needs(anchor_batch=True), check, overwrite,
                                         help={**ANCHOR_HELP, **dict(help or {})}, passed=tuple(d))


_KINDS = (("estimator", ESTIMATORS), ("reward shaping", REWARD_SHAPING), ("advantage reshaping", ADV_RESHAPING),
          ("policy loss", POLICY_LOSSES), ("regularizer", REGULARIZERS), ("anchor", ANCHORS))


def hparam_help(builtin_only: bool = False) -> Dict[str, Dict[str, Any]]:
    """Every registered hyperparameter -> ``{"help", "source", "default", "owners"}``: the help and
    source its registration declared (the first declaration; ``""`` where a plug-in gave none),
    a default and the components that take it. ``builtin_only``: the package's own components
    (no plug-in's)."""
    out: Dict[str, Dict[str, Any]] = {}
    for k, v in COMMON_HPARAMS.items():
        h, src = COMMON_HELP.get(k, ("", ""))
        out[k] = {"help": h, "source": src, "default": v, "owners": ["common"]}
    for kind, table in _KINDS:
        for comp in table.values():
            if builtin_only and not getattr(comp.fn, "__module__", "").startswith("openrlhf_div."):
                continue
            for k, v in comp.defaults.items():
                h, src = comp.help.get(k, ("", ""))
                e = out.setdefault(k, {"help": h, "source": src, "default": v, "owners": []})
                if not e["help"] and h:
                    e.update(help=h, source=src)
                e["owners"].append(f"{kind} {comp.name}")
    return out


#: the value type of hyperparameters whose registered default is None ("pair": two floats)
NONE_DEFAULT_TYPES: Dict[str, Any] = {"overlong_max_len": int, "overlong_cache_len": int, "js_def_clamp": float,
                                      "lad_clip": "pair"}


def hparam_type(name: str) -> Any:
    """The type of a hyperparameter's values: its first registered default's (bool, int, float,
    str), :data:`NONE_DEFAULT_TYPES` where that default is None; None for a name no component
    registers (a plug-in's None-default key: its value is kept as given)."""
    if name in COMMON_HPARAMS:
        default = COMMON_HPARAMS[name]
    else:
        default = next((c.defaults[name] for _, table in _KINDS for c in table.values() if name in c.defaults),
                       None)
    if default is None:
        return NONE_DEFAULT_TYPES.get(name)
    return "pair" if isinstance(default, (tuple, list)) else type(default)


def coerce_hparam(name: str, value: Any) -> Any:
    """The one coercion of a method hyperparameter's value to its type (:func:`hparam_type`),
    whatever read it: a YAML file or ``key=value`` override (a quoted ``"1e-3"`` arrives as a string there),
    a ``--div.<name>`` flag's text (the OpenRLHF / Megatron drivers' argparse type calls this) or a
    Python caller. ``none`` / ``null`` (or YAML null) is None for every non-string type. Every engine
    gets the same value from the same spelling (:meth:`Method.with_overrides` applies it). The
    conversion is the schema's (:func:`openrlhf_div.schema.convert_scalar`, which the settings' fields
    use too); this adds the hyperparameter's type and the wording of the error."""
    from openrlhf_div.schema import BadValue, convert_scalar

    kind = hparam_type(name)
    if value is None or kind is None:
        return value
    try:
        return convert_scalar(kind, value)
    except BadValue:
        pass
    if kind is bool:
        raise ValueError(f"method hyperparameter {name}: expected true or false, got {value!r}")
    if kind == "pair":
        raise ValueError(f"method hyperparameter {name}: expected two numbers [LOW, HIGH] or none, got {value!r}")
    raise ValueError(f"method hyperparameter {name}: expected {'an integer' if kind is int else 'a number'} "
                     f"(or none), got {value!r}")


def _check_anchor_eta(h: Dict[str, Any]) -> None:
    if float(h["anchor_eta"]) < 0:
        raise ValueError(f"anchor_eta must be >= 0, got {h['anchor_eta']}")
    if h.get("anchor_weighting", "token_mean") not in ANCHOR_WEIGHTINGS:
        raise unknown_name_error("anchor_weighting", h["anchor_weighting"], ANCHOR_WEIGHTINGS)


# ------------------------------------------------------------------ compile flag
_COMPILE = {"on": os.environ.get("OPENRLHF_DIV_COMPILE", "0").lower() in ("1", "true", "yes", "on")}
_COMPILED: Dict[Callable, Callable] = {}


def compile_losses(enabled: bool = True) -> None:
    """Run the per-token loss functions through ``torch.compile(dynamic=True)`` (opt-in; the
    environment variable ``OPENRLHF_DIV_COMPILE=1`` sets it in every process)."""
    _COMPILE["on"] = bool(enabled)


def _call(c: Component, inputs, hparams: Mapping[str, Any]):
    """``c.fn(inputs, **its hyperparameters)``, compiled when :func:`compile_losses` is on.

    Compiled, float hyperparameters are specialised (each value its own guarded graph):
    measured with torch 2.13, ``dynamic=True`` alone reused a graph traced for
    ``eps_high=0.2`` when called with ``0.28`` once a gradient was taken
    (tests/test_loss_references.py checks compiled against plain)."""
    kw = c.kwargs(hparams)
    if not _COMPILE["on"]:
        return c.fn(inputs, **kw)
    if c.fn not in _COMPILED:
        _COMPILED[c.fn] = torch.compile(c.fn, dynamic=True)
    with torch._dynamo.config.patch(specialize_float=True):
        return _COMPILED[c.fn](inputs, **kw)


class Rollout(NamedTuple):
    """What :meth:`Method.rollout` returns for ``N = B * G`` responses."""

    rewards: torch.Tensor      # [N] shaped rewards
    correct: torch.Tensor      # [N] bool, from the task rewards (before shaping)
    keep: torch.Tensor         # [N / G] bool: groups to train on (dynamic sampling)
    advantages: torch.Tensor   # [N, T] token-level advantages (0 at masked tokens)


# ------------------------------------------------------------------ methods
@dataclass
class Method:
    """A training method as data: component names and hyperparameters. See :func:`get_method`."""

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
    def components(self) -> Tuple[Component, ...]:
        """The method's components in order (an unknown name: an error with a "did you mean")."""
        def get(table, kind, n):
            if n not in table:
                raise unknown_name_error(kind, n, table)
            return table[n]
        out = [get(ESTIMATORS, "estimator", self.estimator)]
        out += [get(REWARD_SHAPING, "reward shaping", r) for r in self.reward_shaping]
        out += [get(ADV_RESHAPING, "advantage reshaping", r) for r in self.adv_reshaping]
        out.append(get(POLICY_LOSSES, "policy loss", self.policy_loss))
        out += [get(REGULARIZERS, "regularizer", r) for r in self.regularizers]
        if self.anchor is not None:
            out.append(get(ANCHORS, "anchor divergence", self.anchor))
        return tuple(out)

    def hparam_defaults(self) -> Dict[str, Any]:
        d = dict(COMMON_HPARAMS)
        for c in self.components():
            d.update(c.defaults)
        return d

    @property
    def needs(self) -> Needs:
        n = Needs()
        for c in self.components():
            n = n | c.needs
        return n

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
        help_ = hparam_help()
        return {
            "name": self.name, "summary": self.summary, "estimator": self.estimator,
            "reward_shaping": list(self.reward_shaping), "adv_reshaping": list(self.adv_reshaping),
            "policy_loss": self.policy_loss, "regularizers": list(self.regularizers),
            "anchor": self.anchor, "aggregation": self.aggregation,
            "dynamic_sampling": self.dynamic_sampling, "hparams": dict(self.hparams),
            "needs": dataclasses.asdict(self.needs), "paper": self.paper,
            "authors_modes": authors_modes(self),
            "hyperparameters": {k: {"value": v, "help": help_.get(k, {}).get("help", ""),
                                    "source": help_.get(k, {}).get("source", "")} for k, v in self.hparams.items()},
            **({"authors_run_settings": [dict(zip(("setting", "library", "authors", "source"), r))
                                         for r in AUTHORS_RUN_SETTINGS]} if self.anchor is not None else {}),
        }

    def spec(self) -> Dict[str, Any]:
        """The resolved method as data: its name, every hyperparameter's value (defaults included,
        each already through the one coercion), its aggregation and dynamic sampling. What a driver
        hands to its workers (``args.div.method_spec``): :func:`method_from_spec` rebuilds the same
        method from it, once per process, without reading a flag again."""
        return {"name": self.name, "hparams": dict(self.hparams), "aggregation": self.aggregation,
                "dynamic_sampling": bool(self.dynamic_sampling)}

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
            if k in ENGINE_LAYOUT_KEYS:
                raise ValueError(f"{k} is micro-batch layout, not a hyperparameter of method {m.name!r}: set "
                                 f"layout.{k} in the experiment's `layout:` section (--layout.{k} on the command line)")
            if k not in valid:
                close = difflib.get_close_matches(k, list(valid) + ["aggregation", "dynamic_sampling"], n=3)
                hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
                raise ValueError(
                    f"method {m.name!r} has no hyperparameter {k!r}.{hint} "
                    f"Valid: {', '.join(sorted(valid))}, aggregation, dynamic_sampling"
                )
            # the one coercion (an explicit none from a flag or a key=value override is None; a
            # quoted "1e-3" a float), whichever engine or loader the value came through
            m.hparams[k] = coerce_hparam(k, v)
        m.validate()
        return m

    def validate(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise unknown_name_error("loss aggregation", self.aggregation, AGGREGATIONS)
        if int(self.hparams.get("micro_batch_seqs", 2)) < 1:
            raise ValueError(f"micro_batch_seqs must be >= 1, got {self.hparams['micro_batch_seqs']}")
        for c in self.components():
            if c.check is not None:
                c.check(self.hparams)
        if self.anchor is not None:
            _check_anchor_eta(self.hparams)

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
        sets ``overlong_max_len`` and ``lengths`` are given), then each reward shaping."""
        r = torch.as_tensor(rewards, dtype=torch.float32).clone()
        h = self.hparams
        if h.get("overlong_max_len") is not None and lengths is not None:
            r = r + overlong_penalty(lengths, int(h["overlong_max_len"]), int(h["overlong_cache_len"]))
        for name in self.reward_shaping:
            c = REWARD_SHAPING[name]
            r = c.fn(r, group_size, seq_mean_old_log_probs=seq_mean_old_log_probs, lengths=lengths,
                     **c.kwargs(h))
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
        c = self.is_correct(r) if correct is None else torch.as_tensor(correct).bool()
        est = ESTIMATORS[self.estimator]
        return est.fn(r, group_size, c, **est.kwargs(self.hparams))

    def advantages(
        self, rewards: torch.Tensor, group_size: int, *,
        old_log_probs: torch.Tensor, mask: torch.Tensor,
        correct: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Token-level advantages ``[N, T]``: estimator, then the rollout-time reshapings.

        ``rewards`` are the shaped rewards; ``correct`` defaults to ``is_correct(rewards)``
        (pass the task rewards' correctness when shaping changed them). Loss-time reshapings
        (EntAdv, which needs the training forward's entropy) are applied inside :meth:`loss`.
        """
        check_same_shape("old_log_probs", old_log_probs, mask=mask)
        c = self.is_correct(rewards) if correct is None else torch.as_tensor(correct).bool()
        adv = self.sequence_advantages(rewards, group_size, c)
        for name in self.adv_reshaping:
            comp = ADV_RESHAPING[name]
            if comp.at == "rollout":
                adv = comp.fn(adv, correct=c, old_log_probs=old_log_probs, mask=mask, **comp.kwargs(self.hparams))
        if adv.dim() == 1:
            adv = adv.to(old_log_probs.dtype).unsqueeze(-1) * mask.to(old_log_probs.dtype)
        return adv

    def rollout(
        self, rewards: torch.Tensor, group_size: int, *,
        old_log_probs: torch.Tensor, mask: torch.Tensor,
        lengths: Optional[torch.Tensor] = None,
    ) -> Rollout:
        """The whole rollout side for ``N = B * G`` responses, in the spec's order: correctness
        of the task rewards, reward shaping (overlong with ``lengths``; unlikeliness with the
        sequence-mean old log-probs), kept groups (mixed correctness under dynamic sampling),
        token-level advantages ``[N, T]``."""
        rewards = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1).cpu()
        check_same_shape("old_log_probs", old_log_probs, mask=mask)
        if rewards.numel() != old_log_probs.shape[0]:
            raise ValueError(f"{rewards.numel()} rewards for {old_log_probs.shape[0]} responses")
        if int(group_size) < 1 or rewards.numel() % int(group_size):
            raise ValueError(f"{rewards.numel()} responses are not a whole number of groups of {group_size} "
                             "(the group size: rollout.group_size, --rollout.n_samples_per_prompt on OpenRLHF)")
        correct = self.is_correct(rewards)
        seq_mean_old = masked_mean(old_log_probs, mask, dim=1).cpu()
        shaped = self.shape_rewards(rewards, group_size, seq_mean_old_log_probs=seq_mean_old,
                                    lengths=None if lengths is None else torch.as_tensor(lengths).cpu())
        # DAPO's refill criterion, the same in both engines: a group is kept when its correctness
        # is mixed (0 < #correct < G), on the task rewards before shaping (OpenRLHF filters on scores)
        keep = self.keep_groups(correct.float(), group_size)
        dev = old_log_probs.device
        adv = self.advantages(shaped.to(dev), group_size, old_log_probs=old_log_probs, mask=mask,
                              correct=correct.to(dev))
        return Rollout(shaped, correct, keep, adv)

    # -------------------------------------------------------------- training side
    def online_loss(self, b: LossInputs) -> Tuple[torch.Tensor, Dict[str, float]]:
        """Per-token loss ``[B, T]`` on rollout tokens: policy loss + regularizers.

        Metrics (masked means over valid tokens, one host transfer): ``policy_loss``, then what
        the policy loss and each regularizer declare (``clipfrac`` only from the losses that
        clip: :meth:`metric_names`)."""
        h = self.hparams
        adv = broadcast_seq("advantages", b.advantages, b.log_probs)
        for name in self.adv_reshaping:
            comp = ADV_RESHAPING[name]
            if comp.at == "loss":
                comp.require(b, self.name)
                adv = comp.fn(adv, b, **comp.kwargs(h))
        b = dataclasses.replace(b, advantages=adv)
        pol = POLICY_LOSSES[self.policy_loss]
        pol.require(b, self.name)
        loss, extra = _call(pol, b, h)
        pol.check_metrics(extra)
        metrics = {"policy_loss": loss, **extra}
        for name in self.regularizers:
            reg = REGULARIZERS[name]
            reg.require(b, self.name)
            l_reg, m_reg = _call(reg, b, h)
            reg.check_metrics(m_reg)
            loss = loss + l_reg
            metrics.update(m_reg)
        return loss, _means(metrics, b.mask)

    def metric_names(self) -> Tuple[str, ...]:
        """The metrics :meth:`online_loss` reports, from the components' declarations."""
        names = ["policy_loss", *POLICY_LOSSES[self.policy_loss].metrics]
        for r in self.regularizers:
            names += [m for m in REGULARIZERS[r].metrics if m not in names]
        return tuple(names)

    def anchor_loss(self, a: AnchorInputs) -> torch.Tensor:
        """Unweighted per-token anchor loss ``[B, T]`` on ``D_pef`` tokens."""
        if self.anchor is None:
            raise ValueError(f"method {self.name!r} has no anchor loss (needs.anchor_batch is False)")
        c = ANCHORS[self.anchor]
        return _call(c, a, self.hparams)

    def loss(
        self,
        online: Optional[LossInputs] = None,
        anchor: Optional[AnchorInputs] = None,
        num_online_tokens: Optional[float] = None,
        num_anchor_tokens: Optional[float] = None,
        num_online_seqs: Optional[float] = None,
        num_anchor_seqs: Optional[float] = None,
        micro_batch_coef: Optional[float] = None,
    ) -> Tuple[torch.Tensor, Dict[str, float]]:
        """Scalar ``L = L_exp + eta * L_pef`` for one micro-batch (either part may be absent).

        Each part is aggregated over its own tokens; the ``num_*`` arguments give the
        global counts of the optimiser step so micro-batch losses add up exactly. With
        ``anchor_weighting: microbatch_share`` the anchor weight is ``eta x num_anchor_seqs /
        num_online_seqs`` (both default to this micro-batch's rows); with aggregation
        ``micro-batch-token-mean`` both parts are means of ``micro_batch_seqs``-sequence
        token-means (docs/ALGORITHMS.md section 9).

        ``micro_batch_coef`` ``c``: this micro-batch is one of the authors' (engines under
        ``micro-batch-token-mean``, :func:`~.authors.plan_micro_batches`): it holds one kind of
        row, and ``L = c x token_mean(online loss)`` or ``c x eta x token_mean(anchor loss)`` over
        its own tokens (the ``num_*`` counts are not used). The anchor share of the step then
        comes from the layout (``anchor_weighting: microbatch_share``, which it requires).
        """
        if micro_batch_coef is not None:
            return self._micro_batch_loss(online, anchor, float(micro_batch_coef))
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
                                   micro_batch_seqs=k)
            parts["loss_exp"] = l_exp.detach()
            total = l_exp
        if anchor is not None:
            agg = MICRO_BATCH_TOKEN_MEAN if self.aggregation == MICRO_BATCH_TOKEN_MEAN else "token-mean"
            l_pef = aggregate_loss(self.anchor_loss(anchor), anchor.mask, agg, num_anchor_tokens, num_anchor_seqs,
                                   micro_batch_seqs=k)
            parts["loss_pef"] = l_pef.detach()
            weighted = self.effective_anchor_weight(num_online_seqs, num_anchor_seqs) * l_pef
            total = weighted if total is None else total + weighted
        if total is None:
            raise ValueError("Method.loss needs online inputs, anchor inputs, or both")
        parts["loss"] = total.detach()
        metrics.update(zip(parts, torch.stack([p.double() for p in parts.values()]).tolist()))
        return total, metrics

    def _micro_batch_loss(self, online, anchor, coef: float) -> Tuple[torch.Tensor, Dict[str, float]]:
        """Method.loss with ``micro_batch_coef`` (see there)."""
        if online is not None and anchor is not None:
            raise ValueError("a micro-batch of the authors' layout holds rollout rows or anchor rows, not both "
                             "(authors.plan_micro_batches keeps them apart); got both")
        metrics: Dict[str, float] = {}
        parts: Dict[str, torch.Tensor] = {}
        if online is not None:
            per_tok, metrics = self.online_loss(online)
            total = micro_batch_loss(per_tok, online.mask, coef)
            parts["loss_exp"] = total.detach()
        elif anchor is not None:
            if self.hparams.get("anchor_weighting", "token_mean") != "microbatch_share":
                raise ValueError(
                    f"method {self.name!r}: the authors' micro-batch layout (aggregation micro-batch-token-mean on an "
                    "engine) weights each anchor micro-batch eta like the authors' code, which is anchor_weighting: "
                    "microbatch_share; set it (or use aggregation token-mean for the spec's L_exp + eta L_pef)")
            l_pef = micro_batch_loss(self.anchor_loss(anchor), anchor.mask, coef)
            parts["loss_pef"] = l_pef.detach()
            total = self.anchor_weight * l_pef
        else:
            raise ValueError("Method.loss needs online inputs, anchor inputs, or both")
        parts["loss"] = total.detach()
        metrics.update(zip(parts, torch.stack([p.double() for p in parts.values()]).tolist()))
        return total, metrics


def _means(metrics: Dict[str, Any], mask: torch.Tensor) -> Dict[str, float]:
    """Floats of metrics: ``[B, T]`` tensors as masked means, scalars as they are (one transfer)."""
    out, tensors = {}, {}
    with torch.no_grad():
        n = mask.to(torch.float64).sum().clamp(min=1.0)
        for k, v in metrics.items():
            if not isinstance(v, torch.Tensor):
                out[k] = float(v)
            elif v.shape == mask.shape:
                tensors[k] = fill_masked(v.detach().double(), mask).sum() / n
            else:
                tensors[k] = v.detach().double().reshape(())
        if tensors:
            out.update(zip(tensors, torch.stack(list(tensors.values())).tolist()))
    return {k: out[k] for k in metrics}


# ------------------------------------------------------------------ the method registry
_REGISTRY: Dict[str, Method] = {}


def register_method(method: Method, overwrite: bool = False) -> Method:
    """Add a method (its hyperparameters are completed with the components' defaults)."""
    if method.name in _REGISTRY and not overwrite:
        raise ValueError(f"method {method.name!r} is already registered")
    method.components()  # every name known
    given = dict(method.hparams)
    method.hparams = method.hparam_defaults()
    full = method.with_overrides(**given)
    _REGISTRY[method.name] = full
    return full


def get_method(name: str, **overrides) -> Method:
    """A fresh copy of the named preset, with hyperparameter ``overrides`` applied (a build: a run
    builds its method once per process, through :func:`method_from_spec` or an engine's cache)."""
    if name not in _REGISTRY:
        raise unknown_name_error("method", name, _REGISTRY)
    return _REGISTRY[name].with_overrides(**overrides)


def preset(name: str) -> Method:
    """The registered preset itself, to read (its needs, its defaults), not to train with: no copy,
    no build. An unknown name: the registry's one-line error."""
    if name not in _REGISTRY:
        raise unknown_name_error("method", name, _REGISTRY)
    return _REGISTRY[name]


#: the methods this process built from a resolved spec (:func:`method_from_spec`), by the spec's text
_BUILT: Dict[str, Method] = {}


def spec_key(spec: Mapping[str, Any]) -> str:
    """The text a spec is cached under: its hyperparameters through the one coercion first, so a
    file's ``anchor_eta: 0.3``, a flag's ``"0.3"`` and a resolved 0.3 are one key."""
    import json

    def norm(k: str, v: Any) -> Any:
        try:
            v = coerce_hparam(k, v)
        except (ValueError, TypeError):
            return v  # the build reports it
        return list(v) if isinstance(v, tuple) else v

    hp = {str(k): norm(str(k), v) for k, v in dict(spec.get("hparams") or {}).items()}
    return json.dumps({**dict(spec), "hparams": hp}, sort_keys=True, default=repr)


def method_from_spec(spec: Mapping[str, Any]) -> Method:
    """The method of a resolved spec (:meth:`Method.spec`), built once per process: the build (the
    preset copied, every hyperparameter through the one coercion, the method validated) happens at
    the first call; a later call with an equal spec gets its own shallow copy of that build (its own
    ``hparams`` dict), so a caller that changes its method -- a test patching ``loss``, a hook --
    changes no other caller's. A spec naming a plug-in method needs the plug-in imported first
    (``OPENRLHF_DIV_PLUGINS``, which the engines export to their workers)."""
    name = str(spec["name"])
    # the registered preset's identity is part of the key: a plug-in that registers the name anew
    # (a test, a reloaded module) gets a build of the new preset, not the old one
    key = f"{id(_REGISTRY.get(name))}:{spec_key(spec)}"
    method = _BUILT.get(key)
    if method is None:
        extra = {k: spec[k] for k in ("aggregation", "dynamic_sampling") if k in spec}
        method = get_method(name, **dict(spec.get("hparams") or {}), **extra)
        _BUILT[key] = method
        # also under its full spec: a partial spec (the flags' overrides) and the resolved spec the
        # driver then hands on name one method
        _BUILT.setdefault(f"{id(_REGISTRY.get(name))}:{spec_key(method.spec())}", method)
    return dataclasses.replace(method, hparams=dict(method.hparams))  # a copy, not a build


def list_methods() -> Tuple[str, ...]:
    return tuple(_REGISTRY)


def method_table() -> Mapping[str, Dict[str, Any]]:
    return {n: m.describe() for n, m in _REGISTRY.items()}
