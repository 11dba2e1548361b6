"""Make this process answer vLLM's CPU capability probes as a CPU of another family would
(test-only helper of tests/conftest.py and tests/test_vllm_kernel_libs.py; issue 43 item 7).

vLLM 0.29 reads the CPU through ``torch.cpu._is_<feature>_supported()``: the kernel library it
loads (``import_kernels``: ``_is_avx512_supported``, ``_is_avx512_bf16_supported``), the attention
ISA (``_get_attn_isa``: ``_is_amx_tile_supported``, ``_is_avx512_supported``), the GEMM
(``check_cpu_sgl_kernel``: AMX), MLA / MoE / mamba paths. A rerun that stands in for an older CPU
must force *every* probe that CPU answers differently, not just the library's: forcing only the
AVX2 library on an AMX Xeon left the attention ISA at ``amx``, which that library lacks
(``Unsupported CPU attention configuration: head_dim=64 isa=0``), a pair no real CPU takes.

:data:`LIBRARY_CPU` says which features the CPU a library is built for may have; :func:`force_cpu_of`
answers False for every other probe torch offers (and :func:`probes_in_vllm` reads the probes
vLLM's installed source calls, so a test fails when vLLM starts reading one torch lacks).
:func:`simulate_amx_cpu` makes a CPU without AMX answer as one with it (the AMX Xeon of the issue),
so this machine checks that the forcing holds there too.
"""
from __future__ import annotations

import os
import re
from typing import Callable, Dict, Set

import torch

#: vLLM kernel library -> the probed features the CPU that loads it may have (all others: False).
#: _C_AVX2: AVX2-only CPUs (no AVX-512, hence no AVX-512 BF16 / VNNI and no AMX, which came after);
#: _C_AVX512: AVX-512 without BF16 (Skylake-SP / Cascade Lake: VNNI at most, no AMX).
LIBRARY_CPU: Dict[str, tuple] = {"avx2": ("avx2",), "avx512": ("avx2", "avx512", "vnni")}

_PROBE = re.compile(r"torch\.cpu\._is_(\w+?)_supported\b")


def torch_probes() -> Set[str]:
    """The features torch.cpu has a ``_is_<feature>_supported`` probe for."""
    return {m.group(1) for m in map(_PROBE.match, ("torch.cpu." + n for n in dir(torch.cpu))) if m}


def probes_in_vllm() -> Set[str]:
    """The features vLLM's installed Python source probes through ``torch.cpu._is_*_supported``."""
    import importlib.util

    root = os.path.dirname(importlib.util.find_spec("vllm").origin)
    found: Set[str] = set()
    for dp, dns, fns in os.walk(root):
        dns[:] = [d for d in dns if d != "__pycache__"]
        for fn in fns:
            if fn.endswith(".py"):
                with open(os.path.join(dp, fn), encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
                if "torch.cpu._is_" in text:
                    found.update(_PROBE.findall(text))
    return found


def force_cpu_of(lib: str, set_attr: Callable = setattr) -> Dict[str, bool]:
    """Every probe for a feature the ``lib`` CPU lacks answers False from now on (``set_attr``:
    ``monkeypatch.setattr`` in a test). Returns ``{feature: answer}`` of the forced probes."""
    if lib not in LIBRARY_CPU:
        raise ValueError(f"OPENRLHF_DIV_FORCE_VLLM_KERNEL_LIB={lib!r}: one of {', '.join(LIBRARY_CPU)}")
    forced = {}
    for feature in sorted(torch_probes() - set(LIBRARY_CPU[lib])):
        set_attr(torch.cpu, f"_is_{feature}_supported", lambda: False)
        forced[feature] = False
    return forced


#: set to 1: this process answers the AMX probe as an AMX CPU would (where it has none)
SIMULATE_AMX_ENV = "OPENRLHF_DIV_SIMULATE_AMX_CPU"


def simulate_amx_cpu(set_attr: Callable = setattr) -> bool:
    """This CPU answers ``_is_amx_tile_supported()`` True (an AMX Xeon's answer; only the probe, the
    tile instructions stay unavailable). Returns whether it changed anything (False on an AMX CPU)."""
    if torch.cpu._is_amx_tile_supported():
        return False
    set_attr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    return True
