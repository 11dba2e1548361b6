"""The Ray head ``run.sh EXPERIMENT --submit`` starts for its job when no cluster answers.

``examples/scripts/_common.sh`` (``ensure_ray_head``) calls ``python -m
openrlhf_div.engines.openrlhf.head start`` when ``RAY_ADDRESS`` is unset and no Ray dashboard
answers at the default ``http://127.0.0.1:8265``. The head is the job's own:

* every port picked free (GCS, dashboard, dashboard agent, Ray client, worker range), never Ray's
  defaults 6379 / 8265 / 52365 / 10001: another cluster on the machine (another user's, a
  test's) or a Redis on 6379 never collides with it, and it never answers a later probe of the
  default address by mistake;
* its own temp dir ``/tmp/openrlhf_div_ray_XXXXXX`` (short: Ray's socket paths live under it);
* the launcher's Python first on its ``PATH`` (the job's entrypoint runs ``python -m ...``: with the
  checkout's ``.venv`` not activated, a fresh user's ``python`` would be missing or another one);
* ``ray start`` in its own session, so :func:`stop` ends this cluster only (its process group,
  then every process whose command line names its temp dir or its GCS address), never
  ``ray stop`` (which stops every Ray cluster of the machine);
* the launcher stops it when the job ends, fails or is interrupted (a ``trap``), and removes the
  temp dir unless the job failed (its logs are kept there, and the last line says where) or
  ``OPENRLHF_DIV_KEEP_RAY_TMP=1``.

``start`` prints shell assignments for the launcher (``JOB_HEAD_DIR``, ``JOB_HEAD_ADDRESS``,
``JOB_HEAD_GCS``); ``stop DIR`` ends the cluster recorded there.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Dict, List, Optional, Sequence

#: the temp dirs of the clusters openrlhf-div starts (this head and the driver's private cluster)
TEMP_PREFIX = "openrlhf_div_ray_"
#: set to 1 to keep a cluster's temp dir (its logs) after a successful run
KEEP_ENV = "OPENRLHF_DIV_KEEP_RAY_TMP"
_STATE = "openrlhf_div_head.json"


def keep_tmp(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return str(environ.get(KEEP_ENV, "")).lower() in ("1", "true", "yes")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/api/version", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def _ray_bin() -> List[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "ray")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "ray.scripts.scripts"]


def start(num_gpus: int, num_cpus: Optional[int] = None, *, attempts: int = 3,
          timeout: float = 300.0) -> Dict[str, object]:
    """Start the job's head; returns ``{"dir", "address", "gcs_port", "dashboard_port", "pgid"}``.

    On a loaded machine Ray's hard-coded 30 s raylet registration can time out: a failed start is
    stopped and retried with fresh ports and a fresh temp dir."""
    last = ""
    for _ in range(attempts):
        temp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir="/tmp")
        gcs, dash = free_port(), free_port()
        lo = free_port()
        cmd = _ray_bin() + [
            "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
            "--include-dashboard=true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
            "--dashboard-agent-listen-port", str(free_port()), "--ray-client-server-port", str(free_port()),
            "--min-worker-port", str(lo), "--max-worker-port", str(lo + 200),
            "--num-gpus", str(num_gpus), "--temp-dir", temp_dir]
        if num_cpus:
            cmd += ["--num-cpus", str(num_cpus)]
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        # the job's entrypoint runs `python -m ...` in the head's environment: this Python (the
        # checkout's .venv, not activated) must be the `python` there
        bin_dir = os.path.dirname(sys.executable)
        env["PATH"] = os.pathsep.join([bin_dir] + [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bin_dir])
        # a loaded machine starts the dashboard's modules slowly (Ray's default wait is 30 s)
        env.setdefault("RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT", "300")
        env.setdefault("RAY_DASHBOARD_STARTUP_TIMEOUT_S", "300")
        log_path = os.path.join(temp_dir, "head.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        state = {"dir": temp_dir, "address": f"http://127.0.0.1:{dash}", "gcs_port": gcs, "dashboard_port": dash,
                 "pgid": proc.pid}
        with open(os.path.join(temp_dir, _STATE), "w") as fh:
            json.dump(state, fh)
        try:
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = None
            deadline = time.time() + 60
            while rc == 0 and time.time() < deadline:
                if _answers(state["address"]):
                    return state
                time.sleep(1.0)
        except BaseException:  # Ctrl-C / SIGTERM while starting: no half-started head is left behind
            stop(temp_dir, keep=False)
            raise
        with open(log_path) as fh:
            last = fh.read()[-2000:]
        stop(temp_dir, keep=False)
    raise RuntimeError(f"ray start failed {attempts} times; its last output:\n{last}")


def own_pids(temp_dir: str, gcs_port: int) -> List[int]:
    """Processes of the cluster: its temp dir or its GCS address in their command line, or its GCS
    address as their ``RAY_ADDRESS`` (a job's driver: Ray starts it in a session of its own)."""
    import re

    gcs = re.compile(rf"127\.0\.0\.1:{int(gcs_port)}(?!\d)")
    env = re.compile(rf"(^|\x00)RAY_ADDRESS=(http://)?127\.0\.0\.1:{int(gcs_port)}(?!\d)")
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().decode(errors="replace")
        except OSError:
            continue
        if temp_dir in cmd or gcs.search(cmd):
            out.append(int(pid))
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if env.search(fh.read().decode(errors="replace")):
                    out.append(int(pid))
        except OSError:
            pass
    return out


def stop(temp_dir: str, *, keep: bool = False) -> None:
    """End the cluster whose state ``temp_dir`` holds (its process group, then its stragglers);
    remove ``temp_dir`` unless ``keep``."""
    try:
        with open(os.path.join(temp_dir, _STATE)) as fh:
            state = json.load(fh)
    except (OSError, ValueError):
        state = {}
    pgid, gcs = state.get("pgid"), state.get("gcs_port", -1)
    if pgid:
        try:
            os.killpg(int(pgid), signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.time() + 10
        pids = own_pids(temp_dir, gcs)
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        while pids and time.time() < deadline:
            time.sleep(0.5)
            pids = own_pids(temp_dir, gcs)
    if pgid:
        try:
            os.killpg(int(pgid), signal.SIGKILL)  # the workers (ray::...) left in the group
        except (ProcessLookupError, PermissionError):
            pass
    if not keep:
        import shutil

        shutil.rmtree(temp_dir, ignore_errors=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m openrlhf_div.engines.openrlhf.head",
                                 description="the Ray head of one `run.sh --submit` job (see the module doc)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("start", help="start a head on free ports; print shell assignments")
    st.add_argument("--num-gpus", type=int, required=True)
    st.add_argument("--num-cpus", type=int, default=None)
    sp = sub.add_parser("stop", help="stop the head whose temp dir is DIR")
    sp.add_argument("dir")
    sp.add_argument("--keep", action="store_true", help="keep DIR (the cluster's logs)")
    a = ap.parse_args(argv)
    if a.cmd == "start":
        try:
            s = start(a.num_gpus, a.num_cpus)
        except RuntimeError as exc:
            print(f"error: could not start a Ray head for the job: {exc}", file=sys.stderr)
            return 2
        print(f"JOB_HEAD_DIR={shlex.quote(str(s['dir']))} JOB_HEAD_ADDRESS={shlex.quote(str(s['address']))} "
              f"JOB_HEAD_GCS={s['gcs_port']}")
        return 0
    stop(a.dir, keep=a.keep or keep_tmp())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
