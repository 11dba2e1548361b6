"""The GPU install order resolves (issue 9): setup.py's [gpu] extra + docker/Dockerfile.

openrlhf 0.11.2 hard-requires flash-attn==2.8.3 (source only; its build imports torch, so it
fails under pip's build isolation). Before the fix the [gpu] extra named openrlhf and flash-attn
(no resolver can install that) and the Dockerfile installed openrlhf with its dependencies before
the --no-build-isolation flash-attn step. Checked here without CUDA: the extra against openrlhf's
own metadata, the Dockerfile's order, and a pip dependency-resolution dry run of everything in
the extra that is not a CUDA build (vllm and torch come from vLLM's release image there).
"""
import ast
import json
import os
import re
import subprocess
import sys
from importlib import metadata

import pytest
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpu_extra():
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "GPU":
            return [Requirement(ast.literal_eval(e)) for e in node.value.elts]
    raise AssertionError("setup.py defines no GPU list")


def _name(r):
    return re.sub(r"[-_.]+", "-", r.name).lower()


def test_gpu_extra_is_openrlhfs_requirements_without_flash_attn():
    upstream = [Requirement(r) for r in metadata.requires("openrlhf") or []]
    core = {_name(r): r for r in upstream if not r.marker}
    extra = {_name(r): r for r in _gpu_extra()}
    assert "flash-attn" not in extra and "openrlhf" not in extra
    assert set(core) - {"flash-attn"} <= set(extra), set(core) - set(extra)
    for n, r in core.items():
        if n != "flash-attn":
            assert str(r.specifier) == str(extra[n].specifier), (n, r, extra[n])
    vllm = next(r for r in upstream if _name(r) == "vllm" and 'extra == "vllm"' in str(r.marker))
    assert str(extra["vllm"].specifier) == str(vllm.specifier) == "==0.29.0"


def test_dockerfile_installs_in_the_order_that_resolves():
    text = open(os.path.join(ROOT, "docker", "Dockerfile")).read()
    run = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    i_extra = run.index("[gpu]")
    i_flash = run.index('--no-build-isolation "flash-attn==2.8.3"')
    i_openrlhf = run.index('--no-deps "openrlhf==0.11.2"')
    assert i_extra < i_flash < i_openrlhf
    # openrlhf is never installed with its dependency list
    for m in re.finditer(r"pip install[^\n&]*openrlhf(?!_div|-div)[^\n&]*", run):
        assert "--no-deps" in m.group(0), m.group(0)


@pytest.mark.slow
def test_gpu_extra_resolves_with_pip_apart_from_the_cuda_builds(tmp_path):
    reqs = [str(r) for r in _gpu_extra() if _name(r) not in ("vllm", "torch")]
    (tmp_path / "r.txt").write_text("\n".join(reqs) + "\n")
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PIP_CONSTRAINT", None)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report",
                        str(tmp_path / "report.json"), "-r", str(tmp_path / "r.txt")],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    planned = {re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower(): i["metadata"]["version"]
               for i in report["install"]}
    assert "flash-attn" not in planned
    if "torch" in planned:  # anything pulling a torch must keep the CPU pin's version
        assert planned["torch"].startswith("2.13.0"), planned["torch"]
