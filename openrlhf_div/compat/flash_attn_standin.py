"""A pure-torch stand-in for the four padding helpers OpenRLHF imports from ``flash_attn``.

``openrlhf.models`` imports ``flash_attn.bert_padding`` (``index_first_axis``, ``pad_input``,
``rearrange``, ``unpad_input``) and ``flash_attn.utils.distributed.all_gather`` at import
time, but flash-attn is a CUDA-only source build. :func:`install` puts small torch versions
of exactly those names into ``sys.modules`` **only when the real package is absent**, so
``openrlhf.models.Actor(attn_implementation="sdpa")``, ``PolicyLoss`` and friends import
and run on CPU. On a GPU image with flash-attn installed, :func:`install` does nothing.

Semantics (the ones OpenRLHF relies on; ``B`` batch, ``S`` sequence length):

* ``unpad_input(x [B, S, ...], mask [B, S])`` -> ``(x[mask] [nnz, ...], indices [nnz],
  cu_seqlens [B+1] int32, max_seqlen int, used_seqlens [B] int32)``, where
  ``indices`` are the flat positions ``b * S + s`` of the kept tokens and
  ``cu_seqlens = [0, cumsum(mask.sum(-1))]``.
* ``index_first_axis(x [N, ...], indices)`` -> ``x[indices]`` (differentiable).
* ``pad_input(x [nnz, ...], indices, B, S)`` -> ``[B, S, ...]`` with zeros where no token.
* ``all_gather(x [n, ...], group)`` -> ``[world * n, ...]``, concatenated in rank order,
  differentiable (``torch.distributed.nn``).

The stand-in modules are marked with ``__openrlhf_div_standin__ = True``; transformers still
reports flash-attention 2 as unavailable (no ``flash-attn`` distribution is installed).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

STANDIN_VERSION = "0.0.0+openrlhf_div.standin"


def _rearrange(*args, **kwargs):
    from einops import rearrange  # flash_attn re-exports einops' rearrange

    return rearrange(*args, **kwargs)


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``x[indices]`` along the first axis."""
    return x.index_select(0, indices.to(x.device).long())


def pad_input(x: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Scatter ``nnz`` rows back to a zero-padded ``[batch, seqlen, ...]`` tensor."""
    out = x.new_zeros((batch * seqlen, *x.shape[1:]))
    out = out.index_copy(0, indices.to(x.device).long(), x)
    return out.reshape(batch, seqlen, *x.shape[1:])


def unpad_input(
    x: torch.Tensor, attention_mask: torch.Tensor, unused_mask: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Drop padded positions of ``x [B, S, ...]`` (see the module docstring for the outputs)."""
    keep = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = keep.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, int(seqlens.max().item()), used


def all_gather(x: torch.Tensor, process_group) -> torch.Tensor:
    """Concatenate ``x`` from every rank of ``process_group`` along dim 0 (differentiable)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(process_group) == 1:
        return x
    from torch.distributed.nn.functional import all_gather as _ag

    return torch.cat(_ag(x.contiguous(), group=process_group), dim=0)


def real_flash_attn_present() -> bool:
    """True when a real (non stand-in) ``flash_attn`` can be imported."""
    mod = sys.modules.get("flash_attn")
    if mod is not None:
        return not getattr(mod, "__openrlhf_div_standin__", False)
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):
        return False


def _module(name: str, package: bool = False) -> types.ModuleType:
    mod = types.ModuleType(name, f"openrlhf-div pure-torch stand-in for {name} (real package absent)")
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=package)
    if package:
        mod.__path__ = []  # a package, so `import flash_attn.x` looks in sys.modules only
    mod.__openrlhf_div_standin__ = True
    return mod


def install() -> bool:
    """Register the stand-in when flash-attn is absent. Returns True if it was installed
    (or already is), False when the real package is present (nothing is touched)."""
    if "flash_attn" in sys.modules:
        return bool(getattr(sys.modules["flash_attn"], "__openrlhf_div_standin__", False))
    if real_flash_attn_present():
        return False
    root = _module("flash_attn", package=True)
    root.__version__ = STANDIN_VERSION
    bert = _module("flash_attn.bert_padding")
    bert.index_first_axis = index_first_axis
    bert.pad_input = pad_input
    bert.unpad_input = unpad_input
    bert.rearrange = _rearrange
    utils = _module("flash_attn.utils", package=True)
    dist_mod = _module("flash_attn.utils.distributed")
    dist_mod.all_gather = all_gather
    root.bert_padding, root.utils, utils.distributed = bert, utils, dist_mod
    sys.modules.update({
        "flash_attn": root,
        "flash_attn.bert_padding": bert,
        "flash_attn.utils": utils,
        "flash_attn.utils.distributed": dist_mod,
    })
    return True
