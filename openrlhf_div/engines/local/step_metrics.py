"""The metrics of one RL step, accumulated over its micro-batches as structured values.

A method's loss parts (``loss``, ``loss_exp``, ...) are already divided by the optimizer step's
global token / sequence counts, so within an optimizer step they *add up* over micro-batches;
the step reports their mean over optimizer steps. Every other metric (clip fraction, entropy,
gradient norm, ...) is a mean over the micro-batches (or optimizer steps) that reported it.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List


class StepMetrics:
    def __init__(self):
        self._loss: Dict[str, List[float]] = defaultdict(list)  # per optimizer step, summed micro-batches
        self._sums: Dict[str, float] = defaultdict(float)
        self._counts: Dict[str, int] = defaultdict(int)
        self.optimizer_steps = 0

    def add_micro_batch(self, metrics: Dict[str, float]) -> None:
        """One micro-batch's ``method.loss`` metrics (within the current optimizer step)."""
        for key, val in metrics.items():
            if key.startswith("loss"):
                parts = self._loss[key]
                parts.extend([0.0] * (self.optimizer_steps + 1 - len(parts)))
                parts[self.optimizer_steps] += float(val)
            else:
                self.add_mean(key, val)

    def add_mean(self, key: str, val: float) -> None:
        self._sums[key] += float(val)
        self._counts[key] += 1

    def end_optimizer_step(self) -> None:
        self.optimizer_steps += 1

    def result(self) -> Dict[str, float]:
        n = max(self.optimizer_steps, 1)
        out = {k: sum(v) / n for k, v in self._loss.items()}
        out.update({k: self._sums[k] / self._counts[k] for k in self._sums})
        out["optimizer_steps"] = float(self.optimizer_steps)
        return out
