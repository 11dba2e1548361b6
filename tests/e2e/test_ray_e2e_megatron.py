"""The Megatron-core policy actor inside the CPU end-to-end run (issue 10): the same private Ray
head and tiny experiment as test_ray_e2e.py, real ``ray job submit``, real vLLM CPU engine.

``configs/openrlhf/tiny_cpu_grpo_megatron.yaml``: the policy is two Megatron-core Ray actors at
TP=2 (gloo, bf16; megatron-core's CUDA-only corners redirected by the cluster's CPU seams).
Every weight sync gathers the TP-sharded parameters one HF tensor at a time and broadcasts it to
the vLLM engine; right after each sync the probe (site/e2e_probe.py) scores one fixed sequence
with the actor's forward and with vLLM. Facts: two steps train on rewards that vary; after every
sync vLLM's log-probs equal the Megatron forward's (bf16 tolerance) and they moved between syncs;
the exported weights changed.
"""
from __future__ import annotations

import os

import pytest

from test_ray_e2e import _check_training, _job, _weights_changed

pytestmark = [pytest.mark.ray_e2e, pytest.mark.slow]


def test_megatron_tp2_policy_actor_job(ray_head, tiny_experiment, tmp_path):
    run = str(tmp_path / "grpo_megatron")
    _job(ray_head, tiny_experiment, "grpo_megatron", run)
    _check_training(run, tiny_experiment, [1, 2])
    assert _weights_changed(tiny_experiment, os.path.join(run, "model")) > 0
