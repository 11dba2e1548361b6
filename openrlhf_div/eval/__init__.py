"""Evaluation metrics: pass@k and friends (ALGORITHMS.md section 6)."""
from .passk import mean_at_k, pass_at_k

__all__ = ["pass_at_k", "mean_at_k"]
