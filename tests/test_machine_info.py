"""scripts/machine_info.py: the one line scripts/test.sh prints before pytest starts (issue 21),
and the suite's independence from a non-writable home directory (tests/conftest.py)."""
import os
import re
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import machine_info as M  # noqa: E402

AVX512_BF16 = ("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl "
               "avx512_vnni avx512_bf16")
AVX2 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma bmi2 sha_ni"


@pytest.mark.parametrize("flags, want", [
    (AVX512_BF16, ["avx2", "avx512", "avx512_bf16", "no amx"]),
    (AVX2, ["avx2", "no avx512"]),
    (AVX512_BF16 + " amx_bf16 amx_tile amx_int8", ["avx2", "avx512", "avx512_bf16", "amx"]),
    ("", ["flags unknown"]),
])
def test_flag_families(flags, want):
    assert M.families(set(flags.split())) == want


def test_cpu_info_reads_model_and_flags(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text(f"processor\t: 0\nmodel name\t: Some CPU @ 2GHz\nflags\t\t: {AVX2}\n\n"
                 f"processor\t: 1\nmodel name\t: Some CPU @ 2GHz\nflags\t\t: {AVX2}\n")
    info = M.cpu_info(str(f))
    assert info["model"] == "Some CPU @ 2GHz" and "avx2" in info["flags"] and "avx512f" not in info["flags"]


def test_the_line_test_sh_prints_first():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "machine_info.py")],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.count("\n") == 1 and out.startswith("[machine] cpu="), out
    assert re.search(r" cores=\d+ python=3\.\d+\.\d+ torch=\S+ vllm=\S+ ", out), out
    script = open(os.path.join(ROOT, "scripts", "test.sh")).read()
    assert script.index("machine_info.py") < script.index("-m pytest")


def test_home_is_writable_in_the_suite():
    """tests/conftest.py gives the suite a private home in the temp dir where $HOME cannot be
    written (e.g. HOME=/proc/none); the caches of vLLM, triton, matplotlib and the GGUF
    conversion (~/.cache/openrlhf_div) then land there."""
    with tempfile.NamedTemporaryFile(dir=os.path.join(os.path.expanduser("~"), ".cache")):
        pass
    real = os.environ.get("OPENRLHF_DIV_TEST_REAL_HOME")
    assert real is None or os.path.expanduser("~") != real
