"""OpenRLHF's ``Actor`` with log-probs and entropy from the last hidden states and the LM head.

OpenRLHF 0.11.2's ``Actor.forward`` runs the model, upcasts the full ``[B, L, V]`` logits to
float32, divides them by the rollout temperature in place, and takes the entropy and the
log-probs of the rolled sequences from them. :class:`HiddenLogProbActor` replays that forward
step by step -- the same packing (``unpad_and_slice_tensor`` / ``gather_and_pad_tensor``), the
same position ids, the same rolled targets and ``[:, :-1]`` / ``[:, -A:]`` slicing, the same
temperature -- but with the model's LM head bypassed
(:func:`~openrlhf_div.engines.lm_head.lm_head_returns_hidden`): the last hidden states go through
:func:`~openrlhf_div.algorithms.log_probs_from_hidden`, chunk by chunk, so no ``[tokens, V]``
tensor exists in forward or backward.

Differences from OpenRLHF's forward, by design:

* ``output.logits`` is ``None`` (there are no full logits); ``output.entropy``,
  ``output.hidden_states`` (when requested) and ``output.aux_loss`` are as OpenRLHF sets them.
* A call that asks for the logits themselves (no ``action_mask`` and no ``return_logprobs``),
  and models the fused path cannot serve (a head that is not a plain ``nn.Linear``, e.g. LoRA on
  ``lm_head``; ZeRO-3-partitioned heads; logit soft-capping or scaling), run OpenRLHF's own
  forward unchanged (a warning names the reason once).

:class:`DivReferenceModelActor` is OpenRLHF's ``ReferenceModelActor`` building this actor (used
for the reference log-probs and the DPH pre-sampling base log-probs); the policy actor
(:data:`~.actor.DivPolicyModelActor`) swaps it in the same way.
"""
from __future__ import annotations

import logging

import torch

from openrlhf_div.compat.flash_attn_standin import install as _install_flash_attn_standin

_install_flash_attn_standin()

import ray  # noqa: E402
from openrlhf.models import Actor  # noqa: E402
from openrlhf.models.ring_attn_utils import gather_and_pad_tensor, unpad_and_slice_tensor  # noqa: E402
from openrlhf.trainer.ray import launcher as _launcher  # noqa: E402
from openrlhf.trainer.ray.launcher import ReferenceModelActor  # noqa: E402

from openrlhf_div.algorithms.logprobs import log_probs_from_hidden  # noqa: E402
from openrlhf_div.compat.patch import swapped  # noqa: E402
from openrlhf_div.engines.lm_head import UnsupportedHead, lm_head_returns_hidden, output_head  # noqa: E402

logger = logging.getLogger(__name__)

__all__ = ["HiddenLogProbActor", "DivReferenceModelActor"]

_warned = set()


class HiddenLogProbActor(Actor):
    """``openrlhf.models.Actor`` whose forward never builds the ``[tokens, V]`` logits (module docstring)."""

    def forward(self, sequences: torch.LongTensor, action_mask=None, attention_mask=None, return_output=False,
                allgather_logits=False, return_logprobs=False, ring_attn_group=None, packed_seq_lens=None,
                return_entropy=False, **mm_inputs):
        """Returns action log probs (OpenRLHF's contract; see the module docstring)."""
        return_action_log_probs = action_mask is not None
        reason = None
        if not return_action_log_probs and not return_logprobs:
            reason = "the caller asked for the logits"
        else:
            try:
                output_head(self.model)
            except UnsupportedHead as e:
                reason = str(e)
        if reason is not None:
            if reason not in _warned and return_action_log_probs:
                _warned.add(reason)
                logger.warning("HiddenLogProbActor: OpenRLHF's full-logits forward is used: %s", reason)
            return super().forward(sequences, action_mask, attention_mask, return_output=return_output,
                                   allgather_logits=allgather_logits, return_logprobs=return_logprobs,
                                   ring_attn_group=ring_attn_group, packed_seq_lens=packed_seq_lens,
                                   return_entropy=return_entropy, **mm_inputs)

        # ---- OpenRLHF 0.11.2 Actor.forward, up to the model call, unchanged
        batch, seqlen = sequences.size()
        if self.packing_samples:
            sequences, position_ids, rolled_sequences, ring_attn_pad_len, indices = unpad_and_slice_tensor(
                sequences, attention_mask, ring_attn_group
            )
            foward_attention_mask = None
        else:
            rolled_sequences = torch.roll(sequences, shifts=-1, dims=1)
            foward_attention_mask = attention_mask
            if getattr(self, "is_vlm", False):
                position_ids = None
                if mm_inputs:
                    cfg = self._vlm_config
                    token_type_ids = (sequences == cfg.image_token_id).to(torch.int32)
                    if getattr(cfg, "video_token_id", None) is not None:
                        token_type_ids[sequences == cfg.video_token_id] = 2
                    key = "mm_token_type_ids" if "image_grid_thw" in mm_inputs else "token_type_ids"
                    mm_inputs[key] = token_type_ids
            else:
                position_ids = attention_mask.long().cumsum(-1) - 1
                position_ids.masked_fill_(attention_mask == 0, 1)

        # ---- the model with its LM head bypassed: output["logits"] holds the last hidden states
        with lm_head_returns_hidden(self.model) as head:
            output = self.model(sequences, attention_mask=foward_attention_mask, position_ids=position_ids,
                                **mm_inputs)
        hidden = output["logits"]
        output["logits"] = None
        # float32 log-probs of softmax(logits / T) and its entropy, as OpenRLHF's upcast + div_(T) gives
        log_probs, entropy = log_probs_from_hidden(hidden, head.weight, rolled_sequences, bias=head.bias,
                                                   temperature=self.temperature, return_entropy=bool(return_entropy))
        del hidden

        # ---- OpenRLHF 0.11.2 Actor.forward after the logits, unchanged
        if return_entropy:
            assert return_output
            if self.packing_samples:
                entropy = gather_and_pad_tensor(entropy, ring_attn_group, ring_attn_pad_len, indices, batch, seqlen)
            setattr(output, "entropy", entropy[:, :-1])

        if self.packing_samples:
            log_probs = gather_and_pad_tensor(log_probs, ring_attn_group, ring_attn_pad_len, indices, batch, seqlen)

        log_probs = log_probs[:, :-1]
        if not return_action_log_probs and return_logprobs:
            return (log_probs, output) if return_output else log_probs

        action_log_probs = log_probs[:, -action_mask.shape[1]:] * action_mask.float()

        return (action_log_probs, output) if return_output else action_log_probs


class _DivReferenceModelActor(ReferenceModelActor.__ray_actor_class__):
    """``ReferenceModelActor`` whose model is a :class:`HiddenLogProbActor`."""

    def init_model_from_pretrained(self, *args, **kwargs):
        with swapped(_launcher, "Actor", HiddenLogProbActor):
            return super().init_model_from_pretrained(*args, **kwargs)


DivReferenceModelActor = ray.remote(num_gpus=1)(_DivReferenceModelActor)
