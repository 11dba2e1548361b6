"""The fault corpus of the Ray path (issue 34, marker ``ray_faults``): real jobs on a private CPU
Ray head (``examples/scripts/run.sh tiny_cpu_grpo --submit``: real ``ray job submit``, vLLM CPU
engine, DeepSpeed policy actor), each with a fault injected from outside the job:

* the policy actor's loss goes NaN at step 2 (site/e2e_faults.py multiplies it by NaN);
* the policy actor is killed (SIGKILL, its pid from Ray's state API) in the middle of a
  checkpoint save, then the experiment is resubmitted with ``--ckpt.load_enable``;
* the checkpoint filesystem (a tmpfs we mount, then shrink once step 1's checkpoint is on it)
  fills up during step 2's save.

Each case records one line of what it checked; the run ends with "N of N faults survived, 0
runs lost, 0 silent" (tests/e2e/conftest.py). Not in the README's test command (each job costs
minutes of CPU start-up): ``bash scripts/test.sh -m ray_faults`` (.ci/run runs it second).
Run with ``-n 0`` or ``--dist loadfile``: every job uses the one Ray head of the session.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time

import pytest

import e2e_faults_util as fu
import ray_harness as h

pytestmark = [pytest.mark.ray_faults]

EXPERIMENT = "tiny_cpu_grpo"  # the DeepSpeed actor, no reference model: the cheapest real job


def _job(ray_head, exp, run_dir, *args, extra_env=None, timeout=900.0) -> h.JobResult:
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    r = h.submit(ray_head, exp, "examples/scripts/run.sh", EXPERIMENT, "--submit", "--ckpt.save_steps", "1", *args,
                 run_dir=run_dir, timeout=timeout, extra_env=extra_env)
    with open(run_dir + f".{int(time.time())}.log", "w") as fh:
        fh.write(r.output)
    return r


def _in_background(fn):
    out, err = [], []

    def target():
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001
            err.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, out, err


def _wait_for(pred, what, thread, timeout=600.0, poll=0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        if not thread.is_alive():
            raise AssertionError(f"the job ended before {what}")
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def _tail(output: str, n: int = 60) -> str:
    return "\n".join(output.rstrip().splitlines()[-n:])


# ------------------------------------------------------------------ 5. non-finite loss
def test_nan_loss_stops_the_job_naming_step_and_rank_and_nothing_non_finite_is_latest(ray_head, tiny_experiment,
                                                                                      tmp_path):
    run = str(tmp_path / "nan")
    t0 = time.time()
    r = _job(ray_head, tiny_experiment, run, extra_env={"OPENRLHF_DIV_E2E_FAULT_NAN_LOSS_STEP": "2"})
    took = time.time() - t0
    assert r.returncode != 0 and "succeeded" not in r.output, r.output[-4000:]
    ckpt = os.path.join(run, "ckpt", "_actor")
    fu.expect_named("error: NonFiniteLossError: non-finite loss (nan) at step 2 on rank 0", r.output)
    fu.expect_named(f"Last good checkpoint: {ckpt}/global_step1", r.output)
    assert fu.latest(ckpt) == "global_step1" and not os.path.exists(os.path.join(ckpt, "global_step2"))
    fu.assert_intact_and_finite(os.path.join(ckpt, "global_step1"))
    assert sorted(h.tb_scalars(os.path.join(run, "tb"))["train/rollout/reward_mean"]) == [1]
    fu.record("non-finite loss at step 2", f"job failed in {took:.0f}s naming step 2 + rank 0 + last good "
              "global_step1; latest=global_step1 (verified, finite); no global_step2; step-1 metrics kept")


# ------------------------------------------------------------------ 2. killed during a save
def test_policy_actor_killed_during_a_save_resumes_from_the_previous_checkpoint(ray_head, tiny_experiment, tmp_path):
    run = str(tmp_path / "kill_save")
    ckpt = os.path.join(run, "ckpt", "_actor")
    marker = os.path.join(run, "fault_hold_save.pid")
    # --ckpt.max_num 1: OpenRLHF alone deletes global_step1 before writing global_step2
    t, out, err = _in_background(lambda: _job(ray_head, tiny_experiment, run, "--ckpt.max_num", "1",
                                              extra_env={"OPENRLHF_DIV_E2E_FAULT_HOLD_SAVE_STEP": "2"}))
    _wait_for(lambda: os.path.exists(marker), "the save of global_step2 to start", t)
    pid = fu.actor_pid(ray_head, "PolicyModelActor")
    with open(marker) as fh:
        assert int(fh.read()) == pid  # the process the state API names is the one saving
    os.kill(pid, signal.SIGKILL)
    t.join(timeout=600)
    assert not t.is_alive() and not err, err
    r = out[0]
    assert r.returncode != 0 and "succeeded" not in r.output
    fu.expect_named("ActorDiedError", r.output, n=400)
    fu.expect_last_line(r.output, "error: Ray actor ", "(the policy actor) (pid ", f"resume from {ckpt}/global_step1")
    assert fu.latest(ckpt) == "global_step1"
    fu.assert_intact_and_finite(os.path.join(ckpt, "global_step1"))
    torn = os.path.join(ckpt, "global_step2")
    assert os.path.isdir(torn) and not os.path.exists(os.path.join(torn, "manifest.json"))
    # the same experiment again, resuming
    r2 = _job(ray_head, tiny_experiment, run, "--ckpt.max_num", "1", "--ckpt.load_enable",
              "--logger.tensorboard_dir", os.path.join(run, "tb_resume"))
    assert "succeeded" in r2.output, _tail(r2.output, 200)
    assert f"checkpoint {torn} is incomplete" in r2.output, r2.output[-6000:]
    assert f"loading checkpoint {ckpt}/global_step1" in r2.output
    assert sorted(h.tb_scalars(os.path.join(run, "tb_resume"))["train/rollout/reward_mean"]) == [2]
    assert fu.latest(ckpt) == "global_step2"
    fu.assert_intact_and_finite(os.path.join(ckpt, "global_step2"))
    assert not os.path.exists(os.path.join(ckpt, "global_step1"))  # max_num 1, rotated after the save
    fu.record("policy actor SIGKILLed mid-save", "global_step1 kept (max_num 1) + verified; torn global_step2 named "
              "and skipped on resume; resumed job trained step 2 and finished; new global_step2 verified")


# ------------------------------------------------------------------ 6. no space left
def test_full_disk_during_a_save_keeps_the_previous_checkpoint_and_the_metrics(ray_head, tiny_experiment, tmp_path):
    mnt = str(tmp_path / "disk")
    os.makedirs(mnt)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", mnt],
                                           capture_output=True).returncode != 0:
        pytest.skip("case 6 mounts a small tmpfs: needs root with mount rights")
    try:
        run = str(tmp_path / "full")
        ckpt = os.path.join(mnt, "ckpt", "_actor")
        tb = os.path.join(mnt, "tb")
        t, out, err = _in_background(lambda: _job(ray_head, tiny_experiment, run, "--ckpt.path",
                                                  os.path.join(mnt, "ckpt"), "--logger.tensorboard_dir", tb))
        _wait_for(lambda: os.path.exists(os.path.join(ckpt, "global_step1", "manifest.json")),
                  "global_step1 to be saved", t)
        size = fu.tree_bytes(os.path.join(ckpt, "global_step1"))
        used = shutil.disk_usage(mnt).used
        # the disk fills up: room for half of another checkpoint
        fu.remount_size(mnt, used + size // 2)
        t.join(timeout=600)
        assert not t.is_alive() and not err, err
        r = out[0]
        assert r.returncode != 0 and "succeeded" not in r.output
        fu.expect_named(f"error: CheckpointWriteError: writing checkpoint {ckpt}/global_step2 failed", r.output)
        fu.expect_named("no space left on the device", r.output)
        assert fu.latest(ckpt) == "global_step1" and not os.path.exists(os.path.join(ckpt, "global_step2"))
        fu.assert_intact_and_finite(os.path.join(ckpt, "global_step1"))
        assert sorted(h.tb_scalars(tb)["train/rollout/reward_mean"]) == [1, 2]
        fu.record("disk full during the step-2 save", f"job failed naming {ckpt}/global_step2 and the full disk; "
                  f"global_step1 ({size / 2**20:.1f} MiB) verified + finite and still latest; torn folder removed; "
                  "metrics of steps 1-2 readable")
    finally:
        subprocess.run(["umount", "-l", mnt], capture_output=True)


# ------------------------------------------------------------------ 4. a reward worker hangs / dies
def test_reward_workers_that_hang_or_die_cost_a_failure_reward_and_the_pool_recovers(ray_head, tiny_experiment,
                                                                                     tmp_path):
    """The math reward runs in the vLLM actor's verifier pool (tasks/_pool.py). The controller
    pauses after step 1's rollout (site/e2e_faults.py); then every verifier worker but one is
    stopped (SIGSTOP: hung, as in C code) and the last one is killed (SIGKILL); with a single
    worker it is stopped. Every check sent to a stopped worker must come back as a timeout within
    OPENRLHF_DIV_MATH_TIMEOUT + 1 s (the pool kills the worker and starts a fresh one), a dead
    worker is replaced, and every sample of every step keeps a reward."""
    run = str(tmp_path / "reward")
    # golds written \\sqrt{c*c}: every check goes to math-verify in the pool (plain numbers take a fast path)
    data = fu.verifier_data(tiny_experiment.data, str(tmp_path / "data"))
    env = {"OPENRLHF_DIV_MATH_TIMEOUT": "2", "OPENRLHF_DIV_VERIFIER_WORKERS": "3",
           "OPENRLHF_DIV_E2E_FAULT_HOLD_STEP": "1", "DATA_DIR": data}
    # two episodes (4 steps): checks of (answer, gold) pairs not seen in step 1 reach the pool
    t, out, err = _in_background(lambda: _job(ray_head, tiny_experiment, run, "--train.num_episodes", "2",
                                              extra_env=env))
    go = os.path.join(run, "fault_hold_step.go")
    hung, replaced, gone = [], set(), {}
    try:
        _wait_for(lambda: os.path.exists(os.path.join(run, "fault_hold_step.pid")), "step 1's rollout", t)
        pids = fu.actor_pids(ray_head, "RolloutRayActor")
        assert len(pids) == 1, pids
        vllm = pids[0]
        first = fu.pool_workers(vllm)
        assert first, "no verifier worker under the vLLM actor"
        hung, dead = (first[:-1], first[-1]) if len(first) > 1 else (first, None)
        for pid in hung:
            os.kill(pid, signal.SIGSTOP)
        if dead is not None:
            os.kill(dead, signal.SIGKILL)
        open(go, "w").close()
        while t.is_alive():
            now = fu.pool_workers(vllm) if fu.alive(vllm) else []
            replaced |= set(now) - set(first)
            for pid in hung:
                if pid not in gone and not fu.alive(pid):
                    gone[pid] = time.time()
            time.sleep(0.2)
        t.join()
    finally:
        if t.is_alive():  # failed early: release the pause and stop the job, so the cluster is free
            open(go, "w").close()
            fu.stop_running_jobs(ray_head)
            t.join(timeout=300)
        for pid in hung:  # a stopped worker the pool never used would outlive the job
            if fu.alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not err, err
    r = out[0]
    assert "succeeded" in r.output, _tail(r.output, 200)
    sc = h.tb_scalars(os.path.join(run, "tb"))
    assert sorted(sc["train/rollout/num_samples"]) == [1, 2, 3, 4]
    assert all(v == 16 for v in sc["train/rollout/num_samples"].values()), sc["train/rollout/num_samples"]
    timeouts = sc.get("train/verifier_timeout", {})
    n_timeouts = round(sum(timeouts.values()) * 16)  # per-sample 0/1 flags, averaged over the step's 16 samples
    assert n_timeouts >= 1, timeouts  # a hung worker cost its sample the failure reward, counted in the step
    assert gone, "the pool never killed a hung worker"  # ... and it was killed, not waited for
    assert replaced, "no fresh worker was started"
    fu.record(f"reward workers hung (SIGSTOP x{len(hung)}) and killed (SIGKILL x{int(dead is not None)})",
              f"{n_timeouts} sample(s) scored 0 with verifier_timeout=1 in the step metrics; {len(gone)} hung "
              f"worker(s) killed by the pool, {len(replaced)} fresh worker(s) started; all 4 steps x 16 samples "
              "rewarded; job finished")


# ------------------------------------------------------------------ 3. `ray job stop` mid-step
def _trace(run):
    import json

    p = os.path.join(run, "fault_trace.jsonl")
    return [json.loads(x) for x in open(p)] if os.path.exists(p) else []


#: one D_pef anchor per step: 16 online + 1 anchor samples make one optimizer step (the launcher
#: refuses a partial one)
ONE_ANCHOR = ("--div.anchor_batch_size", "1", "--train.batch_size", "17", "--train.micro_batch_size", "17")


def test_ray_job_stop_mid_step_resumes_with_the_same_prompts_anchors_and_step(ray_head, tiny_experiment, tmp_path):
    """dph_js (D_pef anchors from the pre-sampling stage, shared by the three jobs): an uninterrupted
    run, then a run stopped with ``ray job stop`` during step 2 (its rollout done, its training not:
    the controller pauses there), then that
    run resubmitted with ``--ckpt.load_enable``. The prompts each step trains on (its batch of the
    prompt loader; inside a step samples return in vLLM's completion order), the D_pef
    anchor ids drawn for it and the step numbers must equal the uninterrupted run's.

    One anchor per step (``--div.anchor_batch_size 1``, the config draws 4): with D_pef's K >= 2
    records (8 samples per prompt: several near-perfect prompts) step 2 then draws a record step 1
    did not, so a cursor that restarted on resume (drawing step 1's anchor again) fails the check;
    with 4 anchors and K = 4 each step drew a whole epoch and only the epochs' orders told them
    apart."""
    import sys

    from ray.job_submission import JobSubmissionClient

    pre = str(tmp_path / "presample")
    trace = {"OPENRLHF_DIV_E2E_TRACE": "1"}

    def job(run, *args, env=None):
        os.makedirs(os.path.dirname(run), exist_ok=True)
        r = h.submit(ray_head, tiny_experiment, "examples/scripts/run.sh", "tiny_cpu_dph_js", "--submit",
                     "--ckpt.save_steps", "1", *ONE_ANCHOR, *args, run_dir=run, presample_dir=pre, timeout=900,
                     extra_env={**trace, **(env or {})})
        with open(run + f".{int(time.time())}.log", "w") as fh:
            fh.write(r.output)
        return r

    ref = str(tmp_path / "uninterrupted")
    assert "succeeded" in job(ref).output
    want = _trace(ref)
    assert [t["step"] for t in want] == [1, 2] and [len(t["anchors"]) for t in want] == [1, 1], want
    from openrlhf_div.engines.anchor_data import read_pef

    n_pef = len(read_pef(pre))
    # the check can fail: a cursor restarted on resume would draw step 1's anchor for step 2
    assert want[1]["anchors"] != want[0]["anchors"], (
        f"D_pef has {n_pef} record(s): step 2 drew step 1's anchor again, so the anchor check could not "
        "tell a resumed cursor from a restarted one (needs >= 2 distinct near-perfect records)")

    run = str(tmp_path / "stopped")
    # the controller pauses after step 2's rollout, before its training (site/e2e_faults.py): mid-step
    t, out, err = _in_background(lambda: job(run, env={"OPENRLHF_DIV_E2E_FAULT_HOLD_STEP": "2"}))
    ckpt = os.path.join(run, "ckpt", "_actor")
    _wait_for(lambda: os.path.exists(os.path.join(run, "fault_hold_step.pid")), "step 2's rollout", t)
    client = JobSubmissionClient(ray_head.address)
    running = [j.submission_id for j in client.list_jobs() if str(j.status) in ("RUNNING", "JobStatus.RUNNING")]
    if len(running) != 1:
        open(os.path.join(run, "fault_hold_step.go"), "w").close()
        fu.stop_running_jobs(ray_head)
        raise AssertionError(f"expected one running job, found {running}")
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    stop = subprocess.run([ray_bin, "job", "stop", "--address", ray_head.address, running[0]],
                          capture_output=True, text=True, timeout=120)
    t.join(timeout=300)
    assert not t.is_alive() and not err, err
    assert "succeeded" not in out[0].output and "stopped" in (out[0].output + stop.stdout + stop.stderr).lower()
    got_first = _trace(run)
    assert [x["step"] for x in got_first][:1] == [1] and fu.latest(ckpt) == "global_step1", got_first
    assert not any(x["step"] == 2 for x in got_first), "the stop came after step 2 had finished"

    r = job(run, "--ckpt.load_enable", "--logger.tensorboard_dir", os.path.join(run, "tb_resume"))
    assert "succeeded" in r.output, _tail(r.output, 200)
    got = [x for x in got_first if x["step"] == 1] + [x for x in _trace(run)[len(got_first):]]
    assert [x["step"] for x in got] == [1, 2], got
    for w, g in zip(want, got):
        # the prompt loader's batch (inside a step the samples come back in vLLM's completion order)
        assert sorted(g["prompts"]) == sorted(w["prompts"]), (w["step"], w["prompts"], g["prompts"])
        assert g["anchors"] == w["anchors"], (w["step"], w["anchors"], g["anchors"])
    assert sorted(h.tb_scalars(os.path.join(run, "tb_resume"))["train/rollout/reward_mean"]) == [2]
    fu.record("`ray job stop` during step 2 (dph_js)", "resumed at step 2 with the uninterrupted run's prompts "
              f"({len(want[1]['prompts'])} samples) and D_pef anchor for step 2 (the cursor's 2nd of {n_pef} "
              "records, not step 1's); step 1 identical too; job finished")


# ------------------------------------------------------------------ 1. the vLLM engine process dies
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSEGV"])
def test_vllm_engine_process_dies_job_fails_naming_it_and_resume_finishes(ray_head, tiny_experiment, tmp_path, sig):
    """The vLLM engine's EngineCore process (a child of the RolloutRayActor, found through Ray's
    state API and /proc) gets ``sig`` while the controller pauses after step 2's rollout (step 1's
    checkpoint is saved). The job must fail (no hang: the submit's timeout bounds it) with the
    process and the signal named in its last lines; resubmitted with ``--ckpt.load_enable`` it
    continues from global_step1 and finishes (SIGKILL only: one resume is enough). The controller
    sees only the weight sync's gloo error; the line comes from the vLLM actor that owned the
    process (``trainer._raise_naming_dead_engine``), printed last by the driver."""
    run = str(tmp_path / f"engine_{sig}")
    t, out, err = _in_background(lambda: _job(ray_head, tiny_experiment, run, timeout=600,
                                              extra_env={"OPENRLHF_DIV_E2E_FAULT_HOLD_STEP": "2"}))
    t0 = time.time()
    try:
        _wait_for(lambda: os.path.exists(os.path.join(run, "fault_hold_step.pid")), "step 2's rollout", t)
        (vllm,) = fu.actor_pids(ray_head, "RolloutRayActor")
        engines = fu.named_process(vllm, "EngineCore")
        assert len(engines) == 1, engines
        os.kill(engines[0], getattr(signal, sig))
        t0 = time.time()
    finally:
        open(os.path.join(run, "fault_hold_step.go"), "w").close()
    t.join(timeout=700)
    assert not t.is_alive() and not err, err
    r = out[0]
    took = time.time() - t0
    assert r.returncode != 0 and "succeeded" not in r.output
    ckpt = os.path.join(run, "ckpt", "_actor")
    assert fu.latest(ckpt) == "global_step1"
    fu.assert_intact_and_finite(os.path.join(ckpt, "global_step1"))
    if sig == "SIGKILL":
        r2 = _job(ray_head, tiny_experiment, run, "--ckpt.load_enable", "--logger.tensorboard_dir",
                  os.path.join(run, "tb_resume"))
        assert "succeeded" in r2.output, _tail(r2.output, 200)
        assert sorted(h.tb_scalars(os.path.join(run, "tb_resume"))["train/rollout/reward_mean"]) == [2]
    # the job's last line: the process (the pid we signalled), the signal and what to try
    advice = {"SIGKILL": "out-of-memory killer", "SIGSEGV": "try rollout.vllm_enforce_eager=true"}[sig]
    last = fu.expect_last_line(r.output, "error: vLLM engine process EngineCore", f"(pid {engines[0]}) died from {sig}: ",
                               advice)
    fu.record(f"vLLM EngineCore {sig} after step 2's rollout", f"job failed {took:.0f}s after the signal; its last "
              f"line: {last[:60]}...; global_step1 intact" + ("; resumed job redid step 2 and finished"
                                                              if sig == "SIGKILL" else ""))


# ------------------------------------------------------------------ the controller dies
def test_controller_killed_mid_step_keeps_every_logged_step_and_resumes(ray_head, tiny_experiment, tmp_path):
    """The controller (openrlhf-div's PPOTrainer actor: the step loop, TensorBoard's writer and
    metrics.jsonl) gets SIGKILL while it holds after step 2's rollout: step 1 is trained, logged and
    checkpointed. What step 1 logged must be on disk: TensorBoard's SummaryWriter keeps events in a
    file buffer and flushes every 120 s (``flush_secs``) unless the trainer flushes after each step
    (``trainer.save_logs_and_checkpoints``); a killed process never flushes. The job fails with one
    line naming the controller, its pid and the checkpoint to resume from; resubmitted with
    ``--ckpt.load_enable`` it trains step 2 and finishes."""
    import json

    run = str(tmp_path / "controller")
    marker = os.path.join(run, "fault_hold_step.pid")
    t, out, err = _in_background(lambda: _job(ray_head, tiny_experiment, run, timeout=600,
                                              extra_env={"OPENRLHF_DIV_E2E_FAULT_HOLD_STEP": "2"}))
    try:
        _wait_for(lambda: os.path.exists(marker), "step 2's rollout", t)
        with open(marker) as fh:
            pid = int(fh.read())
        assert fu.actor_pids(ray_head, "PPOTrainer") == [pid]  # the holding process is the controller
        os.kill(pid, signal.SIGKILL)
        t0 = time.time()
    finally:
        open(os.path.join(run, "fault_hold_step.go"), "w").close()
    t.join(timeout=700)
    assert not t.is_alive() and not err, err
    r, took = out[0], time.time() - t0
    assert r.returncode != 0 and "succeeded" not in r.output
    ckpt = os.path.join(run, "ckpt", "_actor")
    last = fu.expect_last_line(r.output, "error: Ray actor ", "(the controller) (pid " + str(pid),
                               f"resume from {ckpt}/global_step1: submit the same experiment again with "
                               "--ckpt.load_enable")
    with open(os.path.join(run, "error.txt")) as fh:  # the cause stays with the run folder
        assert fh.read().startswith("error: Ray actor _DivPPOTrainer (the controller)")
    # step 1's figures are on disk although the process that wrote them was killed
    logged = h.tb_scalars(os.path.join(run, "tb"))
    assert sorted(logged.get("train/rollout/reward_mean", {})) == [1], sorted(logged)
    with open(os.path.join(run, "metrics.jsonl")) as fh:
        assert [json.loads(x)["step"] for x in fh if x.strip()] == [1]
    assert fu.latest(ckpt) == "global_step1"
    fu.assert_intact_and_finite(os.path.join(ckpt, "global_step1"))
    r2 = _job(ray_head, tiny_experiment, run, "--ckpt.load_enable", "--logger.tensorboard_dir",
              os.path.join(run, "tb_resume"))
    assert "succeeded" in r2.output, _tail(r2.output, 200)
    assert sorted(h.tb_scalars(os.path.join(run, "tb_resume"))["train/rollout/reward_mean"]) == [2]
    assert not os.path.exists(os.path.join(run, "error.txt"))  # the resumed run's own: none
    fu.record("controller SIGKILLed after step 2's rollout", f"job failed {took:.0f}s after the signal; its last "
              f"line: {last[:60]}...; step 1 in TensorBoard and metrics.jsonl, global_step1 intact; resumed job "
              "trained step 2 and finished")
