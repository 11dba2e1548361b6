"""Evaluation metrics: pass@k and friends (ALGORITHMS.md section 6)."""
from .diversity import distinct_correct, distinct_n, keep_explore_rates, mean_distinct_n, solution_diversity
from .passk import mean_at_k, pass_at_k

__all__ = ["pass_at_k", "mean_at_k", "keep_explore_rates", "distinct_n", "mean_distinct_n",
           "distinct_correct", "solution_diversity"]
