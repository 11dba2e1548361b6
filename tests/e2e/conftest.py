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


def pytest_terminal_summary(terminalreporter):
    """The fault corpus's lines (test_ray_faults.py): one per case, then the summary."""
    import e2e_faults_util as fu

    ran = [r for key in ("passed", "failed") for r in terminalreporter.stats.get(key, [])
           if getattr(r, "when", "") == "call" and "test_ray_faults.py" in r.nodeid]
    if not ran:
        return
    failed = [r.nodeid.split("::")[-1] for r in ran if r.failed]
    terminalreporter.write_sep("-", "Ray fault corpus (issue 34)")
    for line in fu.RECORDS:
        terminalreporter.write_line(line)
    for name in failed:
        terminalreporter.write_line(f"NOT survived: {name}")
    for r in terminalreporter.stats.get("xfailed", []):
        if "test_ray_faults.py" in r.nodeid:
            terminalreporter.write_line(f"not counted (expected to fail until its protection lands): "
                                        f"{r.nodeid.split('::')[-1]}: {getattr(r, 'wasxfail', '')}")
    counted = {r.nodeid for r in ran}
    lost = len({t for t in fu.COUNTS["lost"] if t in counted})
    silent = len({t for t in fu.COUNTS["silent"] if t in counted})
    terminalreporter.write_line(f"{len(ran) - len(failed)} of {len(ran)} faults survived, "
                                f"{lost} runs lost, {silent} silent")
