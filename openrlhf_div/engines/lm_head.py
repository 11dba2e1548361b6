"""Hugging Face causal LMs without their ``[tokens, V]`` logits: the last hidden states and the LM head.

Every Hugging Face ``*ForCausalLM`` ends its forward with ``logits = self.lm_head(hidden[:, keep])``.
:func:`lm_head_returns_hidden` makes the head an identity for the duration of one forward, so the
model's own forward runs unchanged (its position ids, masks, ``logits_to_keep``, gradient
checkpointing, hooks) and ``output.logits`` holds the final hidden states ``[B, T, H]`` instead of
the logits. The caller then computes log-probs and entropy with
:func:`openrlhf_div.algorithms.log_probs_from_hidden` from those hidden states and the head's
``weight`` / ``bias``, chunk by chunk, without a ``[tokens, V]`` tensor.

Models whose forward transforms the logits after the head (Gemma's final soft-capping, Cohere's
``logit_scale``, Granite's ``logits_scaling``) are refused with :class:`UnsupportedHead`: the fused
path would silently change their distribution.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["UnsupportedHead", "lm_head_returns_hidden", "output_head"]

# config attributes of model families that post-process the head's output (value that means "off")
_LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


class UnsupportedHead(ValueError):
    """The model's LM head cannot be replaced by the fused hidden-states path."""


def output_head(model) -> torch.nn.Linear:
    """The model's LM head (``get_output_embeddings()``), checked to be a plain ``nn.Linear``."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    name = type(model).__name__
    if not isinstance(head, torch.nn.Linear):
        raise UnsupportedHead(f"{name}: get_output_embeddings() is {type(head).__name__}, not an nn.Linear LM head; "
                              "log-probs from hidden states need a causal LM with a linear head")
    cfg = getattr(model, "config", None)
    for attr, off in _LOGIT_TRANSFORMS.items():
        v = getattr(cfg, attr, None)
        if v is not None and v != off:
            raise UnsupportedHead(f"{name}: config.{attr} = {v} transforms the logits after the LM head; "
                                  "the fused log-prob path does not support this model family")
    if hasattr(head.weight, "ds_id") and getattr(head.weight, "ds_numel", head.weight.numel()) != head.weight.numel():
        raise UnsupportedHead(f"{name}: the LM head's weight is partitioned by DeepSpeed ZeRO-3; the fused "
                              "log-prob path needs the full head on every rank (use ZeRO stage <= 2)")
    return head


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@contextlib.contextmanager
def lm_head_returns_hidden(model) -> Iterator[torch.nn.Linear]:
    """Within the block, ``model(...).logits`` are the final hidden states; yields the LM head.

    The head's forward is rebound on the instance only (restored on exit, even on error);
    parameters, hooks and the module tree are untouched.
    """
    head = output_head(model)
    if "forward" in head.__dict__:
        raise RuntimeError(f"{type(model).__name__}: the LM head's forward is already rebound (nested use?)")
    head.forward = _identity
    try:
        yield head
    finally:
        del head.forward
