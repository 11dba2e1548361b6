"""``TORCH_CUDA_ARCH_LIST`` reaches every process that may JIT-build a DeepSpeed op in a form
DeepSpeed parses (issue 41, item 1: the H200 image's ``9.0a`` made FusedAdam's build fail, silently).

DeepSpeed's own parser (``CUDAOpBuilder.compute_capability_args``, cross-compile mode: it runs on a CPU)
is the judge: it raises on ``9.0a`` and accepts what the Ray workers' runtime env carries."""
from __future__ import annotations

import os

import pytest

from openrlhf_div.compat import cuda_arch
from openrlhf_div.engines.openrlhf import jobs


@pytest.mark.parametrize("value,want,changed", [
    ("9.0a", "9.0", True),
    ("8.0;9.0a", "8.0;9.0", True),
    ("8.0 8.6 9.0a+PTX", "8.0;8.6;9.0+PTX", True),
    ("9.0;9.0a;10.0a;12.0f", "9.0;10.0;12.0", True),
    ("8.0;9.0+PTX", "8.0;9.0+PTX", False),
])
def test_suffixed_entries_lose_their_suffix_others_are_kept(value, want, changed):
    assert cuda_arch.deepspeed_arch_list(value) == (want, changed)


def _deepspeed_parses(value, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv(cuda_arch.VAR, value)   # compute_capability_args rewrites it: monkeypatch restores
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    return FusedAdamBuilder().compute_capability_args()


def test_the_value_a_ray_worker_gets_is_one_deepspeed_parses(monkeypatch, capsys):
    """The driver holds the image's '9.0a': the runtime env of the driver's ``ray.init`` and of a
    submitted job (what a Ray worker's environment is made of) carry '9.0', said in one line."""
    with pytest.raises(ValueError, match="0a"):   # the failure the H200 run hit
        _deepspeed_parses("9.0a", monkeypatch)
    cuda_arch._ANNOUNCED.clear()
    driver = {cuda_arch.VAR: "8.0;9.0a", "RUN_DIR": "/r"}
    worker_vars = jobs.driver_runtime_env(driver)["env_vars"]
    job_vars = jobs.job_runtime_env_vars(driver)
    assert worker_vars[cuda_arch.VAR] == job_vars[cuda_arch.VAR] == "8.0;9.0"
    flags = _deepspeed_parses(worker_vars[cuda_arch.VAR], monkeypatch)
    assert "-gencode=arch=compute_90,code=sm_90" in flags
    lines = [x for x in capsys.readouterr().err.splitlines() if cuda_arch.VAR in x]
    assert len(lines) == 1 and "'9.0a'" in lines[0] and "DeepSpeed" in lines[0], lines
    # a parseable value travels unchanged, silently; none set: none sent
    assert jobs.job_runtime_env_vars({cuda_arch.VAR: "9.0"})[cuda_arch.VAR] == "9.0"
    assert cuda_arch.VAR not in jobs.job_runtime_env_vars({})
    assert capsys.readouterr().err == ""


def test_this_process_is_fixed_for_the_local_and_megatron_engines(capsys):
    env = {cuda_arch.VAR: "9.0a"}
    cuda_arch._ANNOUNCED.clear()
    assert cuda_arch.fix_arch_env(env) == "9.0" and env[cuda_arch.VAR] == "9.0"
    assert cuda_arch.fix_arch_env(env) is None   # already parseable
    assert cuda_arch.fix_arch_env({}) is None
    assert capsys.readouterr().err.count(cuda_arch.VAR) == 1
    # the engines call it where they start (a local Trainer, a MegatronEngine, the GPU bench)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for rel in ("openrlhf_div/engines/local/trainer.py", "openrlhf_div/engines/megatron/engine.py",
                "benchmarks/gpu_bench.py"):
        assert "fix_arch_env(" in open(os.path.join(root, rel)).read(), rel
