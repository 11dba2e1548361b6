"""Per-token log-probs and entropy for the Megatron path: vocabulary-parallel, from hidden states.

With tensor parallelism the output layer is column-parallel: tensor-parallel (TP) rank ``r``
holds the rows ``[vocab_start_r, vocab_start_r + V_local)`` of the LM head, a ``[V_local, H]``
slice. Even one rank's ``[tokens, V_local]`` logits are large (76k floats per token for Qwen2.5 at
TP = 2), so nothing here takes logits: :func:`vocab_parallel_log_probs_from_hidden` takes the last
hidden states ``[..., H]`` (the output layer's input, gathered over the sequence when sequence
parallelism is on) and this rank's weight slice, and runs
:func:`openrlhf_div.algorithms.logprobs.fused_log_probs` -- the kernel behind
:func:`~openrlhf_div.algorithms.log_probs_from_hidden` -- on the shard: chunks of tokens, each
chunk's ``[chunk, V_local]`` logits computed, reduced and dropped, recomputed in backward.

Per chunk, with ``z = logits / T`` over the valid vocabulary (entries at or beyond ``vocab_size``,
Megatron's vocabulary padding, are excluded: ``p = 0``), one number per token and all-reduce:

* ``m = max_v z_v``                                                 (all-reduce MAX)
* ``S = sum_v exp(z_v - m)``, so ``log Z = m + log S``              (all-reduce SUM)
* ``z_y`` the target's logit, picked on the rank that owns ``y``, 0 elsewhere   (same SUM)
* ``E = sum_v p_v z_v``                                             (same SUM, entropy only)

then ``lp = z_y - log Z`` and ``H = log Z - E``, identical on every TP rank. Backward recomputes the
chunk's local logits, forms ``dL/dz_v = g_lp (1[v = y] - p_v) + g_H p_v (E - z_v)`` on the local
slice, accumulates this rank's ``dL/dW`` slice and all-reduces ``dL/dhidden`` over the TP group
(each rank sees only its part of the vocabulary) -- the reduction Megatron's
``ColumnParallelLinear`` performs on its input gradient; :func:`output_layer_returns_hidden` hands
the hidden states over so that this happens exactly once (with sequence parallelism it all-gathers
the sequence forward and splits it backward). No Megatron import at module level: the function
runs with gloo on CPU.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Tuple

import torch

from openrlhf_div.algorithms.logprobs import fused_log_probs

__all__ = ["vocab_parallel_log_probs_from_hidden", "output_layer_returns_hidden", "output_weight", "vocab_range"]


def vocab_range(padded_vocab_size: int, tp_rank: int, tp_size: int) -> Tuple[int, int]:
    """``[start, end)`` of the vocabulary slice TP rank ``tp_rank`` owns (Megatron's even split)."""
    if padded_vocab_size % tp_size:
        raise ValueError(
            f"padded vocabulary size {padded_vocab_size} is not divisible by the tensor-parallel size "
            f"{tp_size}; pad it with openrlhf_div.engines.megatron.weights.padded_vocab_size"
        )
    per = padded_vocab_size // tp_size
    return tp_rank * per, (tp_rank + 1) * per


def vocab_parallel_log_probs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    group=None,
    need_entropy: bool = True,
    bias: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of ``target`` and full-vocabulary entropy from hidden states and a vocabulary shard.

    Args:
        hidden: ``[..., H]`` last hidden states, the same on every TP rank (any float dtype, the
            weight's; the log-sum-exp and entropy are float32).
        weight: ``[V_local, H]`` this rank's rows of the output layer.
        target: ``[...]`` global token ids.
        vocab_start: first global vocabulary index this rank owns (:func:`vocab_range`).
        vocab_size: the real vocabulary size; global indices ``>= vocab_size`` (Megatron's
            padding rows) get probability 0. ``None``: every row is valid.
        temperature: logits are divided by it first (OpenRLHF's actor does the same with the
            rollout temperature, so old and new log-probs match vLLM's sampling distribution).
        group: the tensor-parallel process group; ``None`` means no reduction (the shard is the
            whole vocabulary, TP = 1) -- unlike ``torch.distributed``, not the world group.
        need_entropy: skip the entropy's reduction and gradient terms when False.
        bias: optional ``[V_local]`` bias slice; ``chunk_size``: tokens per chunk (default: 256 MiB
            of float32 logits per chunk).

    Returns:
        ``(log_probs [...], entropy [...] or None)`` in float32, identical on every TP rank;
        gradients flow to ``hidden`` (all-reduced over ``group``), ``weight`` and ``bias``.
    """
    return fused_log_probs(hidden, weight, target, bias=bias, temperature=temperature,
                           return_entropy=need_entropy, chunk_size=chunk_size, vocab_start=vocab_start,
                           vocab_size=vocab_size, group=group, caller="vocab_parallel_log_probs_from_hidden")


def output_weight(gpt) -> torch.Tensor:
    """The weight ``GPTModel`` hands its output layer: the shared embedding when tied, else
    ``output_layer.weight`` (this rank's ``[V_local, H]`` rows)."""
    if getattr(gpt, "share_embeddings_and_output_weights", False):
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


@contextlib.contextmanager
def output_layer_returns_hidden(gpt) -> Iterator[bool]:
    """Within the block, ``GPTModel.forward`` returns the last hidden states ``[b, s, H]`` instead of
    its ``[b, s, V_local]`` logits (yields whether this stage has an output layer).

    The output layer's forward is rebound on the instance (restored on exit) to what
    ``ColumnParallelLinear`` does to its input before the matmul: with sequence parallelism, an
    all-gather of the sequence (whose backward splits it again; the gradient sum over the TP group
    happens in :func:`vocab_parallel_log_probs_from_hidden`); without, nothing (ditto). Pipeline
    stages without an output layer are left alone.
    """
    layer = getattr(gpt, "output_layer", None) if getattr(gpt, "post_process", True) else None
    if layer is None:
        yield False
        return
    if "forward" in layer.__dict__:
        raise RuntimeError("output_layer_returns_hidden: the output layer's forward is already rebound")
    if getattr(layer, "bias", None) is not None:
        raise ValueError("output_layer_returns_hidden: an output layer with a bias is not supported (GPT has none)")

    def forward(input_, weight=None, runtime_gather_output=None):
        if getattr(layer, "sequence_parallel", False):
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
            input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=False,
                                                          group=getattr(layer, "tp_group", None))
        return input_, None

    layer.forward = forward
    try:
        yield True
    finally:
        del layer.forward
