"""Free the actor's training state from the device between optimiser steps (colocated training).

With ``--train.colocate_all --ds.enable_sleep`` the actor and the vLLM engines share GPUs, and
OpenRLHF 0.11.2 drives the policy group in this order (file:line in
``openrlhf/trainer``):

1. ``init_model_from_pretrained`` -- the DeepSpeed actor offloads at the end of it when
   ``ds.enable_sleep`` is set (``ray/ppo_actor.py:581``), before the first vLLM wake-up;
2. ``forward`` for the old log-probs (``ppo_utils/experience_maker.py:102``), ``append``
   (``ppo_trainer.py:234``);
3. ``reload_states -> fit -> offload_states`` (``ppo_trainer.py:274-279``);
4. ``broadcast_to_vllm`` (``ppo_trainer.py:316``), then ``save_checkpoint``
   (``ppo_trainer.py:384-411``), then the next step's ``forward`` -- all while offloaded.

So, like DeepSpeed (``offload_deepspeed_states``: optimizer states, gradient buffers, fp32
"hp" params; the bf16 parameters stay), only what ``fit`` alone needs leaves the device: the
optimiser state (fp32 main-parameter shards, Adam moments) is copied to pinned host memory and
the gradient buffers are released without a copy (they are zeroed before every step). The
parameters stay resident: weight export and the log-prob forward read them while offloaded.

Megatron keeps parameters and gradients as views into a few large contiguous buffers (DDP's
``param_data`` / ``grad_data``) and the optimiser state in per-shard tensors, so memory is
released at the level of *storages*: each distinct storage is copied to host memory (or
dropped) and resized to zero bytes; every view stays valid and sees its data again after
:meth:`StorageOffloader.reload`. A storage that also backs a parameter (fp32 training, where
the distributed optimiser's shards are views of the parameters) is never released.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch

__all__ = ["StorageOffloader", "training_state_tensors"]


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s.device


class StorageOffloader:
    """Offload / reload the storages behind ``keep`` (copied) and ``drop`` (discarded) tensors,
    never touching a storage that also backs one of the ``resident`` tensors."""

    def __init__(self, keep: Iterable[torch.Tensor], drop: Iterable[torch.Tensor] = (),
                 resident: Iterable[torch.Tensor] = ()):
        pinned = {_storage_key(t) for t in resident if isinstance(t, torch.Tensor)}
        self._keep = [t for t in self._unique(keep) if _storage_key(t) not in pinned]
        pinned |= {_storage_key(t) for t in self._keep}
        self._drop = [t for t in self._unique(drop) if _storage_key(t) not in pinned]
        self._host: List[Tuple[torch.Tensor, torch.Tensor, int]] = []
        self._dropped: List[Tuple[torch.Tensor, int]] = []
        self.offloaded = False

    @staticmethod
    def _unique(ts: Iterable[torch.Tensor]) -> List[torch.Tensor]:
        seen: Dict = {}
        on_gpu = torch.cuda.is_available()
        for t in ts:
            if t is None or not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                continue
            if on_gpu and not t.is_cuda:     # e.g. the host optimizer's state: already off the GPU
                continue
            seen.setdefault(_storage_key(t), t)
        return list(seen.values())

    @property
    def nbytes(self) -> Tuple[int, int]:
        """``(copied, dropped)`` bytes of the tracked storages (while resident)."""
        return (sum(t.untyped_storage().nbytes() for t in self._keep),
                sum(t.untyped_storage().nbytes() for t in self._drop))

    @staticmethod
    def _bytes_view(storage) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

    def offload(self) -> int:
        """Release the storages; returns the number of device bytes freed."""
        if self.offloaded:
            return 0
        freed = 0
        pin = torch.cuda.is_available()
        for t in self._keep:
            s = t.untyped_storage()
            n = s.nbytes()
            host = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
            host.copy_(self._bytes_view(s), non_blocking=False)
            self._host.append((t, host, n))
            s.resize_(0)
            freed += n
        for t in self._drop:
            s = t.untyped_storage()
            n = s.nbytes()
            self._dropped.append((t, n))
            s.resize_(0)
            freed += n
        self.offloaded = True
        return freed

    def reload(self) -> None:
        if not self.offloaded:
            return
        for t, host, n in self._host:
            s = t.untyped_storage()
            s.resize_(n)
            self._bytes_view(s).copy_(host, non_blocking=False)
        for t, n in self._dropped:
            s = t.untyped_storage()
            s.resize_(n)
            self._bytes_view(s).zero_()
        self._host, self._dropped = [], []
        self.offloaded = False


def training_state_tensors(model, optimizer) -> Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]:
    """``(keep, drop, resident)`` of a Megatron DDP model and its optimiser: optimiser state and
    main-parameter shards (copied), gradients (dropped), parameters and DDP parameter buffers
    (resident)."""
    resident: List[torch.Tensor] = [p.data for p in model.parameters()]
    drop: List[torch.Tensor] = [p.main_grad for p in model.parameters() if getattr(p, "main_grad", None) is not None]
    for buf in list(getattr(model, "buffers", []) or []) + list(getattr(model, "expert_parallel_buffers", []) or []):
        if getattr(buf, "param_data", None) is not None:
            resident.append(buf.param_data)
        if getattr(buf, "grad_data", None) is not None:
            drop.append(buf.grad_data)
    keep: List[torch.Tensor] = []
    if optimizer is not None:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            inner = getattr(opt, "optimizer", None)
            for st in (getattr(inner, "state", {}) or {}).values():
                keep.extend(v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
            for g in getattr(inner, "param_groups", []) or []:
                keep.extend(p for p in g["params"])   # fp32 main-parameter shards (views of params: resident)
    return keep, drop, resident
