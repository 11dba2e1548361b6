"""One line about this machine, printed by scripts/test.sh before pytest starts, so that a failure
report carries it: CPU model, the CPU flag families vLLM's CPU build and torch choose kernels by,
cores, Python, torch and vLLM versions. Standard library only (no torch / vLLM import: cheap).

    python scripts/machine_info.py      # [machine] cpu=AMD EPYC (avx2, no avx512) cores=2 ...
"""
from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Dict, List, Set

#: flag family -> the /proc/cpuinfo flag that marks it (the ones vLLM 0.29's CPU GEMM dispatch and
#: its _C_AVX2 / _C_AVX512 builds depend on: docs/scaling.md, "CPU weight sync")
FAMILIES = (("avx2", "avx2"), ("avx512", "avx512f"), ("avx512_bf16", "avx512_bf16"), ("amx", "amx_tile"))


def cpu_info(path: str = "/proc/cpuinfo") -> Dict[str, object]:
    model, flags = platform.processor() or platform.machine(), set()  # type: str, Set[str]
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and value.strip():
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "flags": flags}


def families(flags: Set[str]) -> List[str]:
    """The flag families present, and a ``no ...`` note for the first one missing."""
    out = [name for name, flag in FAMILIES if flag in flags]
    missing = [name for name, flag in FAMILIES if flag not in flags]
    if missing and flags:
        out.append(f"no {missing[0]}")
    return out or ["flags unknown"]


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _version(dist: str) -> str:
    for name in (dist, f"{dist}-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "absent"


def summary() -> str:
    cpu = cpu_info()
    return (f"[machine] cpu={cpu['model']} ({', '.join(families(cpu['flags']))}) cores={cores()} "
            f"python={platform.python_version()} torch={_version('torch')} vllm={_version('vllm')} "
            f"os={platform.system()} {platform.release()}")


if __name__ == "__main__":
    print(summary(), flush=True)
    sys.exit(0)
