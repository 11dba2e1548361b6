"""Tasks: prompts and verifiable rewards. ``get_task(name, **options)`` is the entry point.

A task turns a dataset example into a prompt and scores a response against its label.
``reward`` never raises: any failure is reward 0 with a reason (see :class:`RewardResult`).
"""
from .base import RewardResult, Task, get_task, list_tasks, register_task

__all__ = ["Task", "RewardResult", "get_task", "list_tasks", "register_task"]
register_task("demo", module="openrlhf_div.tasks.demo")
