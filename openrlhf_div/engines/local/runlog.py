"""What a local training run writes besides checkpoints: ``run_info.json`` and ``config.yaml``,
the JSONL logs (``metrics.jsonl``, ``eval.jsonl``; cut back to the checkpoint's step on
resume), TensorBoard scalars (``tb/``) and, when asked for, Weights & Biases.

Weights & Biases is optional and off by default: set ``OPENRLHF_DIV_WANDB=<project>`` (with
``WANDB_MODE=offline`` it writes ``RUN_DIR/wandb`` without a network or an account). ``wandb`` is
not a dependency of the project; asking for it without the package installed is an error that
says so.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import time
from typing import Any, Dict, Mapping, Optional

from openrlhf_div.io import atomic_write_json, atomic_write_text

from .checkpoint import read_jsonl_rows

WANDB_ENV = "OPENRLHF_DIV_WANDB"


class WandbMissingError(RuntimeError):
    """``OPENRLHF_DIV_WANDB`` asks for Weights & Biases but ``wandb`` is not installed."""


def own_commit(root: str, short: bool = False) -> Optional[str]:
    """The commit checked out in ``root``'s own repository, or ``None`` when ``root`` is not the top of
    a git checkout (a plain copy, an installed package): never the commit of a repository that merely
    encloses it, which ``git -C root rev-parse HEAD`` alone would answer."""
    root = os.path.realpath(root)
    if not os.path.exists(os.path.join(root, ".git")):   # a folder (clone) or a file (worktree, submodule)
        return None
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "--show-toplevel", *(["--short"] if short else []),
                              "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2 or os.path.realpath(lines[0]) != root:
        return None
    return lines[1]


def git_commit() -> Optional[str]:
    """The commit of the checkout this package runs from (:func:`own_commit`), ``None`` if none."""
    from openrlhf_div.shipped import CHECKOUT_DIR  # the folder above the package: a checkout, or site-packages

    return own_commit(CHECKOUT_DIR)


def scalars(values: Mapping[str, Any]) -> Dict[str, float]:
    """The finite numbers of ``values`` (nested dicts flattened as ``a/b``), for TensorBoard / W&B."""
    out: Dict[str, float] = {}
    for k, v in values.items():
        if isinstance(v, Mapping):
            out.update({f"{k}/{kk}": vv for kk, vv in scalars(v).items()})
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
            out[k] = float(v)
    return out


class RunLog:
    """The run directory's logs. ``tensorboard``: write ``tb/`` scalars (a missing
    ``tensorboard`` package is reported once and skipped); W&B per :data:`WANDB_ENV`."""

    def __init__(self, run_dir: str, tensorboard: bool = True, run_name: Optional[str] = None,
                 config: Optional[Mapping[str, Any]] = None):
        self.run_dir = run_dir
        self.tensorboard = tensorboard
        self._tb = None
        self._tb_missing = False
        self._wandb = None
        project = os.environ.get(WANDB_ENV)
        if project:
            try:
                import wandb
            except ImportError:
                raise WandbMissingError(
                    f"{WANDB_ENV}={project} asks for Weights & Biases logging but the `wandb` package is not "
                    f"installed: pip install wandb (WANDB_MODE=offline works without an account), or unset "
                    f"{WANDB_ENV}; metrics also go to metrics.jsonl and TensorBoard") from None
            os.makedirs(run_dir, exist_ok=True)
            self._wandb = wandb.init(project=project, dir=run_dir, name=run_name, config=dict(config or {}),
                                     resume="allow", id=_wandb_id(run_dir))

    # ------------------------------------------------------------------ JSONL
    def append(self, fname: str, row: Mapping[str, Any]) -> None:
        with open(os.path.join(self.run_dir, fname), "a") as f:
            f.write(json.dumps(row, default=float) + "\n")

    def truncate(self, fname: str, step: int) -> None:
        """Drop the rows of ``fname`` logged after ``step`` (they belong to steps a resumed run
        redoes); a torn last line is dropped with a warning."""
        p = os.path.join(self.run_dir, fname)
        if not os.path.exists(p):
            return
        rows, _ = read_jsonl_rows(p)
        keep = [r for r in rows if r.get("step", 0) <= step]
        atomic_write_text(p, "".join(json.dumps(r, default=float) + "\n" for r in keep))

    # ------------------------------------------------------------------ scalars
    def scalars(self, prefix: str, values: Mapping[str, Any], step: int) -> None:
        """``values`` (numbers, nested dicts flattened) as ``prefix/key`` at ``step`` to
        TensorBoard and W&B."""
        flat = {f"{prefix}/{k}": v for k, v in scalars(values).items() if k != "step"}
        tb = self._writer()
        if tb is not None:
            for k, v in flat.items():
                tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(flat, step=step)

    def _writer(self):
        if not self.tensorboard or self._tb_missing:
            return None
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self._tb_missing = True
                print("[openrlhf-div] TensorBoard logging is on but the `tensorboard` package is not installed: "
                      "metrics go to metrics.jsonl only (pip install tensorboard, or logging.tensorboard=false)")
                return None
            self._tb = SummaryWriter(os.path.join(self.run_dir, "tb"))
        return self._tb

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    # ------------------------------------------------------------------ run info
    def write_run_info(self, config_yaml: str, info: Mapping[str, Any], resumed_step: Optional[int]) -> None:
        """``config.yaml`` and ``run_info.json`` (``run_info.resume_<step>.json`` on resume), with
        the versions, the git commit and the time added to ``info``."""
        import torch
        import transformers

        from openrlhf_div import __version__
        os.makedirs(self.run_dir, exist_ok=True)
        atomic_write_text(os.path.join(self.run_dir, "config.yaml"), config_yaml)
        from openrlhf_div.engines.runinfo import machine, versions

        full = {**dict(info), "engine": "local", "openrlhf_div": __version__, "git_commit": git_commit(),
                "torch": torch.__version__, "transformers": transformers.__version__, "versions": versions(),
                "machine": machine(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "resumed_from_step": resumed_step}
        name = "run_info.json" if resumed_step is None else f"run_info.resume_{resumed_step:06d}.json"
        atomic_write_json(os.path.join(self.run_dir, name), full, default=str)


def _wandb_id(run_dir: str) -> str:
    """A stable W&B run id per run directory, so ``--resume`` continues the same W&B run."""
    import hashlib

    return hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:16]
