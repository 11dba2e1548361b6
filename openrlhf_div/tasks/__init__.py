"""Tasks: prompts and verifiable rewards. ``get_task(name, **options)`` is the entry point.

A task turns a dataset example into a prompt and scores a response against its label.
``reward`` never raises: any failure is reward 0 with a reason (see :class:`RewardResult`).

Registered lazily (the module is imported on first ``get_task``):
``math`` (gold answer string; math-verify), ``sql`` (``{"db_id", "sql"}``; sandboxed SQLite
execution accuracy), ``countdown`` (``{"target", "numbers"}``; TinyZero's reward), ``demo``
(the five-style arithmetic task of ``openrlhf-div demo``).
"""
from .base import RewardResult, Task, get_task, list_tasks, register_task, render_prompt

register_task("math", module="openrlhf_div.tasks.math")
register_task("sql", module="openrlhf_div.tasks.sql")
register_task("countdown", module="openrlhf_div.tasks.countdown")
register_task("demo", module="openrlhf_div.tasks.demo")

__all__ = ["Task", "RewardResult", "get_task", "list_tasks", "register_task", "render_prompt"]
