"""OpenRLHF reward file for the ``math`` task (math-verify under a hard time limit).

    --reward.remote_url $(python -c "import openrlhf_div.tasks.reward_funcs.math as m; print(m.__file__)")

Labels: the gold answer string. Environment: ``OPENRLHF_DIV_MATH_TIMEOUT`` (seconds per check,
default 5), ``OPENRLHF_DIV_MATH_EXTRACT`` (``strict``, the default, or ``lenient``: the last
number as a fallback), ``OPENRLHF_DIV_VERIFIER_WORKERS`` (verifier processes per reward caller).
"""
from openrlhf_div.tasks.reward_funcs._common import cached_task, compute, env_options

_ENV = {"timeout": ("OPENRLHF_DIV_MATH_TIMEOUT", float), "num_workers": ("OPENRLHF_DIV_VERIFIER_WORKERS", int),
        "extract": ("OPENRLHF_DIV_MATH_EXTRACT", str)}


def reward_func(queries, prompts, labels, **kwargs):
    """``{"rewards", "scores", "extra_logs"}`` for a batch; ``kwargs`` override task options."""
    return compute(cached_task("math", {**env_options(_ENV), **kwargs}), queries, prompts, labels)
