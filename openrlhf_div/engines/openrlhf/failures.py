"""Failure naming: an exception (or a stop) of a Ray run turned into the one line a user reads last.

* :func:`named_fault`: a fault of :mod:`.checkpoints` (non-finite loss / weights, a failed or
  damaged checkpoint), found anywhere in the exception's chain (:func:`exception_chain`: a
  ``RayTaskError``'s cause, ``__cause__``, ``__context__``).
* :func:`dead_actor_line`: a Ray actor of the run whose process died (``ActorDiedError``).
* :func:`_exit_naming`: the driver's end on one of those, or on a dead vLLM engine process
  (:func:`openrlhf_div.compat.engine_death.explain`, which stays in ``compat``: vLLM's own
  processes install it through the vLLM plugin, and the local CLI reads it too).
* :func:`stopped`: a run stopped by Ctrl-C / SIGTERM (its run folder marked incomplete).

A node lost mid-run is named by the watchdog that sees it (:mod:`.nodes`, ``lost_node_message``).
"""
from __future__ import annotations

import os
import sys
from typing import Optional


#: the exit code of a job whose Ray actor died (4: a dead vLLM engine process, nodes.LOST_NODE_EXIT: a lost node)
DEAD_ACTOR_EXIT = 5

#: what each of the run's Ray actor classes is, for the dead-actor line (a substring of the class name)
ACTOR_ROLES = (("PPOTrainer", "the controller"), ("PolicyModelActor", "the policy actor"),
               ("ReferenceModelActor", "the reference actor"), ("Rollout", "a vLLM rollout actor"),
               ("LLMRayActor", "a vLLM rollout actor"), ("Megatron", "a Megatron policy rank"))


def dead_actor_line(exc: BaseException, ckpt_path: Optional[str] = None) -> Optional[str]:
    """One line for a Ray actor of the run whose process died (SIGKILL from the OOM killer or a
    user, a crash, a preempted node): Ray's ``ActorDiedError`` anywhere in ``exc``'s chain (the
    controller's own, or one a controller task raised), its class, role, pid, node, Ray's exit
    detail, and where the run resumes (``latest`` of ``ckpt_path``/_actor). ``None``: not that."""
    try:
        from ray.exceptions import ActorDiedError
    except ImportError:  # pragma: no cover - Ray is a dependency of this engine
        return None
    # the controller's own death arrives as ActorDiedError; an actor dying under a controller task
    # arrives as that task's RayTaskError, whose cause Ray replaced by the traceback's text
    # (ActorDiedError holds a protobuf and does not pickle): "...ActorDiedError: ...\n\tclass_name: X"
    text = None
    for e in exception_chain(exc):
        if isinstance(e, ActorDiedError):
            text = str(e)
            break
        s = str(e)
        at = s.rfind("ActorDiedError: ")
        if at >= 0 and "class_name: " in s[at:]:
            text = s[at:]
            break
    if text is None:
        return None
    import re

    def field(name):
        m = re.search(rf"^\s*{name}: (\S+)", text, re.M)
        return m.group(1) if m else None

    cls, pid, ip = field("class_name"), field("pid"), field("ip")
    role = next((r for part, r in ACTOR_ROLES if cls and part in cls), None)
    m = re.search(r"Worker exit detail: ([^\n]*?)(?:\s*(?:There are some potential root causes|Some common causes include)|\n|$)", text)
    detail = " ".join((m.group(1) if m else text.strip().splitlines()[0]).split()).rstrip(".")
    who = f"Ray actor {cls or '?'}" + (f" ({role})" if role else "")
    where = ", ".join(x for x in (f"pid {pid}" if pid else "", f"node {ip}" if ip else "") if x)
    line = f"{who}{f' ({where})' if where else ''} died: {detail}"
    if "connection error" in detail or "SIGKILL" in detail or "killed" in detail.lower():
        line += " (its process was killed: the OOM killer, a signal, a forced `ray stop`, or a crash)"
    if ckpt_path:
        from .checkpoints import read_latest

        save_dir = os.path.join(ckpt_path, "_actor")
        tag = read_latest(save_dir)
        line += (f"; resume from {save_dir}/{tag}: submit the same experiment again with --ckpt.load_enable"
                 if tag else f"; no checkpoint in {save_dir} yet: the run starts again from the beginning")
    return line


def _exit_naming(exc: BaseException, args=None) -> None:
    """A fault of :mod:`.checkpoints` (non-finite loss / weights, a failed or damaged checkpoint),
    a dead vLLM engine process (:mod:`openrlhf_div.compat.engine_death`) or a dead Ray actor
    (:func:`dead_actor_line`) ends the job with its traceback, then one line naming it, last:
    ``SystemExit(1)`` (a dead engine: ``SystemExit(4)``, the code of the CLI's engine line; a dead
    actor: ``SystemExit(5)``)."""
    from openrlhf_div.compat.engine_death import explain

    line, code = named_fault(exc), 1
    if line is None:
        line, code = explain(exc), 4
    if line is None:
        ckpt = getattr(getattr(args, "ckpt", None), "path", None)
        line, code = dead_actor_line(exc, ckpt if isinstance(ckpt, str) and ckpt else None), DEAD_ACTOR_EXIT
    if line is None:
        return
    if args is not None:
        from .runfolder import record_failure

        record_failure(args, f"error: {line}")
    import traceback

    traceback.print_exc()
    try:  # the actors' shutdown chatter would otherwise stream in after the line below
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except Exception:  # noqa: BLE001
        pass
    sys.stdout.flush()
    print(f"error: {line}", file=sys.stderr, flush=True)
    raise SystemExit(code)


#: a run folder whose run was stopped before its end holds this file (its one line: what, when, how to resume)
INCOMPLETE_FILE = "INCOMPLETE"
#: the exit status of a run stopped by Ctrl-C / SIGTERM (the shell's 128 + SIGINT)
STOPPED_EXIT = 130


def stopped(args, how: str, what: str = "the run") -> int:
    """A run stopped by the user (Ctrl-C, SIGTERM): its run folder marked incomplete
    (:data:`INCOMPLETE_FILE`), Ray shut down, and one line, the driver's last: what was stopped,
    the run folder, and how to resume from the last checkpoint (if one was saved). Returns
    :data:`STOPPED_EXIT`."""
    import time

    from .checkpoints import read_latest
    from .runfolder import run_dir_of

    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()  # before the line, so that the actors' shutdown chatter does not follow it
    except BaseException:  # noqa: BLE001 - a second Ctrl-C during the shutdown: the line still comes
        pass
    ckpt = getattr(getattr(args, "ckpt", None), "path", None)
    save_dir = os.path.join(ckpt, "_actor") if isinstance(ckpt, str) and ckpt else None
    tag = read_latest(save_dir) if save_dir else None
    run_dir = run_dir_of(args)
    if tag:
        resume = (f"resume from its last checkpoint {save_dir}/{tag}: the same command with RUN_DIR={run_dir} "
                  "and --ckpt.load_enable")
    else:
        resume = "no checkpoint was saved yet: the same command starts it again"
    if os.path.isdir(run_dir):
        where = f"run folder {run_dir} (marked incomplete: {INCOMPLETE_FILE})"
        try:
            from openrlhf_div.io import atomic_write_text

            atomic_write_text(os.path.join(run_dir, INCOMPLETE_FILE),
                              f"stopped by {how} at {time.strftime('%Y-%m-%d %H:%M:%S')}; {resume}\n")
        except OSError:
            pass
    else:
        where = f"before its run folder {run_dir} was written"
    print(f"stopped ({how}): {what}, {where}; {resume}", file=sys.stderr, flush=True)
    return STOPPED_EXIT


#: the errors of :mod:`.checkpoints` that :func:`named_fault` names (by class name: no import of torch here)
_NAMED = ("CheckpointWriteError", "NonFiniteLossError", "NonFiniteWeightsError", "CorruptCheckpointError")


def exception_chain(exc: BaseException):
    """``exc`` and every exception behind it, once each: a ``RayTaskError``'s original (Ray keeps it
    as ``cause``), ``__cause__`` and ``__context__``."""
    seen = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        cause = getattr(e, "cause", None)  # ray.exceptions.RayTaskError keeps the original here
        stack += [cause if isinstance(cause, BaseException) else None, e.__cause__, e.__context__]


def named_fault(exc: BaseException) -> Optional[str]:
    """``"<Error>: <message>"`` when ``exc`` (a ``RayTaskError`` from an actor, its cause, or
    anything in its ``__cause__`` / ``__context__`` chain) is one of :mod:`.checkpoints`' errors."""
    for e in exception_chain(exc):
        names = [c.__name__ for c in type(e).__mro__]
        hit = next((n for n in _NAMED if n in names), None)
        if hit and not isinstance(getattr(e, "cause", None), BaseException):
            return f"{hit}: {str(e).strip().splitlines()[-1] if 'Traceback' in str(e) else str(e).strip()}"
    return None
