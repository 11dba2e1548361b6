"""Free a model's device memory while vLLM generates, and bring it back (colocated training).

With ``--train.colocate_all`` the actor and the vLLM engines share GPUs; OpenRLHF calls the
actor's ``offload_states()`` before generation and ``reload_states()`` before training. Megatron
keeps parameters and gradients as views into a few large contiguous buffers (DDP's
``param_data`` / ``grad_data``) and the optimiser state in per-shard tensors, so the memory is
released at the level of *storages*: each distinct storage behind the tracked tensors is copied
to (pinned) host memory and resized to zero bytes; every view stays valid and sees its data again
after :meth:`StorageOffloader.reload` resizes and refills the storage. Gradient storages are
dropped without a copy (they are zeroed before the next step anyway).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch

__all__ = ["StorageOffloader", "engine_tensors"]


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s.device


class StorageOffloader:
    """Offload / reload the storages behind ``keep`` (copied) and ``drop`` (discarded) tensors."""

    def __init__(self, keep: Iterable[torch.Tensor], drop: Iterable[torch.Tensor] = ()):
        self._keep = self._unique(keep)
        drop_u = self._unique(drop)
        keys = {_storage_key(t) for t in self._keep}
        self._drop = [t for t in drop_u if _storage_key(t) not in keys]
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


def engine_tensors(model, optimizer) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """``(keep, drop)``: parameters + optimiser state (kept) and gradient buffers (dropped)."""
    keep: List[torch.Tensor] = [p.data for p in model.parameters()]
    drop: List[torch.Tensor] = []
    for p in model.parameters():
        g = getattr(p, "main_grad", None)
        if g is not None:
            drop.append(g)
    for buf in list(getattr(model, "buffers", []) or []) + list(getattr(model, "expert_parallel_buffers", []) or []):
        if getattr(buf, "param_data", None) is not None:
            keep.append(buf.param_data)
        if getattr(buf, "grad_data", None) is not None:
            drop.append(buf.grad_data)
    if optimizer is not None:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            inner = getattr(opt, "optimizer", None)
            for st in (getattr(inner, "state", {}) or {}).values():
                keep.extend(v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
            for g in getattr(inner, "param_groups", []) or []:
                keep.extend(p for p in g["params"])   # fp32 main params / shards
    return keep, drop
