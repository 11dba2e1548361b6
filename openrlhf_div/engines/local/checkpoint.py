"""Checkpoint integrity for the local engine: manifests, verified loads, a fall-back on resume,
a weight check after every optimizer step, and a metrics log that survives a torn last line.

* **Manifest.** Every checkpoint directory gets ``manifest.json``: the size and SHA-256 of each
  file in it, written last (inside the temporary directory, before the atomic rename).
  :func:`verify_checkpoint` re-checks sizes and checksums and raises
  :class:`CorruptCheckpointError` naming the first bad file. A checkpoint written before
  manifests existed loads unverified, with a warning.
* **Resume.** :func:`resume_checkpoint` takes the checkpoint named by ``latest``; when it does not
  verify, it warns (naming the file and why) and falls back to the newest older checkpoint that
  does, and points ``latest`` at it -- the metrics logged after it are then dropped as for any
  resume. With no intact
  checkpoint it raises, listing what was wrong with each.
* **Weights.** :func:`check_weights` runs after every optimizer step: the global L2 norm of the
  parameters (one ``torch._foreach_norm``, cheap next to the step) must be finite and at most
  ``checkpoint.max_weight_growth`` times its value when the run (or resume) started.
  Otherwise :class:`NonFiniteWeightsError` stops the run *before* anything is checkpointed,
  naming the last good checkpoint, which ``--resume`` then uses. ``save_checkpoint`` checks
  again, so non-finite weights are never written.
* **Metrics.** :func:`read_jsonl_rows` reads a JSONL log whose last line may be torn (a kill or
  a full disk mid-write): that line is dropped with a warning; a bad line anywhere else is an
  error naming the file and line.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from openrlhf_div.io import atomic_write_json, atomic_write_text

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "openrlhf-div.checkpoint/1"


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated or altered (the message names it)."""


class NonFiniteWeightsError(RuntimeError):
    """The weights became non-finite or exploded after an optimizer step; nothing was saved."""


# ------------------------------------------------------------------ manifests
def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: str) -> List[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def write_manifest(ckpt_dir: str) -> Dict[str, Any]:
    """Write ``manifest.json`` (size and SHA-256 of every other file) into ``ckpt_dir``."""
    files = {rel: {"size": os.path.getsize(os.path.join(ckpt_dir, rel)), "sha256": _sha256(os.path.join(ckpt_dir, rel))}
             for rel in _files(ckpt_dir)}
    man = {"format": MANIFEST_FORMAT, "files": files}
    atomic_write_json(os.path.join(ckpt_dir, MANIFEST), man)
    return man


def verify_checkpoint(ckpt_dir: str) -> bool:
    """Check every file against ``manifest.json``. Returns True when verified, False for a
    checkpoint without a manifest (written by an older version); raises
    :class:`CorruptCheckpointError` naming the first missing, truncated or altered file."""
    man_path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.exists(man_path):
        return False
    try:
        with open(man_path, encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"{man_path}: unreadable manifest ({type(exc).__name__}: {exc})") from None
    for rel, meta in sorted(files.items()):
        p = os.path.join(ckpt_dir, rel)
        if not os.path.isfile(p):
            raise CorruptCheckpointError(f"{p}: missing (listed in {MANIFEST})")
        size = os.path.getsize(p)
        if size != meta["size"]:
            raise CorruptCheckpointError(f"{p}: {size} bytes, the manifest says {meta['size']} (truncated or "
                                         "overwritten)")
        if _sha256(p) != meta["sha256"]:
            raise CorruptCheckpointError(f"{p}: checksum differs from the manifest (the file was altered)")
    return True


def checkpoint_dirs(root: str) -> List[str]:
    """The ``step_*`` checkpoint directories under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, d) for d in sorted(os.listdir(root))
            if d.startswith("step_") and os.path.isdir(os.path.join(root, d))]


def latest_pointer(root: str) -> Optional[str]:
    """The directory ``root/latest`` names, if it exists."""
    p = os.path.join(root, "latest")
    if not os.path.exists(p):
        return None
    with open(p) as f:
        name = f.read().strip()
    path = os.path.join(root, name)
    return path if name and os.path.isdir(path) else None


def resume_checkpoint(root: str, say: Callable[[str], None] = print) -> Optional[str]:
    """The checkpoint to resume from: ``latest`` when it verifies, else (with a warning naming
    the bad file) the newest older one that does. ``None`` when there is no checkpoint at all;
    :class:`CorruptCheckpointError` when none is intact."""
    latest = latest_pointer(root)
    cands = checkpoint_dirs(root)
    if latest is not None:
        cands = [c for c in cands if os.path.basename(c) <= os.path.basename(latest)]
        if latest not in cands:
            cands.append(latest)
    if not cands:
        return None
    problems = []
    for c in reversed(cands):
        try:
            if not verify_checkpoint(c):
                say(f"[openrlhf-div] warning: checkpoint {c} has no {MANIFEST} (written by an older version); "
                    "loading it unverified")
        except CorruptCheckpointError as exc:
            problems.append(str(exc))
            say(f"[openrlhf-div] warning: checkpoint {os.path.basename(c)} is corrupt: {exc}")
            continue
        if problems:
            say(f"[openrlhf-div] resuming from the previous intact checkpoint {c} instead; the steps after it "
                "are redone")
            # ``latest`` names the intact one from now on (error messages name the last *good* checkpoint)
            atomic_write_text(os.path.join(root, "latest"), os.path.basename(c) + "\n")
        return c
    raise CorruptCheckpointError("no intact checkpoint under " + root + ":\n  " + "\n  ".join(problems)
                                 + "\nStart a new run (another output_dir) or restore the files.")


# ------------------------------------------------------------------ weights
@torch.no_grad()
def weight_norm(params) -> float:
    """Global L2 norm of ``params`` (float64 accumulation; inf/nan propagate)."""
    ps = [p.detach() for p in params]
    if not ps:
        return 0.0
    norms = torch._foreach_norm(ps)
    return float(torch.linalg.vector_norm(torch.stack([n.double() for n in norms])))


def check_weights(params, start_norm: float, max_growth: float, where: str, last_good: Optional[str],
                  run_dir: str) -> float:
    """Raise :class:`NonFiniteWeightsError` when the weights' norm is not finite or exceeds
    ``max_growth * start_norm`` (``max_growth <= 0`` checks finiteness only); returns the norm."""
    import math

    norm = weight_norm(params)
    bad = None
    if not math.isfinite(norm):
        n_bad = sum(int((~torch.isfinite(p.detach())).sum()) for p in params)
        bad = f"non-finite weights ({n_bad} non-finite values)"
    elif max_growth > 0 and start_norm > 0 and norm > max_growth * start_norm:
        bad = (f"exploding weights (global norm {norm:.4g}, {norm / start_norm:.3g}x its {start_norm:.4g} at the "
               f"start; checkpoint.max_weight_growth={max_growth:g})")
    if bad:
        raise NonFiniteWeightsError(
            f"{bad} after the optimizer step {where}; nothing was checkpointed. Last good checkpoint: "
            f"{last_good or 'none yet'}. Lower optim.learning_rate (or raise optim.max_grad_norm's strictness) and "
            f"continue with --resume {run_dir}" + ("" if last_good else " once a checkpoint exists, or start again"))
    return norm


# ------------------------------------------------------------------ metrics logs
def read_jsonl_rows(path: str, say: Callable[[str], None] = None) -> Tuple[List[Dict[str, Any]], bool]:
    """``(rows, torn)``: the JSON objects of ``path``, one a line. A last line that is cut off
    (no newline, or not valid JSON) is dropped with a warning (``torn=True``); an invalid line
    elsewhere raises ``ValueError`` naming ``path:line``."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")
    rows, torn = [], False
    for i, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        try:
            rows.append(json.loads(ln))
        except ValueError as exc:
            if i >= len(lines) - 1 and all(not x.strip() for x in lines[i:]):
                torn = True
                msg = (f"{path}:{i}: dropped a torn last line ({exc}; {len(ln)} characters) -- what a kill or a "
                       "full disk leaves behind")
                (say or (lambda m: warnings.warn(m, stacklevel=3)))(msg)
                continue
            raise ValueError(f"{path}:{i}: not valid JSON ({exc}); this is not the last line, so the file was not "
                             "just cut off: fix or remove that line") from None
    return rows, torn


# ------------------------------------------------------------------ trainer checkpoints
def rng_states(gen_rng: torch.Generator, train_rng: torch.Generator) -> Dict[str, Any]:
    """Every random stream a run draws from: Python, NumPy, torch (CPU and CUDA), the sampling
    generator and the training generator (mini-batch order, Clip-Cov's token choice)."""
    import random

    import numpy as np

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "gen": gen_rng.get_state(), "train": train_rng.get_state()}


def restore_rng_states(rng: Dict[str, Any], gen_rng: torch.Generator, train_rng: torch.Generator) -> None:
    """Put back what :func:`rng_states` saved."""
    import random

    import numpy as np

    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    gen_rng.set_state(rng["gen"])
    train_rng.set_state(rng["train"])


def write_checkpoint(root: str, step: int, model, tokenizer, state: Dict[str, Any], keep: int) -> str:
    """``root/step_<step>``: the model + tokenizer (``save_pretrained``), ``trainer_state.pt``
    (``state``) and the manifest, written into a temporary directory and renamed into place;
    then ``latest`` is switched atomically and all but the newest ``keep`` checkpoints deleted."""
    import shutil

    from .models import atomic_dir_write

    name = f"step_{step:06d}"

    def write(tmp):
        model.save_pretrained(os.path.join(tmp, "model"))
        tokenizer.save_pretrained(os.path.join(tmp, "model"))
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
        write_manifest(tmp)

    os.makedirs(root, exist_ok=True)
    path = atomic_dir_write(os.path.join(root, name), write)
    atomic_write_text(os.path.join(root, "latest"), name + "\n")
    old = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.startswith("."))
    for d in old[:-max(1, keep)]:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    return path


def read_trainer_state(path: str) -> Dict[str, Any]:
    """``path/trainer_state.pt`` (a checkpoint directory), or :class:`CorruptCheckpointError`."""
    state_file = os.path.join(path, "trainer_state.pt")
    try:
        return torch.load(state_file, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - an unverified (pre-manifest) checkpoint may be torn
        raise CorruptCheckpointError(f"{state_file}: cannot be read ({type(exc).__name__}: {exc})") from None
