"""bfloat16 training with float32 master weights (``model.master_weights: true``).

With ``model.dtype: bfloat16`` alone the parameters, their gradients and AdamW's moments are
all bfloat16, and every optimizer step rounds the new weight to bfloat16's grid (8 significant
bits): an update smaller than half a unit in the last place of the weight is lost (at a
learning rate of 1e-6 a weight of magnitude 0.02 -- ulp 1.2e-4 -- never moves). With
``model.master_weights`` the forward and backward passes still run in bfloat16 (the model's
parameters and activations are bfloat16), but the optimizer holds a float32 copy of every
trainable parameter, so its moments are float32 too:

1. backward writes bfloat16 gradients into the model's parameters;
2. :meth:`MasterWeights.grads_to_master` copies them to the float32 copies (the model's
   gradients are freed), so clipping and the optimizer step happen in float32;
3. :meth:`MasterWeights.master_to_model` rounds the updated float32 copies into the model.

This is the scheme of Megatron's ``Float16OptimizerWithFloat16Params`` and DeepSpeed's bf16
optimizer, written plainly. The float32 copy is made from the weights as loaded in float32
(so a float32 base checkpoint keeps its precision), checkpoints keep it in
``trainer_state.pt`` (``--resume`` continues from the exact float32 values), and the saved
model folders stay in the training dtype (bfloat16).

Where it helps: on a GPU with bfloat16 tensor cores the forward/backward in bfloat16 are
faster and activations take half the memory, while the float32 master keeps small updates.
On a CPU without native bfloat16 matrix units it is slower than float32 training; it works
there (the tests run it) but is not a speed option.
"""
from __future__ import annotations

from typing import Dict, Iterable, List

import torch


class MasterWeights:
    """Float32 master copies of ``params`` (the model's trainable parameters, any dtype).

    Build it while the model is still float32 (the copies are exact), then cast the model to
    the training dtype. Give the optimizer :meth:`master_of` each parameter instead of the
    parameter itself."""

    def __init__(self, params: Iterable[torch.nn.Parameter]):
        self.params: List[torch.nn.Parameter] = list(params)
        self.master: List[torch.Tensor] = [p.detach().to(torch.float32, copy=True) for p in self.params]
        self._index: Dict[int, int] = {id(p): i for i, p in enumerate(self.params)}

    def master_of(self, p: torch.nn.Parameter) -> torch.Tensor:
        return self.master[self._index[id(p)]]

    @torch.no_grad()
    def grads_to_master(self) -> None:
        """Model gradients (bfloat16) -> float32 gradients of the master copies; the model's
        gradients are released."""
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        """Round the float32 master values into the model's parameters."""
        for p, m in zip(self.params, self.master):
            p.copy_(m)

    def state_dict(self) -> Dict[str, List[torch.Tensor]]:
        return {"master": [m.detach().cpu().clone() for m in self.master]}

    @torch.no_grad()
    def load_state_dict(self, state: Dict[str, List[torch.Tensor]]) -> None:
        saved = state["master"]
        if len(saved) != len(self.master):
            raise ValueError(f"checkpoint holds {len(saved)} float32 master tensors, the model has "
                             f"{len(self.master)} trainable parameters (was model.lora_rank changed?)")
        for m, s in zip(self.master, saved):
            if m.shape != s.shape:
                raise ValueError(f"checkpoint master tensor of shape {tuple(s.shape)} for a parameter of shape "
                                 f"{tuple(m.shape)}")
            m.copy_(s.to(device=m.device, dtype=torch.float32))
        self.master_to_model()
