"""The engine contract: what an OpenRLHF ``Experience`` carries for a registry method, and the
loss inputs built from it. The OpenRLHF (DeepSpeed) actor and the Megatron actor both read
experiences through this module; the experience maker and the ``D_pef`` anchor rows write them.

Per row, in ``Experience.info`` (a ``[B]`` tensor or a list of numbers / 0-d tensors):

* ``div_anchor`` (:data:`ANCHOR_FLAG`): 1.0 for a ``D_pef`` anchor row, 0.0 (or absent) for a
  rollout. An anchor row's ``base_action_log_probs`` are its *stored* base log-probs; on rollout
  rows they are the reference model's (methods with ``needs.ref_log_probs``).
* ``div_correct`` (:data:`CORRECT_FLAG`): 1.0 when the task reward counts as correct; absent,
  correctness is ``method.is_correct(info["reward"])``.
* ``div_kept`` (:data:`KEPT_FLAG`): 0.0 for a response of a group dynamic sampling dropped (its
  mask and advantages are already zero; the flag is for logging).

No Ray, vLLM, DeepSpeed or Megatron import.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from openrlhf_div.algorithms.registry import AnchorInputs, LossInputs, Method

ANCHOR_FLAG = "div_anchor"
CORRECT_FLAG = "div_correct"
KEPT_FLAG = "div_kept"


def row_values(info: Optional[Dict], key: str, n: int, device=None, default: Optional[float] = 0.0):
    """``info[key]`` as a float ``[n]`` tensor; when absent, ``default`` for every row (``None``:
    return ``None``)."""
    v = (info or {}).get(key)
    if v is None:
        return None if default is None else torch.full((n,), float(default), device=device)
    if isinstance(v, torch.Tensor):
        t = v.reshape(-1).float()
    elif len(v) and isinstance(v[0], torch.Tensor):
        t = torch.stack([x.reshape(()) for x in v]).float()
    else:
        t = torch.as_tensor(v, dtype=torch.float32).reshape(-1)
    if t.numel() != n:
        raise ValueError(f"info[{key!r}] has {t.numel()} values for {n} rows")
    return t.to(device) if device is not None else t


def anchor_rows(info: Optional[Dict], n: int, device=None) -> torch.Tensor:
    """``[n]`` bool: the ``D_pef`` anchor rows (none when the flag is absent)."""
    return row_values(info, ANCHOR_FLAG, n, device) > 0.5


def correct_rows(info: Optional[Dict], n: int, method: Method, device=None) -> Optional[torch.Tensor]:
    """``[n]`` bool: ``info["div_correct"]``, else ``method.is_correct(info["reward"])``, else None."""
    c = row_values(info, CORRECT_FLAG, n, device, default=None)
    if c is not None:
        return c > 0.5
    reward = row_values(info, "reward", n, device, default=None)
    return None if reward is None else method.is_correct(reward)


def mark_rollout_rows(info: Dict, correct: torch.Tensor, keep: torch.Tensor) -> None:
    """The experience maker's flags on rollout rows (see the module docstring)."""
    info[CORRECT_FLAG] = correct.float()
    info[ANCHOR_FLAG] = torch.zeros(correct.numel())
    info[KEPT_FLAG] = keep.float()


def loss_inputs(
    method: Method, *, log_probs: torch.Tensor, mask: torch.Tensor, is_anchor: torch.Tensor,
    old_log_probs: Optional[torch.Tensor] = None, advantages: Optional[torch.Tensor] = None,
    ref_log_probs: Optional[torch.Tensor] = None, anchor_ref_log_probs: Optional[torch.Tensor] = None,
    correct: Optional[torch.Tensor] = None, entropy: Optional[torch.Tensor] = None,
    log_z: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None,
) -> Tuple[Optional[LossInputs], Optional[AnchorInputs]]:
    """Split one micro-batch's ``[B, A]`` tensors by ``is_anchor`` into the method's online
    :class:`LossInputs` (rollout rows; what ``method.needs`` asks for and nothing else) and
    :class:`AnchorInputs` (anchor rows, with ``anchor_ref_log_probs``, the stored base log-probs);
    either is None when the micro-batch has no such row. Per-token tensors take ``log_probs``'
    dtype."""
    needs = method.needs
    is_anchor = is_anchor.to(log_probs.device).bool().reshape(-1)
    on, an = ~is_anchor, is_anchor
    dt = log_probs.dtype

    def rows(t, sel, cast=True):
        if t is None:
            return None
        t = t[sel.to(t.device)]
        return t.to(dt) if cast else t

    online = anchor = None
    if bool(on.any()):
        if old_log_probs is None or advantages is None:
            raise ValueError("online rows need old log-probs and advantages from the experience maker")
        online = LossInputs(
            log_probs=log_probs[on], old_log_probs=rows(old_log_probs, on), advantages=rows(advantages, on),
            mask=rows(mask, on), correct=None if correct is None else rows(correct, on, cast=False).bool(),
            ref_log_probs=rows(ref_log_probs, on) if needs.ref_log_probs else None,
            entropy=rows(entropy, on, cast=False) if needs.entropy else None,
            log_z=rows(log_z, on, cast=False) if needs.prompt_hidden else None, generator=generator)
    if bool(an.any()):
        if not needs.anchor_batch:
            raise ValueError(f"micro-batch holds D_pef anchor rows but method {method.name!r} has no anchor loss")
        if anchor_ref_log_probs is None:
            raise ValueError("anchor rows need their stored base log-probs (anchor_ref_log_probs: "
                             "Experience.base_action_log_probs on the anchor rows); got None")
        anchor = AnchorInputs(log_probs=log_probs[an], ref_log_probs=rows(anchor_ref_log_probs, an),
                              mask=rows(mask, an))
    return online, anchor


def rows_from_experience(exp, method: Method) -> List[Dict[str, torch.Tensor]]:
    """Split an OpenRLHF ``Experience`` into rows with every per-token field aligned to all
    ``L - 1`` next-token targets (OpenRLHF aligns ``action_mask`` with the last ``A`` of them).

    Row kinds and their data as in the module docstring: an anchor row gets its
    ``base_action_log_probs`` as ``anchor_ref_log_probs``, a rollout row as ``ref_log_probs``;
    ``correct`` from :func:`correct_rows`.
    """
    seq, am, act = exp.sequences, exp.attention_mask, exp.action_mask
    B, L = seq.shape
    A = act.shape[1]

    def full(t):
        if t is None:
            return None
        t = torch.as_tensor(t)
        if t.dim() == 1:                       # per-sample advantage: broadcast over actions
            t = t[:, None].expand(B, A)
        out = torch.zeros(B, L - 1, dtype=torch.float32)
        out[:, L - 1 - A:] = t.float()
        return out

    info = getattr(exp, "info", None) or {}
    correct = correct_rows(info, B, method)
    flag = row_values(info, ANCHOR_FLAG, B, default=None)
    is_anchor = None if flag is None else flag > 0.5
    base = getattr(exp, "base_action_log_probs", None)
    if is_anchor is not None and bool(is_anchor.any()) and base is None:
        raise ValueError(f"experience marks anchor rows (info[{ANCHOR_FLAG!r}]) but has no base_action_log_probs "
                         "(the stored D_pef base log-probs)")
    base = full(base)
    fields = dict(action_mask=full(act), old_log_probs=full(exp.action_log_probs), advantages=full(exp.advantages))
    out = []
    for i in range(B):
        r = dict(sequences=seq[i], attention_mask=am[i])
        for k, v in fields.items():
            if v is not None:
                r[k] = v[i]
        anchor_row = is_anchor is not None and bool(is_anchor[i])
        if base is not None:
            r["anchor_ref_log_probs" if anchor_row else "ref_log_probs"] = base[i]
        if correct is not None:
            r["correct"] = correct[i].bool()
        if is_anchor is not None:
            r["is_anchor"] = torch.tensor(anchor_row)
        out.append(r)
    return out


def gather_step_rows(rows: List, group=None) -> Tuple[List, int, int]:
    """``(rows, dp_size, rank)``: every data-parallel rank's rows of this rollout step, in rank
    order, on every rank (``authors_world_size`` plans the whole step: docs/ALGORITHMS.md
    section 9 row 10). Rows are OpenRLHF ``Experience`` items or dicts of tensors, moved to the
    host first. Without a process group (or with one rank) the rows come back as they are."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return list(rows), 1, 0
    dp = dist.get_world_size(group=group)
    if dp <= 1:
        return list(rows), 1, 0

    def host(r):
        if isinstance(r, dict):
            return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in r.items()}
        return r.to_device("cpu") if hasattr(r, "to_device") else r

    gathered: List = [None] * dp
    dist.all_gather_object(gathered, [host(r) for r in rows], group=group)
    return [r for part in gathered for r in part], dp, dist.get_rank(group=group)
