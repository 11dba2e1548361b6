"""OpenRLHF reward file for the ``sql`` task (sandboxed SQLite execution accuracy, BIRD-style).

    --reward.remote_url $(python -c "import openrlhf_div.tasks.reward_funcs.sql as m; print(m.__file__)")

Labels: JSON strings ``{"db_id": ..., "sql": gold}``. Environment: ``OPENRLHF_DIV_SQL_DB_ROOT``
(required: the folder holding ``{db_id}/{db_id}.sqlite``), ``OPENRLHF_DIV_SQL_TIMEOUT``
(seconds per query, default 5), ``OPENRLHF_DIV_SQL_MAX_ROWS`` (default 10000),
``OPENRLHF_DIV_SQL_COMPARE`` (set|multiset|ordered), ``OPENRLHF_DIV_SQL_FLOAT_ROUND``,
``OPENRLHF_DIV_SQL_BLOCK`` (last|first ```sql block), ``OPENRLHF_DIV_SQL_MAX_RESULT_MB`` (default 64),
``OPENRLHF_DIV_VERIFIER_WORKERS``.
"""
from openrlhf_div.tasks.reward_funcs._common import cached_task, compute, env_options

_ENV = {"db_root": ("OPENRLHF_DIV_SQL_DB_ROOT", str), "timeout": ("OPENRLHF_DIV_SQL_TIMEOUT", float),
        "max_rows": ("OPENRLHF_DIV_SQL_MAX_ROWS", int), "compare": ("OPENRLHF_DIV_SQL_COMPARE", str),
        "float_round": ("OPENRLHF_DIV_SQL_FLOAT_ROUND", int), "num_workers": ("OPENRLHF_DIV_VERIFIER_WORKERS", int),
        "sql_block": ("OPENRLHF_DIV_SQL_BLOCK", str), "max_result_mb": ("OPENRLHF_DIV_SQL_MAX_RESULT_MB", float)}


def reward_func(queries, prompts, labels, **kwargs):
    """``{"rewards", "scores", "extra_logs"}`` for a batch; ``kwargs`` override task options."""
    return compute(cached_task("sql", {**env_options(_ENV), **kwargs}), queries, prompts, labels)
