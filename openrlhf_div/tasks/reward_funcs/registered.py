"""OpenRLHF reward file for any registered task without a file of its own (a plug-in's task).

The Ray driver points ``--reward.remote_url`` here for ``--div.task NAME`` when
``reward_funcs/NAME.py`` does not exist, and sets ``OPENRLHF_DIV_TASK=NAME``; the launchers hand
every ``OPENRLHF_DIV_*`` variable to the Ray workers (:mod:`openrlhf_div.engines.openrlhf.jobs`),
so the reward worker builds the task with :func:`openrlhf_div.tasks.get_task`, which imports the
plug-ins of ``OPENRLHF_DIV_PLUGINS`` first.
"""
import os

from openrlhf_div.tasks.reward_funcs._common import cached_task, compute

TASK_VAR = "OPENRLHF_DIV_TASK"


def reward_func(queries, prompts, labels, **kwargs):
    """``{"rewards", "scores", "extra_logs"}`` for a batch of the task named by ``OPENRLHF_DIV_TASK``."""
    name = os.environ.get(TASK_VAR)
    if not name:
        raise ValueError(f"{__file__}: {TASK_VAR} is not set; run through the openrlhf-div driver with "
                         "--div.task NAME (it sets the variable for the Ray workers)")
    return compute(cached_task(name, dict(kwargs)), queries, prompts, labels)
