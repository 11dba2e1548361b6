"""Shared test set-up: test-only helper modules in this directory (``vllm_cpu_attn``) are importable
(the suite runs with ``--import-mode=importlib``, which does not put ``tests/`` on ``sys.path``)."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# ------------------------------------------------------------------ parallel runs (pytest-xdist)
# scripts/test.sh runs the suite on 2 workers, a test file at a time per worker (`-n 2 --dist
# loadfile`: a file's module and session fixtures stay on one worker; tests/e2e/test_ray_e2e.py
# is one file so that one worker owns the private Ray head). Each worker gets one OpenMP thread,
# set before any test imports torch (subprocesses inherit it): two workers with two
# spin-waiting threads each on a 2-core machine are many times slower than one thread each.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# ------------------------------------------------------------------ vLLM's kernel library of another CPU
# vLLM's CPU build ships three kernel libraries and loads one by the CPU's flags
# (vllm/platforms/cpu.py import_kernels): _C (AVX-512 + BF16: Zen 4/5, Sapphire Rapids and later),
# _C_AVX512 (AVX-512 without BF16) and _C_AVX2. OPENRLHF_DIV_FORCE_VLLM_KERNEL_LIB=avx2|avx512 makes
# this process load that library (every one runs on a newer CPU), so the branches an older CPU takes
# run here too (tests/test_vllm_kernel_libs.py). Every capability probe that CPU answers differently
# is forced with it (the attention ISA too: tests/vllm_cpu_features.py), and
# OPENRLHF_DIV_SIMULATE_AMX_CPU=1 first makes a CPU without AMX answer as an AMX Xeon does.
_force_lib = os.environ.get("OPENRLHF_DIV_FORCE_VLLM_KERNEL_LIB")
if _force_lib:
    import vllm_cpu_features as _features

    if os.environ.get(_features.SIMULATE_AMX_ENV) == "1":
        _features.simulate_amx_cpu()
    _features.force_cpu_of(_force_lib)

# every process the suite starts (vLLM engines, Ray workers) prints the Python frame of a native
# crash (SIGILL in an AMX kernel, SIGSEGV); scripts/test.sh sets it too
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


# ------------------------------------------------------------------ a home directory that is not writable
# The stack caches under $HOME (~/.cache/openrlhf_div for de-quantized GGUF files, ~/.cache/vllm,
# ~/.triton, ~/.config/matplotlib, Ray and Hugging Face state). Where $HOME cannot be written (a
# read-only or missing home in CI containers), every process of the suite -- and the subprocesses,
# Ray workers and vLLM engines it starts, which inherit the environment -- gets a private writable
# home in the temp directory instead. A writable $HOME is left alone.
def _writable_home(home: str) -> bool:
    import tempfile

    try:
        cache = os.path.join(home, ".cache")
        os.makedirs(cache, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache):
            return True
    except OSError:
        return False


if not _writable_home(os.path.expanduser("~")):
    import tempfile

    _home = os.path.join(tempfile.gettempdir(), f"openrlhf-div-home-{os.getuid()}")
    os.makedirs(os.path.join(_home, ".cache"), exist_ok=True)
    os.environ["OPENRLHF_DIV_TEST_REAL_HOME"] = os.path.expanduser("~")
    os.environ["HOME"] = _home
