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

Standing in for another CPU means answering *every* capability probe as it would (issue 43 item 7:
on an AMX Xeon the forced AVX2 library met the AMX attention ISA, a pair no CPU takes, and the
rerun failed): tests/vllm_cpu_features.py forces each ``torch.cpu._is_*_supported`` probe the
library's CPU answers False, and the rerun starts from a simulated AMX CPU where this one has no
AMX (``OPENRLHF_DIV_SIMULATE_AMX_CPU``), so an incomplete forcing fails here as it did there.

Cost: one pytest process per other library, ~40-70 s each on the 2-core machine.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
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
    env = dict(os.environ, OPENRLHF_DIV_FORCE_VLLM_KERNEL_LIB=lib, PYTHONFAULTHANDLER="1",
               OPENRLHF_DIV_SIMULATE_AMX_CPU="1")  # the newest CPU's answers first, then the forcing
    env.pop("PYTEST_XDIST_WORKER", None)
    # the stood-in CPU's compiled kernels (Inductor's, e.g. vLLM's sampler) in a cache of their own: in the
    # shared one they were loaded later by this CPU's own processes, which then aborted in the sampler
    env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-other-cpu-")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                           os.path.join(HERE, "test_vllm_weights.py"), "-k", "sgl or onednn or library"],
                          capture_output=True, text=True, env=env, cwd=os.path.dirname(HERE), timeout=900)
    fatal = proc.stderr.find("Fatal Python error")  # a native crash: its frame (PYTHONFAULTHANDLER)
    tail = proc.stdout[-3000:] + (proc.stderr[fatal:fatal + 4000] if fatal >= 0 else proc.stderr[-2000:])
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "3 passed" in proc.stdout.splitlines()[-1], tail


def test_the_forcing_answers_every_probe_vllm_reads(monkeypatch):
    """vLLM's installed source reads only probes torch has (so the forcing reaches each), and on a
    simulated AMX CPU each forced library's CPU gets that CPU's attention ISA for a bf16 engine
    (``vec``), where the AMX answer alone gives ``amx`` (what broke the AVX2 rerun on the Xeon)."""
    import vllm_cpu_features as F
    from vllm.v1.attention.backends import cpu_attn

    in_vllm = F.probes_in_vllm()
    assert {"amx_tile", "avx512", "avx512_bf16"} <= in_vllm, in_vllm  # the reading works
    assert in_vllm <= F.torch_probes(), f"vLLM probes what torch.cpu lacks: {in_vllm - F.torch_probes()}"
    F.simulate_amx_cpu(monkeypatch.setattr)
    assert cpu_attn._get_attn_isa(torch.bfloat16, 128, 64) == "amx"
    for lib in F.LIBRARY_CPU:
        with monkeypatch.context() as m:
            forced = F.force_cpu_of(lib, m.setattr)
            assert "amx_tile" in forced and torch.cpu._is_amx_tile_supported() is False
            assert cpu_attn._get_attn_isa(torch.bfloat16, 128, 64) == "vec", lib
            assert ("avx512" in forced) == (lib == "avx2") and "avx512_bf16" in forced, forced
