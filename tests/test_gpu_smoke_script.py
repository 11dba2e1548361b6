"""scripts/gpu_smoke.sh cannot run without a GPU; here: it parses, passes shellcheck, and its
Python part imports and plans on CPU (the figures come only from a GPU run)."""
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = [os.path.join(ROOT, "scripts", n) for n in ("gpu_smoke.sh", "gpu_smoke_wheels.sh")]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_smoke", os.path.join(ROOT, "scripts", "gpu_smoke.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_scripts_parse(script):
    assert subprocess.run(["bash", "-n", script]).returncode == 0


def test_scripts_pass_shellcheck():
    exe = shutil.which("shellcheck") or os.path.join(os.path.dirname(sys.executable), "shellcheck")
    if not os.path.exists(exe):
        pytest.skip("shellcheck not installed")
    r = subprocess.run([exe, *SCRIPTS], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_plan_and_flop_model_on_cpu():
    m = _module()
    kinds = [c["kind"] for c in m.plan()]
    assert kinds.count("local_engine") == 4 and kinds.count("openrlhf_actor_step") == 2
    assert {c["method"] for c in m.plan() if "method" in c} == {"grpo", "dph_js"}
    # Qwen2.5-1.5B has 1.54e9 parameters (tied embeddings)
    assert 1.50e9 < m.n_params(m.QWEN25_15B) < 1.58e9
    assert m.mfu(1e9, 1000, 1.0, 6.0) == pytest.approx(1.0)  # 6e12 FLOP in 1 s at 6 TFLOP/s


def test_refuses_to_run_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert _module().main(["--out", str(tmp_path / "x.json")]) == 2
    r = subprocess.run(["bash", SCRIPTS[0]], capture_output=True, text=True,
                       env=dict(os.environ, PYTHON=sys.executable))
    assert r.returncode == 2 and "no CUDA device" in r.stderr
