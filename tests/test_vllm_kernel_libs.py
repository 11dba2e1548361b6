"""vLLM's CPU kernel library of another CPU family, run on this one (issue 29: "it passes where it
was built").

vLLM 0.29 ships three builds of its CPU kernels and loads the one the CPU's flags select
(``import_kernels`` in ``vllm/platforms/cpu.py``): ``_C`` on AVX-512 + BF16 (this project's CI
machine, Zen 4/5, Intel Sapphire Rapids and later), ``_C_AVX512`` on AVX-512 without BF16 and
``_C_AVX2`` on AVX2-only CPUs (the previous development machine). Each exposes different ops: the
sgl-kernel GEMM, for one, exists only in the AVX-512 builds, so a weight sync forced to it runs the
real kernel on one machine and the contract-keeping stand-in on another. This test reruns the
weight-sync branch tests (``tests/test_vllm_weights.py``) in a process that loads each *other*
library (``OPENRLHF_DIV_FORCE_VLLM_KERNEL_LIB``, tests/conftest.py); every library runs on a newer
CPU, so a newer CI machine covers the older ones.

Cost: one pytest process per other library, ~40-70 s each on the 2-core machine.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

HERE = os.path.dirname(os.path.abspath(__file__))
LIBS = {"avx2": "_C_AVX2.abi3.so", "avx512": "_C_AVX512.abi3.so", "native": "_C.abi3.so"}


def _this_cpus_library() -> str:
    if not torch.cpu._is_avx512_supported():
        return "avx2"
    return "native" if torch.cpu._is_avx512_bf16_supported() else "avx512"


def loaded_vllm_library() -> str:
    """Which of vLLM's kernel libraries this process loaded (read from /proc/self/maps)."""
    import vllm._custom_ops  # noqa: F401  (loads the library)

    with open("/proc/self/maps") as fh:
        maps = fh.read()
    found = [name for name, so in LIBS.items() if f"/vllm/{so}" in maps]
    assert len(found) == 1, found
    return found[0]


#: the libraries the suite reruns; OPENRLHF_DIV_KERNEL_LIBS=avx2,avx512 adds the AVX-512 (no BF16) build,
#: whose process crashed once in a loaded CI-like run (native crash; passed in each run alone)
LIBS_RUN = [x for x in os.environ.get("OPENRLHF_DIV_KERNEL_LIBS", "avx2").split(",") if x]


@pytest.mark.parametrize("lib", LIBS_RUN)
def test_weight_sync_branches_under_another_cpus_kernel_library(lib):
    if lib == _this_cpus_library():
        pytest.skip(f"this CPU loads the {lib} library itself: the suite's own run covers it")
    if lib == "avx512" and _this_cpus_library() == "avx2":
        pytest.skip("the AVX-512 library cannot run on an AVX2-only CPU")
    env = dict(os.environ, OPENRLHF_DIV_FORCE_VLLM_KERNEL_LIB=lib, PYTHONFAULTHANDLER="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                           os.path.join(HERE, "test_vllm_weights.py"), "-k", "sgl or onednn or library"],
                          capture_output=True, text=True, env=env, cwd=os.path.dirname(HERE), timeout=900)
    fatal = proc.stderr.find("Fatal Python error")  # a native crash: its frame (PYTHONFAULTHANDLER)
    tail = proc.stdout[-3000:] + (proc.stderr[fatal:fatal + 4000] if fatal >= 0 else proc.stderr[-2000:])
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "3 passed" in proc.stdout.splitlines()[-1], tail
