"""Helpers of the Ray fault corpus (test_ray_faults.py): what a case checks on disk, the Ray
state API look-up of a process to kill, the tmpfs that fills up, and the one-line records."""
from __future__ import annotations

import os
import subprocess
from typing import List

#: one line per case, printed at the end of the run (conftest.pytest_terminal_summary)
RECORDS: List[str] = []
#: cases whose previous checkpoint was gone or damaged (a run lost) / whose job ended without naming why
COUNTS = {"lost": [], "silent": []}  # the test ids (PYTEST_CURRENT_TEST) of each


def _current() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]


def record(fault: str, checked: str) -> None:
    RECORDS.append(f"survived: {fault}: {checked}")


def latest(ckpt_dir: str):
    try:
        with open(os.path.join(ckpt_dir, "latest")) as fh:
            return fh.read().strip()
    except OSError:
        return None


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(path) for f in fs)


def assert_intact_and_finite(tag_dir: str) -> None:
    """The checkpoint verifies against its manifest and its weights are finite (loadable)."""
    import torch

    from openrlhf_div.engines.local.checkpoint import verify_checkpoint

    try:
        assert verify_checkpoint(tag_dir), f"{tag_dir}: no manifest"
        states = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), map_location="cpu",
                            weights_only=False)
        module = states["module"]
        assert module and all(torch.isfinite(v).all() for v in module.values() if torch.is_tensor(v)), tag_dir
    except BaseException:
        COUNTS["lost"].append(_current())
        raise


def expect_named(text: str, output: str, n: int = 60) -> None:
    """``text`` is among the last ``n`` lines of the job's output (the cause is named there)."""
    tail = "\n".join(output.rstrip().splitlines()[-n:])
    if text not in tail:
        COUNTS["silent"].append(_current())
        raise AssertionError(f"{text!r} is not in the last {n} lines of the job's output:\n{tail}")


def expect_last_line(output: str, *parts: str) -> str:
    """The job's last line (run.sh's ``run folder:`` line aside) holds every one of ``parts``."""
    lines = [x for x in output.rstrip().splitlines() if x.strip() and "[openrlhf-div] run folder:" not in x]
    last = lines[-1] if lines else ""
    if not all(p in last for p in parts):
        COUNTS["silent"].append(_current())
        raise AssertionError(f"the job's last line does not name {parts!r}:\n" + "\n".join(lines[-30:]))
    return last


def actor_pid(head, class_part: str) -> int:
    """The pid of the one live actor whose class name contains ``class_part`` (Ray's state API)."""
    from ray.util.state import list_actors

    actors = [a for a in list_actors(address=head.address, filters=[("state", "=", "ALIVE")], detail=True)
              if class_part in (a.class_name or "")]
    assert len(actors) == 1, [(a.class_name, a.pid) for a in actors]
    return int(actors[0].pid)


def remount_size(mnt: str, size_bytes: int) -> None:
    kib = max(4, (size_bytes + 4095) // 4096 * 4)
    subprocess.run(["mount", "-o", f"remount,size={kib}k", mnt], check=True, capture_output=True)


def actor_pids(head, class_part: str) -> List[int]:
    """The pids of the live actors whose class name contains ``class_part`` (Ray's state API)."""
    from ray.util.state import list_actors

    return [int(a.pid) for a in list_actors(address=head.address, filters=[("state", "=", "ALIVE")], detail=True)
            if class_part in (a.class_name or "") and a.pid]


def _children() -> dict:
    out: dict = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(p))
    return out


def pool_workers(actor_pid: int) -> List[int]:
    """The reward worker processes of an actor: the children of its multiprocessing fork server
    (openrlhf_div.tasks._pool starts its verifier workers from one)."""
    kids = _children()
    out = []
    for c in kids.get(actor_pid, []):
        try:
            with open(f"/proc/{c}/cmdline", "rb") as fh:
                cmd = fh.read().decode(errors="replace")
        except OSError:
            continue
        if "forkserver" in cmd:
            out += kids.get(c, [])
    return sorted(out)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> List[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def named_process(root_pid: int, name: str) -> List[int]:
    """Descendants of ``root_pid`` whose command line or process name contains ``name``."""
    out = []
    for p in descendants(root_pid):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as fh:
                cmd = fh.read().decode(errors="replace")
            with open(f"/proc/{p}/comm") as fh:
                comm = fh.read()
        except OSError:
            continue
        if name in cmd or name in comm:
            out.append(p)
    return out


def stop_running_jobs(head) -> None:
    """Stop every running job of ``head`` (a case that failed early must not hold the cluster)."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(head.address)
    for j in client.list_jobs():
        if str(j.status).endswith("RUNNING") or str(j.status).endswith("PENDING"):
            client.stop_job(j.submission_id)


def verifier_data(src_jsonl: str, out_dir: str) -> str:
    """The tiny data set with each gold answer ``c`` written ``\\sqrt{c*c}``: math-verify says a bare
    ``c`` equals it, but the math task's exact fast paths (plain numbers, integer powers) do not
    decide it, so every check reaches the verifier pool (tasks/math.py ``quick_equal``)."""
    import json

    os.makedirs(out_dir, exist_ok=True)
    with open(src_jsonl) as fh, open(os.path.join(out_dir, "train.jsonl"), "w") as out:
        for line in fh:
            row = json.loads(line)
            row["answer"] = f"\\sqrt{{{int(row['answer']) ** 2}}}"
            out.write(json.dumps(row) + "\n")
    return out_dir
