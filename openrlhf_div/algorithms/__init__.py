"""The algorithm library: pure torch, no Ray / vLLM / OpenRLHF imports.

Public functional API (ALGORITHMS.md section 8; stable, users call it from their trainers):
per-token tensors are ``[B, T]``, masks 0/1 of the same shape, losses come back per token,
unaggregated and zero where the mask is 0.
"""
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
from .divergences import f_divergence
from .heads import LogZHead
from .kl import kl_estimate
from .logprobs import log_probs_from_hidden
from .losses import (
    aggregate_loss,
    cispo_loss,
    clip_cov_loss,
    diff_entropy_loss,
    dph_anchor_loss,
    dph_js_def_loss,
    entropy_from_logits,
    entropy_loss,
    flowrl_loss,
    kl_cov_loss,
    lad_loss,
    ppo_clip_loss,
)
from .registry import (
    AnchorInputs,
    Component,
    LossInputs,
    Method,
    Needs,
    Rollout,
    compile_losses,
    get_method,
    list_methods,
    method_from_spec,
    method_table,
    preset,
    register_adv_reshaping,
    register_anchor,
    register_estimator,
    register_method,
    register_policy_loss,
    register_regularizer,
    register_reward_shaping,
)
from . import components  # noqa: E402,F401  (registers the built-in components and presets)

__all__ = [
    # section 8 public API
    "f_divergence", "dph_anchor_loss", "lad_loss", "ds_reshape_advantages",
    "group_advantages", "passk_advantages", "unlikeliness_rewards",
    # the rest of the library
    "pkpo_advantages", "entropy_advantages", "overlong_penalty", "dynamic_sampling_mask",
    "kl_estimate", "aggregate_loss", "ppo_clip_loss", "cispo_loss", "clip_cov_loss",
    "kl_cov_loss", "entropy_loss", "diff_entropy_loss", "flowrl_loss", "dph_js_def_loss",
    "entropy_from_logits", "LogZHead", "log_probs_from_hidden",
    # the registries: components and methods
    "Method", "Needs", "LossInputs", "AnchorInputs", "Rollout", "Component", "get_method", "method_from_spec", "preset",
    "list_methods", "method_table", "register_method", "register_policy_loss",
    "register_regularizer", "register_estimator", "register_reward_shaping",
    "register_adv_reshaping", "register_anchor", "compile_losses",
]
