"""Build a Megatron-core ``GPTModel`` for the Qwen2 / Llama family from a Hugging Face config.

The architecture, in Megatron's terms: RoPE (``rotary_base`` = HF ``rope_theta``, halves
rotated like HF's ``rotate_half``), RMSNorm (``layernorm_epsilon`` = ``rms_norm_eps``), SwiGLU
(``gated_linear_unit`` + ``silu``, no linear biases), grouped-query attention
(``num_query_groups`` = ``num_key_value_heads``), Qwen2's bias on q/k/v only
(``add_qkv_bias``), tied or untied embeddings (``share_embeddings_and_output_weights``).
Llama-3.1 RoPE scaling maps onto Megatron's ``rope_scaling`` (its fixed low/high frequency
factors 1/4 and 8192 original positions); other RoPE scalings are refused.

The layer spec is Transformer Engine's (fused norms + linears, flash / cuDNN attention) when TE
is importable and CUDA is present, else Megatron's local modules (unfused attention that
materialises ``[b, heads, s, s]`` scores -- fine for tests, slow and memory-hungry at 4k).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .config import MegatronConfig
from .weights import GPTLayout

__all__ = ["transformer_config", "layer_spec", "build_gpt_model", "uses_te_names", "rope_kwargs"]


def _te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # pragma: no cover - depends on the image
        return False
    return True


def use_transformer_engine(mcfg: MegatronConfig) -> bool:
    if mcfg.transformer_impl == "local":
        return False
    if mcfg.transformer_impl == "transformer_engine":
        if not _te_available():
            raise RuntimeError("--megatron.transformer_impl transformer_engine, but transformer_engine is not "
                               "importable; install it (GPU image) or use --megatron.transformer_impl local")
        return True
    return _te_available() and torch.cuda.is_available()


def uses_te_names(model) -> bool:
    """True when the model fuses the pre-norms into linears (TE spec naming, see weights.py)."""
    return any(n.endswith("linear_qkv.layer_norm_weight") for n, _ in model.named_parameters())


def rope_kwargs(layout: GPTLayout) -> dict:
    """``GPTModel`` RoPE arguments; raise for RoPE scalings Megatron does not implement."""
    kw = dict(position_embedding_type="rope", rotary_percent=1.0, rotary_base=int(layout.rope_theta))
    sc = layout.rope_scaling
    if sc:
        kind = sc.get("rope_type", sc.get("type"))
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        if kind == "llama3" and all(float(sc.get(k, v)) == v for k, v in expected.items()):
            kw.update(rope_scaling=True, rope_scaling_factor=float(sc.get("factor", 8.0)))
        else:
            raise ValueError(
                f"RoPE scaling {sc} is not supported by the Megatron actor (only Llama-3.1 style with "
                f"{expected}); use the DeepSpeed actor for this model"
            )
    return kw


def transformer_config(layout: GPTLayout, mcfg: MegatronConfig, *, perform_initialization: bool = True):
    """The ``TransformerConfig`` of a Qwen2 / Llama model under the layout ``mcfg``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout.check_tp(mcfg.tp)
    if layout.num_layers % mcfg.pp:
        raise ValueError(f"num_hidden_layers={layout.num_layers} is not divisible by --megatron.pp {mcfg.pp}")
    dtype = torch.bfloat16 if mcfg.bf16 else torch.float32
    on_gpu = torch.cuda.is_available()
    # the fused softmax / persistent layer-norm kernels come with Transformer Engine (or Apex),
    # not with the megatron-core wheel: only with the TE layer spec
    fused = use_transformer_engine(mcfg)
    recompute = {}
    if mcfg.recompute == "selective":
        recompute = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif mcfg.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method=mcfg.recompute_method,
                         recompute_num_layers=mcfg.recompute_num_layers)
    return TransformerConfig(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        num_attention_heads=layout.num_heads,
        num_query_groups=layout.num_kv_heads,
        kv_channels=layout.head_dim,
        ffn_hidden_size=layout.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=layout.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=mcfg.tp,
        pipeline_model_parallel_size=mcfg.pp,
        sequence_parallel=mcfg.sp,
        bf16=mcfg.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        variable_seq_lengths=mcfg.pp > 1,        # PP: micro-batches of different lengths
        moe_token_dispatcher_type="alltoall",    # (dense model; satisfies the variable-length check)
        bias_activation_fusion=False,
        masked_softmax_fusion=fused,
        persist_layer_norm=fused,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        use_cpu_initialization=not on_gpu,
        perform_initialization=perform_initialization,
        **recompute,
    )


def layer_spec(mcfg: MegatronConfig):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if use_transformer_engine(mcfg):
        return get_gpt_layer_with_transformer_engine_spec()
    return get_gpt_layer_local_spec(normalization="RMSNorm")


def build_gpt_model(layout: GPTLayout, mcfg: MegatronConfig, *, pre_process: Optional[bool] = None,
                    post_process: Optional[bool] = None):
    """This rank's ``GPTModel`` stage (parallel state must be initialised), on the current device.

    Weights are randomly initialised, then overwritten by the caller (Hugging Face or Megatron
    checkpoint). The initialisation is not optional: in megatron-core 0.16 only the
    initialisation routines tag tensor-parallel weights (``tensor_model_parallel``,
    ``partition_dim``); with ``perform_initialization=False`` the tags are missing, the optimiser
    then counts only TP rank 0's shards in the gradient norm and clips with a wrong norm at TP > 1
    (found by the CPU TP=2 test, which compares the grad norm with Hugging Face's).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=True)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=True)
    cfg = transformer_config(layout, mcfg, perform_initialization=True)
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=layer_spec(mcfg),
        vocab_size=layout.padded_vocab_size,
        max_sequence_length=layout.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=layout.tie_embeddings,
        **rope_kwargs(layout),
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def stage_layer_map(model) -> dict:
    """``{local layer index: global layer index}`` of this pipeline stage's ``GPTModel``."""
    return {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
