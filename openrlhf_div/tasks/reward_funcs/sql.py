"""OpenRLHF reward file for the ``sql`` task (sandboxed SQLite execution accuracy, BIRD-style).

    --reward.remote_url $(python -c "import openrlhf_div.tasks.reward_funcs.sql as m; print(m.__file__)")

Labels: JSON strings ``{"db_id": ..., "sql": gold}``. Environment: ``OPENRLHF_DIV_SQL_DB_ROOT``
(required: the folder holding ``{db_id}/{db_id}.sqlite``; several folders separated by ``:``,
e.g. BIRD's train and dev databases ``/data/bird/train_databases:/data/bird/dev_databases``, the
first that holds a ``db_id`` wins), ``OPENRLHF_DIV_SQL_TIMEOUT`` (seconds per query, default 5),
``OPENRLHF_DIV_SQL_MAX_ROWS`` (default 10000), ``OPENRLHF_DIV_SQL_COMPARE``
(set|multiset|ordered), ``OPENRLHF_DIV_SQL_FLOAT_ROUND``, ``OPENRLHF_DIV_SQL_BLOCK`` (last|first
```sql block), ``OPENRLHF_DIV_SQL_MAX_RESULT_MB`` (default 64), ``OPENRLHF_DIV_VERIFIER_WORKERS``.

A missing resource is an error, never a reward of 0: an unset variable, a root that is not a
folder, or a label whose database is in none of the roots raises at the call, naming the
variable and the paths (under Ray the variable must travel in the job's runtime env; the
launchers pass every ``OPENRLHF_DIV_*`` variable, see engines/openrlhf/jobs.py).
"""
import os
import socket

from openrlhf_div.tasks.reward_funcs._common import cached_task, compute, env_options

DB_ROOT_VAR = "OPENRLHF_DIV_SQL_DB_ROOT"
_ENV = {"db_root": (DB_ROOT_VAR, str), "timeout": ("OPENRLHF_DIV_SQL_TIMEOUT", float),
        "max_rows": ("OPENRLHF_DIV_SQL_MAX_ROWS", int), "compare": ("OPENRLHF_DIV_SQL_COMPARE", str),
        "float_round": ("OPENRLHF_DIV_SQL_FLOAT_ROUND", int), "num_workers": ("OPENRLHF_DIV_VERIFIER_WORKERS", int),
        "sql_block": ("OPENRLHF_DIV_SQL_BLOCK", str), "max_result_mb": ("OPENRLHF_DIV_SQL_MAX_RESULT_MB", float)}


def check_databases(task, labels) -> None:
    """Raise unless every label's database is found in exactly one place under the roots."""
    from openrlhf_div.tasks.sql import parse_sql_label

    where = f"(process {os.getpid()} on {socket.gethostname()})"
    if not task.db_roots:
        raise RuntimeError(
            f"sql reward: {DB_ROOT_VAR} is not set {where}. Export it (the folder holding "
            "{db_id}/{db_id}.sqlite) before the launcher: examples/scripts pass every OPENRLHF_DIV_* "
            "variable to all Ray workers; with a hand-made `ray job submit` put it in --runtime-env-json")
    for root in task.db_roots:
        if not os.path.isdir(root):
            raise FileNotFoundError(f"sql reward: {DB_ROOT_VAR} names {root!r}, which is not a folder {where}")
    for lab in labels:
        db_id, _ = parse_sql_label(lab)
        found = [p for p in task.db_candidates(db_id) if os.path.isfile(p)]
        if not found:
            raise FileNotFoundError(
                f"sql reward: database {db_id!r} is in none of {DB_ROOT_VAR}={task.db_root!r} (looked for "
                f"{task.db_candidates(db_id)}) {where}; add its folder to {DB_ROOT_VAR} (':'-separated)")
        if len(found) > 1:
            raise ValueError(f"sql reward: database {db_id!r} is in more than one root of {DB_ROOT_VAR}: {found}")


def reward_func(queries, prompts, labels, **kwargs):
    """``{"rewards", "scores", "extra_logs"}`` for a batch; ``kwargs`` override task options."""
    task = cached_task("sql", {**env_options(_ENV), **kwargs})
    check_databases(task, labels)
    return compute(task, queries, prompts, labels)
