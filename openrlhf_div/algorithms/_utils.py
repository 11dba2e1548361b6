"""Shared helpers: input validation, masked reductions, clamps. Pure torch."""
from __future__ import annotations

import difflib
from typing import Iterable, Optional

import torch

LOG_CLAMP = 20.0  # every exp of a log-ratio clamps its exponent to [-20, 20]


def unknown_name_error(kind: str, name: str, valid: Iterable[str]) -> ValueError:
    valid = sorted(valid)
    close = difflib.get_close_matches(str(name), valid, n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return ValueError(f"unknown {kind} {name!r}.{hint} Valid names: {', '.join(valid)}")


def check_2d(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be [B, T], got shape {tuple(t.shape)}")


def check_same_shape(ref_name: str, ref: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    """Every tensor in ``others`` must have ``ref``'s shape; the error names the culprit."""
    check_2d(ref_name, ref)
    for name, t in others.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {ref_name} has shape {tuple(ref.shape)}; "
                "per-token tensors must all be [B, T]"
            )


def broadcast_seq(name: str, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``x`` of shape ``[B]`` or ``[B, T]`` broadcast to ``like`` ``[B, T]``."""
    if x.dim() == 1:
        if x.shape[0] != like.shape[0]:
            raise ValueError(
                f"{name} has {x.shape[0]} entries but the batch has {like.shape[0]} sequences"
            )
        return x.to(like.dtype).unsqueeze(-1).expand_as(like)
    if x.shape != like.shape:
        raise ValueError(
            f"{name} must be [B] or [B, T] = {tuple(like.shape)}, got shape {tuple(x.shape)}"
        )
    return x.to(like.dtype)


def fill_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with 0 where the mask is 0, selected (not multiplied) so that inf/nan held at
    padding positions cannot turn into NaN (``0 * inf``) in values or gradients."""
    return torch.where(mask.bool(), x, 0.0)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    xm = fill_masked(x, mask)
    return xm.sum() if dim is None else xm.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    m = mask.to(x.dtype)
    xm = fill_masked(x, mask)
    if dim is None:
        return xm.sum() / m.sum().clamp(min=1.0)
    return xm.sum(dim=dim) / m.sum(dim=dim).clamp(min=1.0)


def masked_values(x: torch.Tensor, mask: torch.Tensor, what: str) -> torch.Tensor:
    """The elements of ``x`` the mask selects, refusing an empty selection: a mean or max over
    nothing is undefined (torch's ``max()`` raises an unexplained error, a clamped mean says 0).
    For measurements and comparisons; the losses' :func:`masked_mean` keeps its convention (an
    all-masked micro-batch contributes 0)."""
    check_same_shape(what, x, mask=mask)
    sel = x[mask.bool()]
    if sel.numel() == 0:
        raise ValueError(f"{what}: the mask selects none of its {mask.numel()} positions (shape "
                         f"{tuple(mask.shape)}), so its mean / max is undefined; make the sequences longer "
                         "than their prompts (the response mask starts after the prompt)")
    return sel


def masked_max(x: torch.Tensor, mask: torch.Tensor, what: str) -> torch.Tensor:
    """``max`` over the masked elements (an empty mask refused: :func:`masked_values`)."""
    return masked_values(x, mask, what).max()


def masked_agreement(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, what: str) -> dict:
    """``{"mean_abs", "max_abs", "n"}`` of ``|a - b|`` over the masked positions (float64; an
    empty mask refused: :func:`masked_values`)."""
    check_same_shape(what, a, b=b)
    d = masked_values((a.double() - b.double()).abs(), mask, what)
    return {"mean_abs": float(d.mean()), "max_abs": float(d.max()), "n": int(d.numel())}


def zero_masked(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Zero where the mask is 0, also where ``loss`` is inf/nan there (no NaN leak via 0*inf)."""
    return torch.where(mask.bool(), loss, torch.zeros_like(loss))


def clamp_log(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-LOG_CLAMP, LOG_CLAMP)
