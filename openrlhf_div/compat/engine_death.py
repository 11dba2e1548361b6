"""Name a dead vLLM engine process in one line: which process, which signal or exit code, the likely
cause and what to try (issue 29).

When vLLM's EngineCore process dies, the front end raises ``EngineDeadError`` ("EngineCore
encountered an issue. See stack trace (above) for the root cause.") from every pending call, and a
Ray job's log fills with copies of it while the cause -- a signal -- is printed nowhere. vLLM knows
the exit code (``CoreEngineProcManager.processes``) but does not say it.

Our vLLM plugin (:mod:`openrlhf_div.compat.vllm_plugin`) calls :func:`install` in every vLLM
process: it remembers every engine-core process manager built there and makes each
``EngineDeadError`` built afterwards carry the line of :func:`dead_engine_lines` in its message. So
the line travels with the exception: through a Ray actor to the job's driver as well as to the
local trainer. :func:`explain` turns any exception into that one line (or ``None`` when no engine
death is involved); the CLI and the Ray driver print it last.
"""
from __future__ import annotations

import signal
import weakref
from typing import List, Optional

__all__ = ["explain", "dead_engine_lines", "describe_exit", "install", "MARK", "remote_dead_engine_lines"]

#: the bracket our line travels in, inside an exception message
MARK = "[openrlhf-div: "
#: vLLM's engine-core process managers built in this process (alive or not)
_MANAGERS: "weakref.WeakSet" = weakref.WeakSet()
#: every line :func:`dead_engine_lines` found in this process (vLLM drops a dead engine's manager
#: during its shutdown; the line must outlive it for a later :func:`remote_dead_engine_lines`)
_SEEN: List[str] = []

_ADVICE = {
    "SIGILL": ("illegal instruction: a CPU kernel used an instruction this process may not run - on an "
               "Intel CPU with AMX, the AMX permission was not requested (is openrlhf-div installed in this "
               "environment, so that vLLM loads its 'openrlhf_div' plugin? VLLM_PLUGINS must not leave it "
               "out) - or the vLLM build is for another CPU; try model dtype float32 (vLLM's vec kernels)"),
    "SIGKILL": ("killed from outside, most often by the out-of-memory killer (see dmesg); lower "
                "VLLM_CPU_KVCACHE_SPACE, the rollout batch or max lengths, or free memory"),
    "SIGSEGV": ("segmentation fault in native code; the 'Fatal Python error' frame printed above names it "
                "(PYTHONFAULTHANDLER=1); try rollout.vllm_enforce_eager=true or another model dtype"),
    "SIGBUS": "bus error, often a full /dev/shm; free shared memory or give the container more",
    "SIGABRT": "aborted by native code (a failed check in a kernel); the lines above say which",
    "SIGTERM": "stopped from outside (a job stop, a preemption, or a shutdown)",
    "SIGINT": "interrupted",
}


def describe_exit(name: str, pid, exitcode: int) -> str:
    """One line for a process that ended with ``exitcode`` (negative: killed by that signal)."""
    if exitcode < 0:
        try:
            sig = signal.Signals(-exitcode).name
        except ValueError:
            sig = f"signal {-exitcode}"
        advice = _ADVICE.get(sig, "killed by a signal; see the lines above")
        return f"vLLM engine process {name} (pid {pid}) died from {sig}: {advice}"
    return (f"vLLM engine process {name} (pid {pid}) exited with code {exitcode}: see its last lines above "
            "(set PYTHONFAULTHANDLER=1 for a native crash's frame)")


def dead_engine_lines() -> List[str]:
    """A line per engine process of this process's vLLM engines that ended with a failure (also
    those whose manager vLLM has dropped since)."""
    for manager in list(_MANAGERS):
        for proc in getattr(manager, "processes", ()):
            code = proc.exitcode
            if code not in (None, 0):
                line = describe_exit(proc.name, proc.pid, code)
                if line not in _SEEN:
                    _SEEN.append(line)
    return list(_SEEN)


def _lines_in_actor(_actor) -> List[str]:
    """Run inside a vLLM Ray actor by :func:`remote_dead_engine_lines` (``__ray_call__``)."""
    return dead_engine_lines()


def remote_dead_engine_lines(engines, timeout: float = 30.0) -> List[str]:
    """:func:`dead_engine_lines` of each vLLM Ray actor in ``engines`` (OpenRLHF's ``RolloutRayActor``
    handles), asked through Ray's ``__ray_call__``. The process that sees a training step fail is
    not the one whose engine died: when the EngineCore dies during the weight sync, the controller
    gets gloo's "Connection closed by peer" and no ``EngineDeadError`` at all. An actor that is gone,
    or does not answer within ``timeout`` seconds in all, adds nothing."""
    import time

    import ray

    refs = []
    for handle in engines or ():
        try:
            refs.append(handle.__ray_call__.remote(_lines_in_actor))
        except Exception:  # noqa: BLE001 - not a Ray actor handle, or its actor is gone
            continue
    deadline = time.time() + timeout
    lines: List[str] = []
    for ref in refs:
        try:
            lines += [x for x in ray.get(ref, timeout=max(0.1, deadline - time.time())) if x not in lines]
        except Exception:  # noqa: BLE001 - the actor died too, or hangs
            continue
    return lines


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        nested = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError keeps the remote one here
        exc = nested if isinstance(nested, BaseException) else (exc.__cause__ or exc.__context__)


def explain(exc: BaseException) -> Optional[str]:
    """The one line for an exception that comes from a dead vLLM engine, else ``None``."""
    texts = []
    engine_dead = False
    for e in _chain(exc):
        name = type(e).__name__
        text = str(e)
        texts.append(text)
        # only vLLM's own death signal: a Ray actor that died (a killed policy actor) is not a dead engine
        if name == "EngineDeadError" or "EngineDeadError" in text or "EngineCore encountered an issue" in text:
            engine_dead = True
    for text in texts:  # a line that travelled inside the message (through Ray)
        start = text.find(MARK)
        if start >= 0:
            end = text.find("]", start)
            return text[start + len(MARK):end if end > 0 else None].strip()
    if not engine_dead:
        return None
    lines = dead_engine_lines()
    if lines:
        return lines[0]
    return ("a vLLM engine process died and its exit was not recorded here (it ran in another process); "
            "look above for 'Fatal Python error' (PYTHONFAULTHANDLER=1) or an out-of-memory kill (dmesg)")


def install() -> None:
    """Remember vLLM's engine-core process managers and make ``EngineDeadError`` carry
    :func:`dead_engine_lines` in its message (idempotent)."""
    try:
        from vllm.v1.engine import exceptions
        from vllm.v1.engine import utils as engine_utils
    except Exception:  # another vLLM layout: the CLI falls back to the generic line
        return
    manager_cls = getattr(engine_utils, "CoreEngineProcManager", None)
    if manager_cls is not None and not getattr(manager_cls.__init__, "_openrlhf_div_tracked", False):
        real_manager_init = manager_cls.__init__

        def manager_init(self, *args, **kwargs):
            real_manager_init(self, *args, **kwargs)
            _MANAGERS.add(self)

        manager_init._openrlhf_div_tracked = True
        manager_cls.__init__ = manager_init
    cls = exceptions.EngineDeadError
    if getattr(cls, "_openrlhf_div_named", False):
        return
    real_init = cls.__init__

    def __init__(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        lines = dead_engine_lines()
        if lines and self.args:
            self.args = (f"{self.args[0]} {MARK}{lines[0]}]",) + tuple(self.args[1:])

    cls.__init__ = __init__
    cls._openrlhf_div_named = True
