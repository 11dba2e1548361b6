"""The package stands alone (issue 42 item 5): an installed wheel runs without the checkout.

Two checks:

* a static one (milliseconds): no module under ``openrlhf_div/`` names the checkout's ``tests/``
  folder as a path or puts it on ``sys.path``, and every repository-relative path the package
  builds for ``configs/`` / ``examples/`` goes through :mod:`openrlhf_div.shipped` (the checkout or
  the wheel's copy);
* the real one: build the wheel from a copy of the sources, install it (no dependencies) into a
  fresh venv that borrows this venv's third-party packages through a ``.pth`` (everything but our
  own editable install), and from a folder outside the checkout run ``openrlhf-div methods``,
  ``openrlhf-div run tiny_cpu_grpo --engine local --toy`` and the CPU seams' import path (the
  ``cpu_site`` hooks patching the Megatron engine with :mod:`openrlhf_div.compat.mcore_cpu` and
  the forced CPU GEMM with :mod:`openrlhf_div.compat.vllm_cpu_gemm`), each asserting that what ran
  came from the fresh venv.
"""
from __future__ import annotations

import ast
import glob
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "openrlhf_div")


def _package_sources():
    for dp, dns, fns in os.walk(PKG):
        dns[:] = [d for d in dns if d not in ("__pycache__", "_shipped")]
        for fn in fns:
            if fn.endswith((".py", ".sh")):
                yield os.path.join(dp, fn)


def _string_constants(path):
    """Every string literal of the module that is code, not documentation (docstrings and
    comments are allowed to mention tests/)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
                docs.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node


def test_package_code_names_no_tests_folder():
    """No string in the package's code is the ``tests`` folder or a path into it (``"tests"``,
    ``"tests/..."``), and no module walks up to the checkout's root by ``dirname`` chains except
    :mod:`openrlhf_div.shipped` (and cpu_site's fallback to the package's own parent)."""
    bad = []
    for path in _package_sources():
        rel = os.path.relpath(path, ROOT)
        if path.endswith(".sh"):
            continue
        for node in _string_constants(path):
            v = node.value
            if v == "tests" or v.startswith(("tests/", "./tests/", "../tests/")) or "/tests/" in v:
                bad.append(f"{rel}:{node.lineno}: {v!r}")
        text = open(path, encoding="utf-8").read()
        triple = "os.path.dirname(os.path.dirname(os.path.dirname("
        allowed = rel in (os.path.join("openrlhf_div", "shipped.py"),
                          os.path.join("openrlhf_div", "compat", "cpu_site", "sitecustomize.py"))
        if triple in text and not allowed:
            bad.append(f"{rel}: walks up to the checkout's root (use openrlhf_div.shipped.root())")
    assert not bad, "the package reads the checkout by path:\n" + "\n".join(bad)


def test_shipped_folders_are_what_the_configs_name():
    """Every repository-relative data path in a shipped config lies under a shipped folder (else the
    wheel would lack it), and the SQL toy's data are among them (no longer under tests/)."""
    from openrlhf_div import shipped

    assert shipped.root() == ROOT  # the checkout wins when the package runs from one
    import yaml

    def strings(node):
        if isinstance(node, dict):
            for v in node.values():
                yield from strings(v)
        elif isinstance(node, list):
            for v in node:
                yield from strings(v)
        elif isinstance(node, str):
            yield node

    named = []  # (config, a value that is a repository-relative path) -- values, not comments
    for path in glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True):
        for v in strings(yaml.safe_load(open(path))):
            if re.match(r"^(examples|tests|configs)/", v):
                named.append((os.path.relpath(path, ROOT), v))
    assert any(p.startswith("examples/data/toy_sql") for _, p in named)
    outside = [(f, p) for f, p in named if p.startswith(("examples/", "tests/"))
               and not any(p.startswith(s + "/") for s in shipped.SHIPPED)]
    assert not outside, f"configs name files the wheel does not ship: {outside}"


# ------------------------------------------------------------------ the wheel, outside the checkout
def _fresh_venv(tmp):
    """A venv with this venv's third-party packages (a .pth that adds its site-packages and runs its
    .pth files, except our own editable install's) and nothing of the checkout."""
    venv = os.path.join(tmp, "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    py = os.path.join(venv, "bin", "python")
    fresh_site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                check=True, capture_output=True, text=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    # one line, run by site.addpackage's exec inside a function: a comprehension there sees no names
    # the line imported, hence __import__ and the literal path
    code = ("import sys; sys.path.append(%r); [__import__('site').addpackage(%r, f, set()) for f in "
            "sorted(__import__('os').listdir(%r)) if f.endswith('.pth') and 'openrlhf_div' not in f]"
            % (ours, ours, ours))
    with open(os.path.join(fresh_site, "zz_borrowed_site_packages.pth"), "w") as fh:
        fh.write(code + "\n")
    return venv, py


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    if not hasattr(site, "addpackage"):
        pytest.skip("site.addpackage missing")
    tmp = str(tmp_path_factory.mktemp("wheel"))
    src = os.path.join(tmp, "src")
    os.makedirs(src)
    for f in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy(os.path.join(ROOT, f), src)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for d in ("openrlhf_div", "configs", "examples"):
        shutil.copytree(os.path.join(ROOT, d), os.path.join(src, d), ignore=ignore)
    dist = os.path.join(tmp, "dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", dist, src], check=True, capture_output=True, text=True)
    wheel = glob.glob(os.path.join(dist, "openrlhf_div-*.whl"))
    assert len(wheel) == 1, os.listdir(dist)
    venv, py = _fresh_venv(tmp)
    subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q",
                    wheel[0]], check=True, capture_output=True, text=True)
    away = os.path.join(tmp, "elsewhere")  # the working directory: not the checkout, not the sources
    os.makedirs(away)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PATH=os.path.join(venv, "bin") + os.pathsep + env.get("PATH", ""), PYTHONUTF8="1",
               OMP_NUM_THREADS="1", PYTHONNOUSERSITE="1")
    return {"venv": venv, "py": py, "cwd": away, "env": env, "src": src}


def _run(inst, *cmd, env=None, timeout=300):
    out = subprocess.run(list(cmd), cwd=inst["cwd"], env=env or inst["env"], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"{cmd} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_wheel_imports_from_the_fresh_venv(installed):
    """The package, its shipped files and nothing of the checkout (only the borrowed third-party
    site-packages, which happen to live in the checkout's .venv)."""
    borrowed = sysconfig.get_paths()["purelib"]
    code = ("import sys, importlib.util as u, openrlhf_div, openrlhf_div.shipped as s; print(openrlhf_div.__file__); "
            "print(s.root()); print(sorted({p for p in sys.path if p.startswith(%r) and p != %r}));"
            "print([m for m in ('mcore_cpu', 'vllm_cpu_gemm', 'vllm_cpu_attn', 'helpers') if u.find_spec(m)])"
            % (ROOT, borrowed))
    out = _run(installed, installed["py"], "-c", code)
    lines = out.stdout.splitlines()
    assert lines[0].startswith(installed["venv"]), lines
    assert lines[1] == os.path.join(os.path.dirname(lines[0]), "_shipped"), lines
    assert lines[2] == "[]", f"the checkout is on sys.path: {lines[2]}"
    assert lines[3] == "[]", f"the checkout's tests/ helpers are importable: {lines[3]}"
    assert "Error processing" not in out.stderr, out.stderr  # the borrowing .pth ran cleanly


def test_wheel_methods(installed):
    out = _run(installed, os.path.join(installed["venv"], "bin", "openrlhf-div"), "methods")
    assert "grpo" in out.stdout and "dph_js" in out.stdout, out.stdout[-2000:]


def test_wheel_runs_a_local_toy(installed):
    """An experiment found by name in the wheel's configs, its toy's data from the wheel's
    examples/data, two steps on the local engine; the run folder where we asked."""
    run_dir = os.path.join(installed["cwd"], "run")
    out = _run(installed, os.path.join(installed["venv"], "bin", "openrlhf-div"), "run", "tiny_cpu_grpo",
               "--engine", "local", "--toy", "--run-dir", run_dir)
    assert os.path.isfile(os.path.join(run_dir, "run_info.json")), out.stderr[-2000:]
    cfg = open(os.path.join(run_dir, "config.yaml")).read()
    train = re.search(r"train: (\S+)", cfg).group(1)
    assert train.startswith(installed["venv"]) and "_shipped/examples/data/toy_math" in train, train


def test_wheel_cpu_seams_import_path(installed):
    """The CPU path's hooks, as every Ray worker of a CPU run gets them (``cpu_site`` on PYTHONPATH,
    ``OPENRLHF_DIV_CPU_SEAMS=1``): importing our Megatron engine wraps it in the package's
    megatron-core CPU shim, and vLLM's GEMM dispatch module takes the forced branch through the
    package's vllm_cpu_gemm; neither needs the checkout."""
    pytest.importorskip("megatron.core")
    code = (
        "import sys, openrlhf_div.engines.megatron.engine as e, openrlhf_div.compat.cpu_seams as cs;"
        "assert 'openrlhf_div.engines.megatron.engine' in cs._PATCHED, cs._PATCHED;"
        "m = sys.modules['openrlhf_div.compat.mcore_cpu']; print('@@', m.__file__);"
        "print('@@', e.MegatronEngine.train_step.__wrapped__.__qualname__);"
        "import importlib.util as u;"
        "vllm = u.find_spec('vllm') is not None;"
        "vllm and __import__('vllm.model_executor.layers.utils');"
        "g = sys.modules.get('openrlhf_div.compat.vllm_cpu_gemm'); print('@@', g.__file__ if vllm else 'no vllm')")
    from openrlhf_div.compat import cpu_seams

    site_dir = subprocess.run([installed["py"], "-c", "import openrlhf_div.compat.cpu_seams as c; print(c.SITE_DIR)"],
                              cwd=installed["cwd"], env=installed["env"], capture_output=True, text=True,
                              check=True).stdout.strip()
    assert site_dir.startswith(installed["venv"]) and site_dir != cpu_seams.SITE_DIR
    env = dict(installed["env"], PYTHONPATH=site_dir, OPENRLHF_DIV_CPU_SEAMS="1",
               OPENRLHF_DIV_FORCE_CPU_GEMM="fallback")
    out = _run(installed, installed["py"], "-c", code, env=env)
    lines = [ln[3:] for ln in out.stdout.splitlines() if ln.startswith("@@ ")]  # vLLM prints to stdout too
    assert lines[0].startswith(installed["venv"]) and lines[0].endswith("compat/mcore_cpu.py"), lines
    assert lines[1] == "MegatronEngine.train_step", lines
    assert lines[2] == "no vllm" or lines[2].startswith(installed["venv"]), lines
    if lines[2] != "no vllm":  # the forced branch's line, from the package's module
        assert "vLLM's CPU GEMM dispatch forced to fallback" in out.stderr, out.stderr[-2000:]


def test_no_shipped_files_is_one_line(monkeypatch, tmp_path, capsys):
    """Neither a checkout nor the wheel's copy: `run NAME` says so in one line (naming both places)."""
    from openrlhf_div import shipped
    from openrlhf_div.cli.main import main

    monkeypatch.setattr(shipped, "CHECKOUT_DIR", str(tmp_path / "checkout"))
    monkeypatch.setattr(shipped, "PACKAGE_DIR", str(tmp_path / "pkg"))
    monkeypatch.chdir(tmp_path)
    assert main(["run", "tiny_cpu_grpo_nope", "--engine", "local", "--toy"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "checkout" in err and "installed package" in err, err
