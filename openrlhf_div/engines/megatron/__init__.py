"""Megatron-core tensor-parallel policy / reference actors inside OpenRLHF's Ray topology.

Selected with ``--div.actor_backend megatron`` plus the ``--megatron.*`` flags
(:func:`add_megatron_arguments`); vLLM rollouts, rewards, the method registry and anchor batches
are unchanged. Modules:

* :mod:`.vocab_parallel` -- log-probs and entropy from vocabulary-parallel logits (no gather)
* :mod:`.weights`        -- Hugging Face <-> Megatron ``GPTModel`` mapping (Qwen2 / Llama)
* :mod:`.model`          -- ``GPTModel`` from a HF config; :mod:`.engine` -- one rank's engine
* :mod:`.loss`           -- micro-batch -> registry loss with global token counts
* :mod:`.actor`          -- the Ray actors; :mod:`.bridge` -- megatron-bridge adapter

The driver hook (the only change the OpenRLHF driver needs besides registering the flags)::

    from openrlhf_div.engines import megatron as mg
    mg.add_megatron_arguments(parser)                          # with the other flag groups
    ...
    policy_cls = mg.actor_class_for(args) or DivPolicyActor    # before RayActorGroup(...)
    ref_cls = mg.reference_class_for(args) or ReferenceModelActor

Importing this package does not import megatron-core, Ray or vLLM.
"""
from __future__ import annotations

from typing import Any, Optional

from .config import MegatronConfig, add_megatron_arguments, megatron_config_from_args

__all__ = ["MegatronConfig", "add_megatron_arguments", "megatron_config_from_args", "uses_megatron",
           "actor_class_for", "reference_class_for", "apply_layout_to_openrlhf_args"]


def uses_megatron(args: Any) -> bool:
    """True when ``--div.actor_backend megatron``."""
    div = getattr(args, "div", None)
    return str(getattr(div, "actor_backend", "deepspeed") or "deepspeed").lower() == "megatron"


def apply_layout_to_openrlhf_args(args: Any) -> MegatronConfig:
    """Tell OpenRLHF's controller how many actors form one model replica.

    OpenRLHF splits rollouts over, and de-duplicates results from, groups of
    ``args.ds.ring_attn_size * args.ds.tensor_parallel_size`` consecutive actors
    (``RayActorGroup(duplicate_actors=...)``, ``experience_maker``, ``replay_buffer``). A
    Megatron replica is ``tp * pp`` consecutive ranks (the engine orders ranks tp-pp-dp), so this
    sets ``args.ds.tensor_parallel_size = tp * pp`` (and checks ``ring_attn_size == 1``).
    Idempotent. Must run before the actor groups and the PPO trainer are created.
    """
    mcfg = megatron_config_from_args(args)
    ds = getattr(args, "ds", None)
    if ds is not None:
        if getattr(ds, "ring_attn_size", 1) != 1:
            raise ValueError("--ds.ring_attn_size must be 1 with --div.actor_backend megatron")
        ds.tensor_parallel_size = mcfg.model_parallel_size
    return mcfg


def actor_class_for(args: Any, num_gpus: float = 1) -> Optional[type]:
    """The Ray policy-actor class for ``args`` (``None`` unless the Megatron backend is selected).

    Also applies :func:`apply_layout_to_openrlhf_args`, so call it where the driver picks the
    policy class, before ``RayActorGroup(..., duplicate_actors=args.ds.ring_attn_size *
    args.ds.tensor_parallel_size)`` and before ``PPOTrainer.remote(...)``.
    """
    if not uses_megatron(args):
        return None
    apply_layout_to_openrlhf_args(args)
    import ray

    from .actor import MegatronPolicyActor

    return ray.remote(num_gpus=num_gpus)(MegatronPolicyActor)


def reference_class_for(args: Any, num_gpus: float = 1) -> Optional[type]:
    """The Ray reference-actor class (``None`` unless the Megatron backend is selected)."""
    if not uses_megatron(args):
        return None
    apply_layout_to_openrlhf_args(args)
    import ray

    from .actor import MegatronReferenceActor

    return ray.remote(num_gpus=num_gpus)(MegatronReferenceActor)
