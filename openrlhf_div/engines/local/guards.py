"""No silent non-learning: set-ups whose updates are all zero stop with a reason.

* An anchor method (DPH-RL) whose D_pef is empty trains exactly like GRPO: the trainer stops
  with the pre-sampling ``#correct`` histogram and the threshold to change
  (:class:`~openrlhf_div.engines.anchor_data.EmptyAnchorError`, raised by the engine-neutral
  ``D_pef`` reader).
* ``rollout.group_size < 2`` with a group advantage estimator gives zero advantages: a
  config error (:func:`check_group_size`; the Ray driver's plan refuses
  ``--rollout.n_samples_per_prompt 1`` with the same guard).
* A group whose rewards are all equal has zero advantage for every method's estimator; a
  step whose groups are *all* such is degenerate. :func:`degenerate_stats` counts them
  (metrics ``degenerate_groups_frac`` and ``degenerate_step``, and why: every response
  truncated, every reward 0, or all rewards equal) and :class:`DegenerateMonitor` stops the
  run after ``optim.stop_after_degenerate_steps`` consecutive degenerate steps.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from openrlhf_div.engines.anchor_data import EmptyAnchorError  # noqa: F401 (raised by the D_pef reader)



class DegenerateRunError(RuntimeError):
    """Too many consecutive steps without any learning signal."""


def check_group_size(method, group_size: int, key: str = "rollout.group_size") -> Optional[str]:
    """The config error for fewer than 2 responses per prompt with a group estimator, else None.
    One guard for every engine; ``key`` names the setting where it was read: the local engine's
    ``rollout.group_size``, the Ray driver's ``rollout.n_samples_per_prompt`` (its plan calls this
    before OpenRLHF's own checks; OpenRLHF 0.11.2's driver asserts the same for its estimators rloo,
    reinforce_baseline, group_norm and dr_grpo, naming its estimator rather than the method)."""
    from openrlhf_div.algorithms.registry import ESTIMATORS

    est = ESTIMATORS.get(getattr(method, "estimator", None))
    if int(group_size) < 2 and est is not None and est.group:  # as the estimator declared it
        return (f"{key}={group_size}: method {method.name!r} uses the group estimator "
                f"{method.estimator!r}, whose advantages are all zero with fewer than 2 responses per prompt "
                f"(nothing would be learned); use {key} >= 2 (DPH-RL and GRPO papers use 8-16)")
    return None


def degenerate_stats(rewards: torch.Tensor, finished: torch.Tensor, group_size: int) -> Dict[str, Any]:
    """Per step: the share of groups whose rewards are all equal, whether every group is so
    (``degenerate_step``), and why (``degenerate_reason``: ``all truncated`` /
    ``all rewards 0`` / ``all rewards equal``; empty when the step is fine)."""
    r = rewards.detach().float().cpu().view(-1, group_size)
    flat = (r.max(1).values - r.min(1).values) <= 1e-12
    frac = float(flat.float().mean()) if r.numel() else 0.0
    step_deg = bool(flat.all()) if r.numel() else False
    reason = ""
    if step_deg:
        parts = []
        if finished.numel() and not bool(finished.bool().any()):
            parts.append("every response was truncated at max_new_tokens")
        if float(r.abs().max()) == 0.0:
            parts.append("every reward was 0")
        elif float(r.max() - r.min()) == 0.0:
            parts.append(f"every reward was {float(r[0, 0]):g}")
        else:
            parts.append("within each group all rewards were equal")
        reason = " and ".join(parts)
    return {"degenerate_groups_frac": frac, "degenerate_step": float(step_deg), "degenerate_reason": reason}


class DegenerateMonitor:
    """Counts consecutive degenerate steps; :meth:`update` raises :class:`DegenerateRunError`
    when ``limit`` (> 0) of them follow each other."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.consecutive = 0
        self.total = 0

    # the counters travel in the checkpoint: a resumed run continues them (the stop counts the
    # consecutive degenerate steps before the resume too, the progress line the run's total)
    def state_dict(self) -> Dict[str, int]:
        return {"consecutive": int(self.consecutive), "total": int(self.total)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.consecutive = int(state.get("consecutive", 0))
        self.total = int(state.get("total", 0))

    def rebuild(self, rows) -> None:
        """The counters from the logged rows of the steps done (``metrics.jsonl``), for a
        checkpoint written before they were saved."""
        self.consecutive = self.total = 0
        for r in rows:
            if r.get("degenerate_step"):
                self.consecutive += 1
                self.total += 1
            else:
                self.consecutive = 0

    def update(self, stats: Dict[str, Any], step: int) -> None:
        if stats.get("degenerate_step"):
            self.consecutive += 1
            self.total += 1
        else:
            self.consecutive = 0
        stats["degenerate_steps_total"] = float(self.total)
        if self.limit > 0 and self.consecutive >= self.limit:
            raise DegenerateRunError(
                f"{self.consecutive} consecutive steps (up to step {step}) without any learning signal: "
                f"{stats.get('degenerate_reason') or 'all groups had equal rewards'}, so every advantage was 0. "
                f"Check the data and task (do labels match the answers the model gives?), raise "
                f"rollout.max_new_tokens if responses are cut off, or use an easier curriculum; "
                f"optim.stop_after_degenerate_steps=0 disables this stop")
