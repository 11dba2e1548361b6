"""``D_pef`` anchor rows in OpenRLHF's ``Experience`` layout, and mixing them into a batch.

An anchor row looks like a rollout row to OpenRLHF (so its replay buffer, collation and
data-parallel dispatch need no change) with three differences:

* ``info["div_anchor"] = 1`` routes it to the anchor loss (``L_pef``) in the policy actor;
* ``base_action_log_probs`` holds the **stored** per-token base log-probs ``ref_t`` from the
  pre-sampling stage (OpenRLHF recomputes ``action_log_probs`` for every rollout sample, so
  the offline log-probs travel in a field of their own). No reference model runs;
* ``advantages``/``returns``/``action_log_probs`` are zero (the anchor loss reads none of them).

Layout (as OpenRLHF's sample generator builds rollouts): ``sequences = prompt_ids +
response_ids`` (``[T]``), ``attention_mask`` ones, ``action_mask`` of width ``T - 1`` with
ones on ``[P - 1, T - 1)`` (position ``j`` scores token ``j + 1``), and the stored ``ref_t``
on the same positions.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Dict, List, Optional, Sequence

import torch

from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.utils.utils import zero_pad_sequences

from ..contract import ANCHOR_FLAG, CORRECT_FLAG
from ..anchor_data import AnchorRecord

_LIST_FIELDS = ("prompts", "labels", "images", "mm_train_inputs")


def anchor_experience(records: Sequence[AnchorRecord], pad_token_id: int, max_len: Optional[int] = None,
                      info_keys: Sequence[str] = ()) -> Experience:
    """A batched ``Experience`` of anchor rows (right-padded, OpenRLHF layout)."""
    seqs, attn, amask, ref, resp_len, tot_len = [], [], [], [], [], []
    for r in records:
        ids = list(r.prompt_ids) + list(r.response_ids)
        lps = list(r.ref_log_probs)
        if max_len is not None and len(ids) > max_len:
            keep = max_len - len(r.prompt_ids)
            if keep < 1:
                raise ValueError(
                    f"D_pef record {r.id!r}: prompt of {len(r.prompt_ids)} tokens leaves no room "
                    f"for its response within --data.max_len {max_len}"
                )
            ids, lps = ids[:max_len], lps[:keep]
        P, T = len(r.prompt_ids), len(ids)
        m = torch.zeros(T - 1, dtype=torch.long)
        m[P - 1:T - 1] = 1
        lp = torch.zeros(T - 1, dtype=torch.float32)
        lp[P - 1:T - 1] = torch.tensor(lps, dtype=torch.float32)
        seqs.append(torch.tensor(ids, dtype=torch.long))
        attn.append(torch.ones(T, dtype=torch.long))
        amask.append(m)
        ref.append(lp)
        resp_len.append(T - P)
        tot_len.append(T)
    n = len(records)
    pad = lambda xs, v=0: zero_pad_sequences(xs, side="right", value=v, stack=True)  # noqa: E731
    action_mask = pad(amask)
    info = {k: torch.zeros(n) for k in info_keys}
    info[ANCHOR_FLAG] = torch.ones(n)
    info[CORRECT_FLAG] = torch.ones(n)
    return Experience(
        sequences=pad(seqs, pad_token_id), attention_mask=pad(attn), action_mask=action_mask,
        action_log_probs=torch.zeros(action_mask.shape), base_action_log_probs=pad(ref),
        advantages=torch.zeros(action_mask.shape), returns=torch.zeros(action_mask.shape),
        rewards=torch.zeros(n), scores=torch.zeros(n),
        response_length=torch.tensor(resp_len, dtype=torch.float32),
        truncated=torch.zeros(n, dtype=torch.bool), total_length=torch.tensor(tot_len, dtype=torch.float32),
        index=[-1] * n, prompts=[r.prompt for r in records], labels=[r.label for r in records],
        images=[None] * n, mm_train_inputs=[None] * n, info=info,
    )


def _rows(e: Experience) -> int:
    return int(e.sequences.shape[0])


def _cat_step(a: Optional[torch.Tensor], b: Optional[torch.Tensor], na: int, nb: int, width: int,
              pad_value) -> Optional[torch.Tensor]:
    """Rows of ``a`` then ``b``, right-padded to ``width``; a missing side is zero-filled."""
    if a is None and b is None:
        return None
    like = a if a is not None else b
    a = torch.zeros((na, width), dtype=like.dtype) if a is None else a
    b = torch.zeros((nb, width), dtype=like.dtype) if b is None else b.to(a.dtype)
    return zero_pad_sequences([a, b.to(a.device)], side="right", value=pad_value, stack=False)


def append_rows(exp: Experience, extra: Experience, pad_token_id: int) -> Experience:
    """``exp`` with the rows of ``extra`` appended (step fields right-padded to a common width;
    a field missing on one side is zero-filled; ``info`` keys of both kept, zero-filled)."""
    na, nb = _rows(exp), _rows(extra)
    seq_w = max(exp.sequences.shape[1], extra.sequences.shape[1])
    act_w = max(exp.action_mask.shape[1], extra.action_mask.shape[1])
    out = {}
    for f in fields(Experience):
        a, b = getattr(exp, f.name), getattr(extra, f.name)
        if Experience.is_step_tensor_field(f.name):
            width = seq_w if f.name in ("sequences", "attention_mask") else act_w
            out[f.name] = _cat_step(a, b, na, nb, width, pad_token_id if f.name == "sequences" else 0)
        elif Experience.is_episode_tensor_field(f.name):
            if a is None and b is None:
                out[f.name] = None
            else:
                like = a if a is not None else b
                a = torch.zeros(na, dtype=like.dtype) if a is None else a
                b = torch.zeros(nb, dtype=like.dtype) if b is None else b
                out[f.name] = torch.cat([a.reshape(-1), b.reshape(-1).to(a.dtype)])
        elif f.name == "info":
            keys = list(dict.fromkeys(list(a or {}) + list(b or {})))
            merged = {}
            for k in keys:
                va = _info_tensor((a or {}).get(k), na)
                vb = _info_tensor((b or {}).get(k), nb)
                merged[k] = torch.cat([va, vb.to(va.dtype)])
            out[f.name] = merged
        elif f.name == "index":
            out[f.name] = (list(a) if a is not None else [-1] * na) + (list(b) if b is not None else [-1] * nb)
        else:  # per-row lists
            la = list(a) if a else [None] * na
            lb = list(b) if b else [None] * nb
            out[f.name] = la + lb
    return Experience(**out)


def _info_tensor(v, n: int) -> torch.Tensor:
    if v is None:
        return torch.zeros(n)
    if isinstance(v, torch.Tensor):
        t = v.reshape(-1)
    elif len(v) and isinstance(v[0], torch.Tensor):
        t = torch.stack([x.reshape(()) for x in v])
    else:
        t = torch.as_tensor(v)
    if t.numel() != n:
        raise ValueError(f"info value has {t.numel()} entries for {n} rows")
    if t.dtype == torch.bool:
        t = t.float()
    return t


def distribute(experiences: List[Experience], records: Sequence[AnchorRecord], pad_token_id: int,
               max_len: Optional[int] = None) -> List[Experience]:
    """Append ``records`` to ``experiences`` round-robin (record ``i`` to experience
    ``i mod E``), so every data-parallel rank gets its share of anchors."""
    if not records:
        return experiences
    if not experiences:
        raise ValueError("cannot attach anchors to an empty rollout batch")
    buckets: Dict[int, List[AnchorRecord]] = {}
    for i, r in enumerate(records):
        buckets.setdefault(i % len(experiences), []).append(r)
    out = []
    for j, e in enumerate(experiences):
        recs = buckets.get(j)
        if not recs:
            out.append(e)
            continue
        keys = [k for k in (e.info or {}) if k not in (ANCHOR_FLAG, CORRECT_FLAG)]
        out.append(append_rows(e, anchor_experience(recs, pad_token_id, max_len, keys), pad_token_id))
    return uniform_fields(out)


def uniform_fields(experiences: List[Experience]) -> List[Experience]:
    """Give every experience the same set of tensor fields and ``info`` keys (zero-filled).

    OpenRLHF's replay buffer splits each experience into rows and re-batches rows of
    *different* experiences with ``make_experience_batch``, which takes the field set of the
    first row of the batch. With fewer anchors than experiences (OpenRLHF's default
    ``--rollout.micro_batch_size 1``, or a small ``--div.anchor_batch_size``) the experiences
    without anchor rows keep ``base_action_log_probs = None`` (no reference actor), so a batch
    mixing them with anchor rows either crashes or silently loses the anchors' stored base
    log-probs. Zero-filling the missing fields is what :func:`append_rows` does within one
    experience; the losses only read them on the rows that own them.
    """
    for f in fields(Experience):
        if not (Experience.is_step_tensor_field(f.name) or Experience.is_episode_tensor_field(f.name)):
            continue
        like = next((getattr(e, f.name) for e in experiences if getattr(e, f.name) is not None), None)
        if like is None:
            continue
        for e in experiences:
            if getattr(e, f.name) is not None:
                continue
            n = _rows(e)
            if Experience.is_episode_tensor_field(f.name):
                shape = (n,)
            elif f.name in ("sequences", "attention_mask"):
                shape = (n, e.sequences.shape[1])
            else:
                shape = (n, e.action_mask.shape[1])
            setattr(e, f.name, torch.zeros(shape, dtype=like.dtype, device=e.action_mask.device))
    keys = list(dict.fromkeys(k for e in experiences for k in (e.info or {})))
    for e in experiences:
        if e.info is None:
            e.info = {}
        for k in keys:
            if k not in e.info:
                e.info[k] = torch.zeros(_rows(e))
    return experiences
