"""Issue 34: the Ray policy actor's checkpoint order (engines/openrlhf/checkpoints.py) in one process.

The strategy here stands in for OpenRLHF's ``DeepspeedStrategy.save_ckpt`` the way DeepSpeed
behaves: the tag's files first, ``latest`` last and only with ``save_latest=True``, OpenRLHF's
rotation *before* the write. The real actor and DeepSpeed run in tests/e2e/test_ray_faults.py.
"""
import errno
import os

import pytest
import torch

from openrlhf_div.engines.openrlhf.checkpoints import (
    CheckpointWriteError,
    CorruptCheckpointError,
    NonFiniteLossError,
    NonFiniteWeightsError,
    check_finite_scalar,
    read_latest,
    resolve_resume_tag,
    save_actor_checkpoint,
    step_tags,
)
from openrlhf_div.engines.openrlhf.failures import named_fault


class DSLikeStrategy:
    """save_ckpt like OpenRLHF 0.11.2 + DeepSpeed: rotate first, files, then `latest`."""

    def __init__(self):
        self.fail_after_bytes = None  # raise ENOSPC once this many bytes were written in one save
        self.calls = []

    def is_rank_0(self):
        return True

    def save_ckpt(self, model, save_dir, tag, max_num=3, max_mem=1000, client_state=None, save_latest=True,
                  metric_value=None, metric_key=None):
        self.calls.append(dict(max_num=max_num, max_mem=max_mem, save_latest=save_latest))
        os.makedirs(save_dir, exist_ok=True)
        while len(step_tags(save_dir)) - max_num + 1 > 0:  # OpenRLHF's rotation, before the write
            import shutil

            shutil.rmtree(os.path.join(save_dir, step_tags(save_dir)[0][1]))
        path = os.path.join(save_dir, tag)
        os.makedirs(path, exist_ok=True)
        written = 0
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            data = (name * 100).encode()
            with open(os.path.join(path, name), "wb") as fh:
                if self.fail_after_bytes is not None and written + len(data) > self.fail_after_bytes:
                    fh.write(data[: self.fail_after_bytes - written])
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(path, name))
                fh.write(data)
                written += len(data)
        if save_latest:
            with open(os.path.join(save_dir, "latest"), "w") as fh:
                fh.write(tag)


def _save(strategy, d, step, **kw):
    kw.setdefault("max_num", 3)
    kw.setdefault("max_mem", 1000)
    return save_actor_checkpoint(strategy, None, str(d), f"global_step{step}", step=step, **kw)


def test_latest_moves_only_after_the_manifest_and_rotation_runs_after_the_save(tmp_path):
    st = DSLikeStrategy()
    for step in (1, 2, 3):
        _save(st, tmp_path, step, max_num=2)
    assert [t for _, t in step_tags(str(tmp_path))] == ["global_step2", "global_step3"]
    assert read_latest(str(tmp_path)) == "global_step3"
    assert os.path.exists(tmp_path / "global_step3" / "manifest.json")
    # DeepSpeed was asked for no `latest` and no rotation of its own
    assert all(c["save_latest"] is False and c["max_num"] > 10**6 for c in st.calls)


def test_full_disk_during_a_save_keeps_the_previous_checkpoint_even_with_max_num_1(tmp_path):
    st = DSLikeStrategy()
    _save(st, tmp_path, 1, max_num=1)
    st.fail_after_bytes = 2000
    with pytest.raises(CheckpointWriteError) as ei:
        _save(st, tmp_path, 2, max_num=1)
    msg = str(ei.value)
    assert str(tmp_path / "global_step2") in msg and "No space left on device" in msg and "MiB free" in msg
    assert str(tmp_path / "global_step1") in msg and "`latest` still names it" in msg
    assert read_latest(str(tmp_path)) == "global_step1"
    assert not (tmp_path / "global_step2").exists()  # the torn folder is gone
    assert resolve_resume_tag(str(tmp_path), say=lambda m: None) == "global_step1"


def test_non_finite_weights_are_never_written(tmp_path):
    st = DSLikeStrategy()
    _save(st, tmp_path, 1)
    params = [torch.ones(3), torch.tensor([1.0, float("nan")])]
    with pytest.raises(NonFiniteWeightsError, match=r"1 values\) at step 2 on rank 0.*global_step2 was not written"
                       r".*Last good checkpoint: .*global_step1"):
        _save(st, tmp_path, 2, params=params)
    assert read_latest(str(tmp_path)) == "global_step1" and not (tmp_path / "global_step2").exists()


def test_resume_skips_a_damaged_latest_and_names_it(tmp_path):
    st = DSLikeStrategy()
    _save(st, tmp_path, 1)
    _save(st, tmp_path, 2)
    victim = tmp_path / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:10])  # truncated
    said = []
    assert resolve_resume_tag(str(tmp_path), say=said.append) == "global_step1"
    assert any(str(victim) in s and "truncated" in s for s in said), said
    assert read_latest(str(tmp_path)) == "global_step1"


def test_resume_names_and_removes_an_interrupted_newer_save(tmp_path):
    st = DSLikeStrategy()
    _save(st, tmp_path, 1)
    os.makedirs(tmp_path / "global_step2")
    (tmp_path / "global_step2" / "mp_rank_00_model_states.pt").write_bytes(b"half")
    said = []
    assert resolve_resume_tag(str(tmp_path), say=said.append) == "global_step1"
    assert any("global_step2 is incomplete" in s for s in said), said
    assert not (tmp_path / "global_step2").exists()


def test_resume_of_a_plain_openrlhf_checkpoint_loads_unverified_and_none_intact_is_an_error(tmp_path):
    st = DSLikeStrategy()
    st.save_ckpt(None, str(tmp_path), "global_step1")  # upstream: no manifest, `latest` by DeepSpeed
    said = []
    assert resolve_resume_tag(str(tmp_path), say=said.append) == "global_step1"
    assert any("unverified" in s for s in said)
    assert resolve_resume_tag(str(tmp_path / "nothing")) is None
    _save(st, tmp_path, 2)
    (tmp_path / "global_step2" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    os.remove(tmp_path / "global_step1" / "mp_rank_00_model_states.pt")
    (tmp_path / "global_step1" / "manifest.json").write_text("{")  # damaged too
    with pytest.raises(CorruptCheckpointError, match="no intact checkpoint"):
        resolve_resume_tag(str(tmp_path), say=lambda m: None)


def test_non_finite_scalar_names_step_and_rank_and_the_job_line_finds_it_in_a_chain():
    check_finite_scalar(torch.tensor(1.5), "loss", 3, None)
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss \(nan\) at step 3 on rank 0.*Last good checkpoint: "
                                                 r"/c/global_step2"):
        check_finite_scalar(torch.tensor(float("nan")), "loss", 3, "/c/global_step2")

    class RayTaskErrorLike(RuntimeError):  # what ray.get raises: the actor's error in .cause
        def __init__(self, cause):
            super().__init__("Traceback ...\n" + str(cause))
            self.cause = cause

    try:
        check_finite_scalar(float("inf"), "gradient norm", 2, None, rank=1)
    except NonFiniteLossError as e:
        line = named_fault(RayTaskErrorLike(e))
    assert line.startswith("NonFiniteLossError: non-finite gradient norm (inf) at step 2 on rank 1"), line
    assert named_fault(ValueError("other")) is None


def test_best_eval_checkpoints_go_through_the_same_writer_and_are_never_rotated_away(tmp_path):
    st = DSLikeStrategy()
    _save(st, tmp_path, 1, max_num=1)
    save_actor_checkpoint(st, None, str(tmp_path), "best_global_step1", step=1, max_num=1, max_mem=1000)
    assert read_latest(str(tmp_path)) == "best_global_step1"
    _save(st, tmp_path, 2, max_num=1)
    _save(st, tmp_path, 3, max_num=1)
    assert [t for _, t in step_tags(str(tmp_path))] == ["best_global_step1", "global_step3"]
    assert resolve_resume_tag(str(tmp_path), say=lambda m: None) == "global_step3"


def test_presample_settings_name_a_reward_file_by_content_not_by_rays_upload_path(tmp_path):
    """A resubmitted DPH job found "different settings (reward)" after any edit of the repository:
    the reward file's path lies in Ray's per-upload copy of the working directory."""
    from openrlhf_div.engines.openrlhf.presample import reward_identity

    a, b = tmp_path / "_ray_pkg_1" / "math.py", tmp_path / "_ray_pkg_2" / "math.py"
    for p in (a, b):
        p.parent.mkdir()
        p.write_text("def reward_func(q, p, l): ...\n")
    assert reward_identity(str(a)) == reward_identity(str(b)) != reward_identity("http://rm:5000/get_reward")
    b.write_text("def reward_func(q, p, l): return 1\n")
    assert reward_identity(str(a)) != reward_identity(str(b))


def _actor_died(class_name: str, pid: int, detail: str):
    """Ray's own ActorDiedError as its core worker builds it for a dead actor process (the
    ActorDiedErrorContext protobuf Ray fills in, the exit detail text Ray 2.55 writes)."""
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError

    ctx = ActorDiedErrorContext(class_name=class_name, actor_id=b"\x01" * 16, pid=pid, node_ip_address="10.0.0.7",
                                error_message="The actor is dead because its worker process has died. Worker exit "
                                f"type: SYSTEM_ERROR Worker exit detail: {detail} Some common causes include: (1) "
                                "the process was killed by the OOM killer due to high memory usage, (2) ray stop "
                                "--force was called, or (3) the worker crashed unexpectedly due to SIGSEGV or "
                                "another unexpected error.")
    return ActorDiedError(ctx)


def test_a_dead_ray_actor_is_named_with_its_role_and_where_the_run_resumes(tmp_path):
    """The driver's last line when an actor of the run died (tests/e2e/test_ray_faults.py kills the
    controller and the policy actor): class, role, pid, node, Ray's exit detail, and the checkpoint
    ``latest`` names, found also inside a task error of the controller (Ray's RayTaskError)."""
    from ray.exceptions import RayTaskError

    from openrlhf_div.engines.openrlhf.launch import dead_actor_line

    detail = "Worker unexpectedly exits with a connection error code 2. End of file."
    exc = _actor_died("_DivPPOTrainer", 4242, detail)
    ckpt = tmp_path / "ckpt"
    line = dead_actor_line(exc, str(ckpt))
    assert "Some common causes" not in line, line  # Ray's own list, replaced by one parenthesis
    assert line.startswith("Ray actor _DivPPOTrainer (the controller) (pid 4242, node 10.0.0.7) died: Worker "
                           "unexpectedly exits with a connection error code 2. End of file (its process was killed"), line
    assert line.endswith(f"no checkpoint in {ckpt}/_actor yet: the run starts again from the beginning"), line
    (ckpt / "_actor").mkdir(parents=True)
    (ckpt / "_actor" / "latest").write_text("global_step1")
    import traceback

    inner = _actor_died("DivPolicyModelActor", 77, detail)
    # as Ray's worker builds it for the controller's failed task: the cause does not pickle, so Ray
    # keeps only the traceback's text
    wrapped = RayTaskError("fit", "".join(traceback.format_exception(inner)), inner, proctitle="ray::_DivPPOTrainer.fit")
    assert not isinstance(wrapped.cause, type(inner))
    line = dead_actor_line(wrapped, str(ckpt))
    assert "Ray actor DivPolicyModelActor (the policy actor) (pid 77, node 10.0.0.7)" in line, line
    assert line.endswith(f"resume from {ckpt}/_actor/global_step1: submit the same experiment again with "
                         "--ckpt.load_enable"), line
    assert dead_actor_line(ValueError("other"), str(ckpt)) is None
