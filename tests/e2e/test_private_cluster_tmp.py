"""The private Ray cluster a driver starts when none runs (``jobs.init_ray``) leaves no
``/tmp/openrlhf_div_ray_*`` folder behind (issue 30): removed at a normal exit and when the run is
stopped (Ctrl-C, SIGTERM); kept when the run failed (the driver's last line names its logs) or when
``OPENRLHF_DIV_KEEP_RAY_TMP=1``.

Each case is a real driver process (``ray.init`` of a private local cluster, the CPU layer) that
ends the way a run ends; no training job (a private cluster starts in seconds)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = [pytest.mark.ray_e2e, pytest.mark.slow]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DRIVER = textwrap.dedent("""
    import os, sys, time
    from openrlhf_div.engines.openrlhf import jobs
    jobs.running_cluster = lambda environ=None: None  # never join another cluster of this machine
    jobs.init_ray(need={"GPU": 1, "CPU": 1})
    print("READY " + jobs._PRIVATE["dir"], flush=True)
    mode = sys.argv[1]
    if mode == "ok":
        jobs.private_cluster_done()  # what launch.main / presample.main call on success
    elif mode == "error":
        raise RuntimeError("a failing run")
    elif mode == "wait":
        time.sleep(600)
""")


@pytest.fixture(scope="module")
def have_ray():
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed")


def _driver(mode: str, *, signum=None, keep=False):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("OPENRLHF_DIV_")}
    env.update(PYTHONPATH=REPO, RAY_USAGE_STATS_ENABLED="0")
    if keep:
        env["OPENRLHF_DIV_KEEP_RAY_TMP"] = "1"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, mode], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    temp_dir, lines = None, []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("READY "):
                temp_dir = line.split(" ", 1)[1].strip()
                if signum is not None:
                    time.sleep(1.0)
                    os.kill(proc.pid, signum)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines)
    assert temp_dir and os.path.basename(temp_dir).startswith("openrlhf_div_ray_"), out[-3000:]
    return proc.returncode, out, temp_dir


def _last(out: str) -> str:
    return [ln for ln in out.splitlines() if ln.strip()][-1]


def test_removed_after_a_normal_exit(have_ray):
    rc, out, d = _driver("ok")
    assert rc == 0, out[-3000:]
    assert not os.path.exists(d), (d, os.listdir(d))
    from openrlhf_div.engines.openrlhf.head import own_pids

    assert not own_pids(d, -1), "processes of the private cluster outlived its driver"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_removed_when_the_run_is_stopped(have_ray, signum):
    rc, out, d = _driver("wait", signum=signum)
    assert rc != 0, out[-3000:]
    assert not os.path.exists(d), (d, out[-2000:])


def test_kept_with_its_logs_named_when_the_run_failed(have_ray):
    rc, out, d = _driver("error")
    try:
        assert rc == 1 and "a failing run" in out, out[-3000:]
        assert os.path.isdir(os.path.join(d, "session_latest", "logs")), out[-2000:]
        assert _last(out) == f"[openrlhf-div] the run did not finish: the private Ray cluster's logs are kept in " \
                             f"{d}/session_latest/logs", out[-2000:]
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_kept_when_asked(have_ray):
    rc, out, d = _driver("ok", keep=True)
    try:
        assert rc == 0 and os.path.isdir(d), out[-3000:]
        assert _last(out) == f"[openrlhf-div] OPENRLHF_DIV_KEEP_RAY_TMP=1: the private Ray cluster's files are kept " \
                             f"in {d}", out[-2000:]
    finally:
        shutil.rmtree(d, ignore_errors=True)
