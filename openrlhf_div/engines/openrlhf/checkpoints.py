"""Checkpoints of the Ray policy actor that a crash, a full disk or non-finite weights cannot ruin.

OpenRLHF 0.11.2's ``DeepspeedStrategy.save_ckpt`` deletes the oldest checkpoints *before* it
writes the new one (``--ckpt.max_num`` / ``max_mem``), and DeepSpeed then writes the tag's files
and, last, the ``latest`` file. So with ``--ckpt.max_num 1`` a process killed (or a disk filled)
during a save leaves no loadable checkpoint at all; a failed save leaves a half-written
``global_stepN`` folder behind; a ``latest`` that names a damaged folder makes the resumed job die
inside ``torch.load`` with a zip-reader error; and weights that went non-finite are saved like
any others. Here (:func:`save_actor_checkpoint`, :func:`resolve_resume_tag`, used by the policy
actor in :mod:`.actor`):

* **Order.** DeepSpeed writes ``global_stepN`` with ``save_latest=False`` and without
  OpenRLHF's rotation; then rank 0 writes ``manifest.json`` (size and SHA-256 of every file, the
  local engine's format: :mod:`openrlhf_div.engines.local.checkpoint`), then switches ``latest``
  atomically, then deletes the checkpoints beyond ``max_num`` / ``max_mem`` (never the new one).
  ``latest`` therefore only ever names a complete, verified checkpoint.
* **A failed save** (no space left, an I/O error) removes the half-written folder and raises
  :class:`CheckpointWriteError`, one line naming the path, the cause, the free space there and
  the intact checkpoint ``latest`` still names.
* **Non-finite weights** are never written: :func:`check_finite_params` runs before every save
  and raises the local engine's :class:`NonFiniteWeightsError` naming step and rank.
* **Resume** (:func:`resolve_resume_tag`) verifies the folder ``latest`` names; a damaged one
  (a file missing, truncated or altered) is named and skipped for the newest older checkpoint
  that verifies, and ``latest`` is pointed at it. Folders newer than ``latest`` without a
  manifest (a save that never finished) are named and removed. A ``latest`` folder without
  any manifest (written by plain OpenRLHF) loads unverified, with a warning.

Multi-rank limits: every rank raises on its own failed write, but a rank whose write succeeded
waits in DeepSpeed's barrier until Ray tears the group down when the job fails.
"""
from __future__ import annotations

import math
import os
import re
import shutil
from typing import Callable, List, Optional, Tuple

from openrlhf_div.engines.local.checkpoint import (
    MANIFEST,
    CorruptCheckpointError,
    NonFiniteWeightsError,
    verify_checkpoint,
    write_manifest,
)
from openrlhf_div.io import atomic_write_text

__all__ = ["CheckpointWriteError", "NonFiniteWeightsError", "NonFiniteLossError", "CorruptCheckpointError",
           "save_actor_checkpoint", "resolve_resume_tag", "check_finite_params", "check_finite_scalar",
           "step_tags", "read_latest"]

#: the tags OpenRLHF saves: every --ckpt.save_steps, and the best eval so far (``best_global_stepN``)
TAG_RE = re.compile(r"^(?:best_)?global_step(\d+)$")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (the message names the path and the cause)."""


class NonFiniteLossError(RuntimeError):
    """A loss or gradient norm became non-finite on the Ray path (the message names step and rank)."""


def _say(msg: str) -> None:
    print(f"[openrlhf-div] {msg}", flush=True)


def step_tags(save_dir: str) -> List[Tuple[int, str]]:
    """``[(step, tag)]`` of the ``global_stepN`` / ``best_global_stepN`` folders under ``save_dir``,
    oldest first (at one step the regular one counts as newer)."""
    if not os.path.isdir(save_dir):
        return []
    out = []
    for d in os.listdir(save_dir):
        m = TAG_RE.match(d)
        if m and os.path.isdir(os.path.join(save_dir, d)):
            out.append((int(m.group(1)), d))
    return sorted(out)


def read_latest(save_dir: str) -> Optional[str]:
    """The tag DeepSpeed's ``latest`` file names (``None`` when absent or empty)."""
    try:
        with open(os.path.join(save_dir, "latest")) as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def _free_space(path: str) -> str:
    p = path
    while p and not os.path.exists(p):
        p = os.path.dirname(p)
    try:
        free = shutil.disk_usage(p or "/").free
    except OSError:
        return "free space unknown"
    # torch.save reports a full disk as "file write failed": say it
    full = "no space left on the device: " if free < 2**20 else ""
    return f"{full}{free / 2**20:.1f} MiB free there before the cleanup"


# ------------------------------------------------------------------ finiteness
def _rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:  # noqa: BLE001
        return 0


def check_finite_scalar(value, what: str, step: int, last_good: Optional[str], rank: Optional[int] = None) -> None:
    """Raise :class:`NonFiniteLossError` when ``value`` (a number or 0-d tensor) is nan/inf."""
    v = float(value.detach().float()) if hasattr(value, "detach") else float(value)
    if math.isfinite(v):
        return
    rank = _rank() if rank is None else rank
    raise NonFiniteLossError(
        f"non-finite {what} ({v}) at step {step} on rank {rank}; the job stops before anything is checkpointed. "
        f"Last good checkpoint: {last_good or 'none yet'}. Lower --actor.adam.lr or --actor.max_norm (or check "
        "the rewards / data of that step) and resubmit with --ckpt.load_enable")


def check_finite_params(params, step: int, tag: str, last_good: Optional[str], rank: Optional[int] = None) -> None:
    """Raise :class:`NonFiniteWeightsError` when a (local shard of a) parameter holds nan/inf."""
    import torch

    bad = 0
    with torch.no_grad():
        for p in params:
            t = getattr(p, "ds_tensor", None)  # ZeRO-3: this rank's partition
            t = p if t is None else t
            if t.numel():
                bad += int((~torch.isfinite(t.detach())).sum())
    if bad:
        rank = _rank() if rank is None else rank
        raise NonFiniteWeightsError(
            f"non-finite weights ({bad} values) at step {step} on rank {rank}: checkpoint {tag} was not written. "
            f"Last good checkpoint: {last_good or 'none yet'}. Lower --actor.adam.lr and resubmit with "
            "--ckpt.load_enable")


# ------------------------------------------------------------------ saving
def _prune(save_dir: str, keep: int, max_mem_gb: float, newest: str) -> None:
    tags = [t for _, t in step_tags(save_dir) if not t.startswith("best_")]  # OpenRLHF replaces best ones
    doomed = tags[:-max(1, int(keep))] if keep and keep > 0 else []
    for t in doomed:
        if t != newest:
            shutil.rmtree(os.path.join(save_dir, t), ignore_errors=True)
            _say(f"deleted checkpoint {os.path.join(save_dir, t)} (--ckpt.max_num {keep})")
    if max_mem_gb and max_mem_gb > 0:
        def size(t):
            return sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(save_dir, t)) for f in fs)

        rest = [t for _, t in step_tags(save_dir) if not t.startswith("best_")]
        total = sum(size(t) for t in rest)
        while total > max_mem_gb * 2**30 and len(rest) > 1 and rest[0] != newest:
            t = rest.pop(0)
            total -= size(t)
            shutil.rmtree(os.path.join(save_dir, t), ignore_errors=True)
            _say(f"deleted checkpoint {os.path.join(save_dir, t)} (--ckpt.max_mem {max_mem_gb} GB)")


def save_actor_checkpoint(strategy, model, save_dir: str, tag: str, *, max_num: int, max_mem: float,
                          client_state=None, metric_value=None, metric_key=None, step: Optional[int] = None,
                          params=None, barrier: Callable[[], None] = lambda: None) -> str:
    """Write checkpoint ``tag`` under ``save_dir`` in the order of the module doc; returns its path."""
    path = os.path.join(save_dir, tag)
    rank0 = strategy.is_rank_0()
    prev = read_latest(save_dir)
    prev_path = os.path.join(save_dir, prev) if prev else None
    if params is not None:
        check_finite_params(params, step if step is not None else -1, path, prev_path)
    try:
        strategy.save_ckpt(model, save_dir, tag, max_num=2**31, max_mem=float("inf"), client_state=client_state,
                           save_latest=False, metric_value=metric_value, metric_key=metric_key)
        barrier()
        if rank0:
            write_manifest(path)
            atomic_write_text(os.path.join(save_dir, "latest"), tag)
    except Exception as exc:  # noqa: BLE001 - any failed write: name it, keep the previous one
        free = _free_space(save_dir)
        if rank0:
            shutil.rmtree(path, ignore_errors=True)
        cause = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        raise CheckpointWriteError(
            f"writing checkpoint {path} failed ({cause}; {free}); the half-written folder was "
            f"removed and the previous checkpoint {prev_path or '(none)'} is intact"
            + (" and `latest` still names it" if prev else "")
            + ". A save needs room for one checkpoint more than --ckpt.max_num keeps: free space there (or set "
            "--ckpt.path elsewhere, lower --ckpt.max_num) and resubmit with --ckpt.load_enable") from exc
    if rank0:
        _prune(save_dir, max_num, max_mem, tag)
    return path


# ------------------------------------------------------------------ resuming
def resolve_resume_tag(save_dir: str, *, rank0: bool = True, say: Callable[[str], None] = _say) -> Optional[str]:
    """The tag to load: ``latest``'s when it verifies, else the newest older one that does (see
    the module doc). ``None`` when there is no checkpoint; :class:`CorruptCheckpointError` when
    none is intact."""
    tags = step_tags(save_dir)
    latest = read_latest(save_dir)
    if latest is None and not tags:
        return None
    steps = dict((t, s) for s, t in tags)
    limit = steps.get(latest, None) if latest else None
    if latest and limit is None:
        m = TAG_RE.match(latest)
        limit = int(m.group(1)) if m else None
        say(f"warning: `latest` in {save_dir} names {latest!r}, which is not there")
    if limit is not None:
        newer = [t for s, t in tags if s > limit]
        for t in newer:
            p = os.path.join(save_dir, t)
            if not os.path.exists(os.path.join(p, MANIFEST)):
                say(f"warning: checkpoint {p} is incomplete (no {MANIFEST}: its save was interrupted); skipped"
                    + (" and removed" if rank0 else ""))
                if rank0:
                    shutil.rmtree(p, ignore_errors=True)
        tags = [(s, t) for s, t in tags if s <= limit]
    problems = []
    for s, t in reversed(tags):
        p = os.path.join(save_dir, t)
        try:
            verified = verify_checkpoint(p)
        except CorruptCheckpointError as exc:
            problems.append(str(exc))
            say(f"warning: checkpoint {p} is damaged ({exc}); skipped")
            continue
        if not verified:
            if t != latest:
                problems.append(f"{p}: no {MANIFEST} (an interrupted save)")
                say(f"warning: checkpoint {p} is incomplete (no {MANIFEST}: its save was interrupted); skipped")
                continue
            say(f"warning: checkpoint {p} has no {MANIFEST} (written without openrlhf-div's checkpoint "
                "writer); loading it unverified")
        if problems:
            say(f"resuming from the intact checkpoint {p} instead; the steps after it are redone")
            if rank0:
                atomic_write_text(os.path.join(save_dir, "latest"), t)
        return t
    raise CorruptCheckpointError(
        f"no intact checkpoint under {save_dir}:\n  " + "\n  ".join(problems)
        + "\nStart a new run (another --ckpt.path) or restore the files.")
