"""openrlhf-div's vLLM general plugin: runs in every process vLLM starts, before its first forward.

vLLM loads every entry point of the ``vllm.general_plugins`` group in each of its processes (the
``LLM`` front end via ``EngineArgs``, the EngineCore process -- forked or spawned -- and every
worker; ``vllm/plugins/__init__.py``). setup.py registers :func:`register` there, so this module
runs wherever a vLLM engine of ours runs: the local engine's in-process sampler, DPH
pre-sampling, evaluation, and OpenRLHF's rollout actors on Ray (whose EngineCore vLLM spawns).

What it does:

* **AMX permission.** On Linux a process may execute AMX tile instructions only after asking the
  kernel (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``; PyTorch:
  ``torch.cpu._init_amx()``). vLLM 0.29's CPU attention picks its ``amx`` kernels for bf16 on AMX
  CPUs (``_get_attn_isa`` in ``vllm/v1/attention/backends/cpu_attn.py``) and nothing in vLLM asks,
  so unless an earlier oneDNN kernel happened to ask, the engine's first attention call dies with
  SIGILL. The request is per process, kept across ``fork`` and dropped by ``exec``; a process
  without AMX gets ``False`` and nothing changes.
* **A dead engine named**: :func:`openrlhf_div.compat.engine_death.install` remembers every
  engine-core process manager vLLM builds in this process and makes ``EngineDeadError`` carry the
  line naming the dead process, its signal, the likely cause and the fix.

It must stay cheap and safe to run more than once (vLLM may load plugins repeatedly).
"""
from __future__ import annotations

import os
import platform
from typing import Dict, Optional

__all__ = ["register", "amx_state"]

#: what :func:`register` did in *this* process (inherited by a forked child together with the
#: permission it describes; a spawned or exec'ed process starts empty, as its permission does)
_STATE: Dict[str, object] = {}


def _request_amx() -> Optional[bool]:
    """Ask for AMX tile data in this process: True granted, False refused / no AMX, None not x86."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "i386"):
        return None
    import torch

    init = getattr(torch.cpu, "_init_amx", None)
    if init is None:  # a torch without the call: nothing to do (it has no AMX kernels either)
        return False
    return bool(init())


def register() -> None:
    """The ``vllm.general_plugins`` entry point (setup.py). Idempotent."""
    if _STATE.get("pid") == os.getpid():
        return
    granted = _request_amx()
    _STATE.update(pid=os.getpid(), amx_requested=granted is not None, amx_granted=granted)
    from openrlhf_div.compat import engine_death
    from openrlhf_div.compat.vllm_aot_cache import allow_inductor_aot_reload

    engine_death.install()
    allow_inductor_aot_reload()  # a CPU engine's second start loads its compiled graph (issue 32)


def amx_state() -> Dict[str, object]:
    """What this process knows: ``requested`` (the plugin asked in this process or in the parent it
    was forked from), ``granted`` (the kernel said yes), ``supported`` (the CPU has AMX tiles)."""
    import torch

    supported = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    return {"requested": bool(_STATE.get("amx_requested")), "granted": bool(_STATE.get("amx_granted")),
            "supported": supported, "pid": os.getpid(), "plugin_pid": _STATE.get("pid")}
