"""Fixtures of the CPU end-to-end tests (a private Ray head + the tiny experiment), shared by
every engine's e2e test in this folder (see ray_harness.py)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ray_harness  # noqa: E402


def _have_stack() -> str:
    """Why the real stack cannot run here ('' when it can)."""
    import importlib.util

    for mod in ("vllm", "ray", "deepspeed", "openrlhf"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (bash scripts/setup_env.sh installs the CPU stack)"
    return ""


#: set to 1 to leave the end-to-end run out of a local `bash scripts/test.sh` (never in CI)
SKIP = "OPENRLHF_DIV_SKIP_RAY_E2E"


@pytest.fixture(scope="session")
def tiny_experiment(tmp_path_factory):
    if os.environ.get(SKIP) == "1":
        pytest.skip(f"{SKIP}=1: the Ray/vLLM end-to-end run was switched off by hand")
    why = _have_stack()
    if why and os.environ.get("CI"):
        pytest.fail(why)  # the README's set-up installs the whole stack: in CI it must run
    if why:
        pytest.skip(why)
    return ray_harness.build_tiny_experiment(str(tmp_path_factory.mktemp("tiny_cpu")))


@pytest.fixture(scope="session")
def ray_head(tiny_experiment):
    head = ray_harness.RayHead(keep_logs=str(tiny_experiment.root) + "/ray_logs").start(
        timeout=float(os.environ.get("OPENRLHF_DIV_RAY_E2E_START_TIMEOUT", "600")))
    try:
        yield head
    finally:
        head.stop()
        left = head.own_pids()
        assert not left, f"Ray processes left behind: {left}"
