"""OpenRLHF reward file for the ``countdown`` task (TinyZero's reward: 1.0 / 0.1 / 0).

    --reward.remote_url $(python -c "import openrlhf_div.tasks.reward_funcs.countdown as m; print(m.__file__)")

Labels: JSON strings ``{"target": int, "numbers": [int, ...]}``. Environment:
``OPENRLHF_DIV_COUNTDOWN_FORMAT_SCORE`` (default 0.1).
"""
from openrlhf_div.tasks.reward_funcs._common import cached_task, compute, env_options

_ENV = {"format_score": ("OPENRLHF_DIV_COUNTDOWN_FORMAT_SCORE", float)}


def reward_func(queries, prompts, labels, **kwargs):
    """``{"rewards", "scores", "extra_logs"}`` for a batch; ``kwargs`` override task options."""
    return compute(cached_task("countdown", {**env_options(_ENV), **kwargs}), queries, prompts, labels)
