"""Issue 43 item 5: Ctrl-C (or SIGTERM under a private cluster) on the Ray driver ends in one line
-- what was stopped, the run folder, how to resume from the last checkpoint if one was saved --
with no traceback, exit status 130, and the run folder marked incomplete (``INCOMPLETE``).
Ray itself is not started: the driver's ``run`` is replaced by one that writes the run folder
(as the real one does first) and then waits, and the signal goes to that process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = os.path.join(ROOT, "configs", "openrlhf", "tiny_cpu_grpo.yaml")

DRIVER = textwrap.dedent("""
    import os, sys, time
    from openrlhf_div.engines.openrlhf import launch as L
    from openrlhf_div.engines.openrlhf.runfolder import write_driver_files

    def fake_run(p):
        write_driver_files(p, p.experiment)
        if os.environ.get("WITH_CKPT"):
            save = os.path.join(p.args.ckpt.path, "_actor")
            os.makedirs(os.path.join(save, "global_step2"))
            open(os.path.join(save, "latest"), "w").write("global_step2")
        print("READY", flush=True)
        time.sleep(120)

    L.run = fake_run
    sys.exit(L.main(["--config", sys.argv[1]]))
""")


def _interrupted_driver(tmp_path, with_ckpt: bool):
    run = tmp_path / "run"
    env = dict(os.environ, RUN_DIR=str(run), PYTHONPATH=ROOT, PYTHONUTF8="1")
    env.pop("WITH_CKPT", None)
    if with_ckpt:
        env["WITH_CKPT"] = "1"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, CFG], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    while line and "READY" not in line:
        line = proc.stdout.readline()
    assert "READY" in line, proc.stderr.read()[-3000:]
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
    out, err = proc.communicate(timeout=120)
    return proc.returncode, err, run


def test_ctrl_c_with_a_checkpoint_names_the_folder_and_how_to_resume(tmp_path):
    rc, err, run = _interrupted_driver(tmp_path, with_ckpt=True)
    assert rc == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"stopped (Ctrl-C): training grpo, run folder {run} (marked incomplete: INCOMPLETE); "
                           f"resume from its last checkpoint {run}/ckpt/_actor/global_step2: the same command "
                           f"with RUN_DIR={run} and --ckpt.load_enable"), last
    assert "Ctrl-C" in (run / "INCOMPLETE").read_text()


def test_ctrl_c_before_a_checkpoint_says_it_starts_again(tmp_path):
    rc, err, run = _interrupted_driver(tmp_path, with_ckpt=False)
    assert rc == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].endswith("no checkpoint was saved yet: the same command starts it again")
    assert (run / "INCOMPLETE").exists()


def test_a_resumed_run_clears_the_mark(tmp_path, monkeypatch):
    from openrlhf_div.engines.openrlhf import launch as L
    from openrlhf_div.engines.openrlhf.runfolder import write_driver_files

    monkeypatch.setenv("RUN_DIR", str(tmp_path / "run"))
    p = L.plan(["--config", CFG])
    write_driver_files(p, p.experiment)
    (tmp_path / "run" / "INCOMPLETE").write_text("stopped\n")
    write_driver_files(p, p.experiment)  # the same folder again (a resume)
    assert not (tmp_path / "run" / "INCOMPLETE").exists()



def test_a_stopped_submit_names_the_run_folder_and_marks_it(tmp_path):
    """The launcher's INT / TERM trap under --submit (examples/scripts/_common.sh stopped_job): the
    same line as the driver's, the folder marked; tests/e2e/test_laptop_path.py sends the real SIGTERM."""
    run = tmp_path / "run"
    (run / "ckpt" / "_actor").mkdir(parents=True)
    (run / "ckpt" / "_actor" / "latest").write_text("global_step2\n")
    script = f'source {ROOT}/examples/scripts/_common.sh; RUN_DIR={run}; stopped_job Ctrl-C'
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHON=sys.executable))
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == (f"[openrlhf-div] stopped (Ctrl-C): the job and its Ray head; run folder {run} (marked "
                                f"incomplete: INCOMPLETE); resume from its last checkpoint {run}/ckpt/_actor/global_step2: "
                                f"the same command with RUN_DIR={run} and --ckpt.load_enable"), r.stderr
    assert (run / "INCOMPLETE").read_text().startswith("stopped by Ctrl-C")
