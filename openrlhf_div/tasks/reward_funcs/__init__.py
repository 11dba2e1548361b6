"""OpenRLHF reward-function files, one per task (``--reward.remote_url <file>.py``).

Each file exposes ``reward_func(queries, prompts, labels, **kwargs)`` returning
``{"rewards": Tensor[B], "scores": Tensor[B], "extra_logs": {name: Tensor[B]}}`` -- the
contract of OpenRLHF 0.11.2's ``SingleTurnAgentExecutor`` -- and scores with the same verifier
as ``openrlhf_div.tasks.get_task(name)``, so both engines share one reward. Options come from
environment variables (OpenRLHF passes none; set them in the Ray job's ``runtime_env``), or
from keyword arguments when called directly. See :mod:`._common`.
"""
