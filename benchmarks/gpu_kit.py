"""The carry kit of ``benchmarks/gpu_bench.sh``: the wheels a GPU machine without internet lacks,
and a view of this environment with only what that machine will have.

The target is described by its package list (``pip list --format freeze`` written there;
``--target-packages``, default the example ``benchmarks/gpu_device_packages.txt``: Python 3.12.3,
torch 2.11, transformers 5.17, no vLLM / Ray / DeepSpeed / megatron-core / TE / flash-attn) and its
CPython tag (``--python-tag``, default cp312). It installs the kit with ``pip install --no-index
--no-deps --target``; at most 64 MiB travel with the working tree.

    python benchmarks/gpu_kit.py build [--out .whl]     # download / build the wheels (cached by kit.json)
    python benchmarks/gpu_kit.py check [--out .whl]     # tags (cp312, manylinux x86_64), one version each, size
    python benchmarks/gpu_kit.py device-view [--record imports.json] -- SCRIPT ARGS...
                                                     # run SCRIPT seeing only the device's packages + the kit

* **build** downloads, for Python 3.12 / manylinux x86_64 and without dependencies, the version of
  each :data:`KIT` distribution that is installed here (the pins of requirements/constraints-cpu.txt,
  so the CPU rehearsal runs the same code), and builds DeepSpeed (no wheel on PyPI) as a portable
  ``py3-none-any`` wheel in pip's isolated build with ``DS_BUILD_OPS=0`` (its CUDA ops are compiled
  just in time on the GPU, from the sources the wheel carries). ``kit.json`` records what was built;
  a later build with the same list reuses the folder.
* **check** reads every wheel's tags with ``packaging`` (no network) against what a CPython 3.12
  x86_64 pip accepts (``manylinux`` up to glibc 2.39, the glibc of Python 3.12.3's Ubuntu 24.04:
  an assumption; the device notes do not name the glibc), one version per distribution, and the
  size of the kit plus the working tree that travels (``git ls-files -co --exclude-standard``).
* **device-view** runs a script under ``python -S`` with ``sys.path`` = the repository + a folder
  of links to the installed files of the distributions in ``gpu_device_packages.txt`` or the kit
  (nothing else; their ``.dist-info`` too, so version look-ups see the same set), and with the
  standard-library modules Python 3.12 removed made unimportable (``distutils`` then comes from
  setuptools' shim, as on the device, whose setuptools installs ``distutils-precedence.pth``). ``--record`` writes which
  top-level modules were imported and from where. What it cannot show: the device's *versions*
  (torch 2.11, transformers 5.17 there; this environment's torch / transformers here).
  ``GPU_KIT_OVERLAY=DIR[:DIR]`` puts folders of unpacked wheels first (a way to try e.g. the
  device's transformers; a record then shows their modules as ``elsewhere``); ``GPU_KIT_SITE=DIR``
  runs DIR's ``sitecustomize`` first, as Python does for a folder on ``PYTHONPATH``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: an example target: a lent H100 / H200 machine (Python 3.12, torch 2.11, transformers 5.17, no network)
EXAMPLE_PACKAGES = os.path.join(ROOT, "benchmarks", "gpu_device_packages.txt")
#: the target: its package list (``pip list --format freeze`` run there) and its Python tag; set by
#: ``--target-packages`` / ``--python-tag`` (passed on to child processes through the environment)
DEVICE_PACKAGES = os.environ.get("GPU_KIT_TARGET_PACKAGES") or EXAMPLE_PACKAGES
DEFAULT_OUT = os.path.join(ROOT, ".whl")
LIMIT_BYTES = 64 * 2**20          # what travels with one device command: working tree + carried paths
PYTHON_TAG = os.environ.get("GPU_KIT_PYTHON_TAG") or "cp312"


def parse_python_tag(tag: str) -> Tuple[int, int]:
    m = re.fullmatch(r"cp3(\d{1,2})", tag.strip())
    if not m:
        raise KitError(f"--python-tag {tag!r}: give the target's CPython tag, e.g. cp312 for Python 3.12 "
                       "(python -c 'import sys; print(f\"cp{sys.version_info[0]}{sys.version_info[1]}\")' there)")
    return 3, int(m.group(1))


def set_target(packages: Optional[str] = None, python_tag: Optional[str] = None) -> None:
    """Describe the target machine (defaults: the example list, cp312); child processes inherit it."""
    global DEVICE_PACKAGES, PYTHON_TAG, DEVICE_PYTHON
    if packages:
        if not os.path.isfile(packages):
            raise KitError(f"--target-packages {packages}: no such file; write it on the target with "
                           "`python -m pip list --format freeze > packages.txt` and bring it here")
        DEVICE_PACKAGES = os.path.abspath(packages)
        os.environ["GPU_KIT_TARGET_PACKAGES"] = DEVICE_PACKAGES
    if python_tag:
        parse_python_tag(python_tag)
        PYTHON_TAG = python_tag.strip()
        os.environ["GPU_KIT_PYTHON_TAG"] = PYTHON_TAG
    DEVICE_PYTHON = parse_python_tag(PYTHON_TAG)


MAX_GLIBC = 39                     # manylinux_2_N accepted up to N (assumed Ubuntu 24.04, glibc 2.39)
REMOVED_IN_312 = ("distutils", "imp", "asynchat", "asyncore", "smtpd")  # distutils: see _exec_in_view

#: distribution -> why the bench needs it (versions: the ones installed here)
KIT: Dict[str, str] = {
    "deepspeed": "the DeepSpeed ZeRO-2 actor step (OpenRLHF's strategy); built here, no wheel on PyPI",
    "openrlhf": "OpenRLHF's Actor, DeepspeedStrategy and ActorPPOTrainer (installed without its dependencies)",
    "pydantic": "DeepSpeed's config classes",
    "pydantic-core": "pydantic's compiled core (cp312 manylinux wheel)",
    "annotated-types": "pydantic",
    "typing-inspection": "pydantic",
    "hjson": "DeepSpeed's config reader",
    "torchdata": "OpenRLHF's StatefulDataLoader (imported by openrlhf.utils)",
    "pylatexenc": "openrlhf.utils.math_utils (imported by openrlhf.utils at import time)",
    "megatron-core": "the Megatron actor (cp312 manylinux wheel; no Transformer Engine: local layer spec)",
}
BUILT_FROM_SOURCE = ("deepspeed",)


class KitError(RuntimeError):
    """The kit could not be built or does not fit the device; the message says what to do."""


DEVICE_PYTHON = parse_python_tag(PYTHON_TAG)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def device_packages(path: Optional[str] = None) -> Dict[str, Optional[str]]:
    """``{normalised name: version or None}`` of the target machine (its package list file)."""
    out: Dict[str, Optional[str]] = {}
    with open(path or DEVICE_PACKAGES) as fh:
        for line in fh:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name, _, version = line.partition("==")
            out[norm(name)] = version.strip() or None
    return out


def kit_spec() -> List[str]:
    """``name==version`` of every kit distribution the target lacks, the versions installed here."""
    from importlib import metadata

    spec = []
    on_target = device_packages()
    for name in KIT:
        if norm(name) in on_target:
            continue
        try:
            spec.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            raise KitError(f"{name} is not installed in this environment ({sys.executable}); the kit carries the "
                           "version installed here. Install the CPU stack first (bash scripts/setup_env.sh)") from None
    return spec


# ------------------------------------------------------------------ build
def _platform_args() -> List[str]:
    plats = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"]
    plats += [f"manylinux_2_{n}_x86_64" for n in range(5, MAX_GLIBC + 1)]
    return [a for p in plats for a in ("--platform", p)]


def _pip(args: List[str], what: str, env: Optional[dict] = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if r.returncode != 0:
        tail = (r.stderr or r.stdout)[-2500:]
        raise KitError(f"could not {what} (pip exited {r.returncode}). The kit is fetched from PyPI once and then "
                       f"cached in the output folder: run where PyPI is reachable, or copy a built .whl/ here.\n"
                       f"command: {' '.join(cmd)}\n{tail}")


def _manifest_path(out: str) -> str:
    return os.path.join(out, "kit.json")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _target_id() -> str:
    """The target's package list (its content) and Python tag: a changed target rebuilds the kit."""
    with open(DEVICE_PACKAGES, "rb") as fh:
        return f"{PYTHON_TAG}:{hashlib.sha256(fh.read()).hexdigest()[:16]}"


def cached(out: str, spec: Optional[List[str]] = None) -> bool:
    """True when ``out`` holds a complete kit for ``spec`` (its manifest and every wheel unchanged)."""
    spec = spec or kit_spec()
    try:
        with open(_manifest_path(out)) as fh:
            man = json.load(fh)
    except (OSError, ValueError):
        return False
    if man.get("spec") != spec or man.get("python") != "%d.%d" % DEVICE_PYTHON or man.get("target") != _target_id():
        return False
    files = man.get("files", {})
    present = sorted(f for f in os.listdir(out) if f.endswith(".whl"))
    if present != sorted(files):
        return False
    return all(os.path.getsize(os.path.join(out, f)) == v["bytes"] for f, v in files.items())


def build(out: str = DEFAULT_OUT, force: bool = False) -> Dict:
    """Download / build the kit into ``out`` (reused when :func:`cached`); returns the manifest."""
    spec = kit_spec()
    os.makedirs(out, exist_ok=True)
    if not force and cached(out, spec):
        with open(_manifest_path(out)) as fh:
            return json.load(fh)
    for f in os.listdir(out):
        if f.endswith((".whl", ".tar.gz")) or f == "kit.json":
            os.remove(os.path.join(out, f))
    binary = [s for s in spec if norm(s.split("==")[0]) not in BUILT_FROM_SOURCE]
    _pip(["download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "%d.%d" % DEVICE_PYTHON,
          "--implementation", "cp", *_platform_args(), "-d", out, *binary],
         f"download {len(binary)} wheels for {PYTHON_TAG} / manylinux x86_64 ({', '.join(binary)})")
    for s in spec:
        if norm(s.split("==")[0]) in BUILT_FROM_SOURCE:
            with tempfile.TemporaryDirectory() as tmp:
                # pip's isolated build; DS_BUILD_OPS=0: no compiled op, a py3-none-any wheel
                _pip(["wheel", "-q", "--no-deps", "--no-binary", s.split("==")[0], "-w", tmp, s],
                     f"build a portable wheel of {s}", env={"DS_BUILD_OPS": "0"})
                for f in os.listdir(tmp):
                    shutil.move(os.path.join(tmp, f), os.path.join(out, f))
    files = {f: {"bytes": os.path.getsize(os.path.join(out, f)), "sha256": _sha256(os.path.join(out, f))}
             for f in sorted(os.listdir(out)) if f.endswith(".whl")}
    man = {"spec": spec, "python": "%d.%d" % DEVICE_PYTHON, "target": _target_id(), "files": files,
           "why": {k: v for k, v in KIT.items()}}
    with open(_manifest_path(out), "w") as fh:
        json.dump(man, fh, indent=2)
    return man


# ------------------------------------------------------------------ check
def device_tags():
    """The tags a CPython 3.12 pip on manylinux x86_64 (glibc <= 2.39) installs."""
    from packaging import tags

    plats = [f"manylinux_2_{n}_x86_64" for n in range(MAX_GLIBC, 4, -1)]
    plats += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    out = set(tags.cpython_tags(python_version=DEVICE_PYTHON, abis=[f"cp{DEVICE_PYTHON[0]}{DEVICE_PYTHON[1]}", "abi3", "none"], platforms=plats))
    out |= set(tags.compatible_tags(python_version=DEVICE_PYTHON, interpreter=f"cp{DEVICE_PYTHON[0]}{DEVICE_PYTHON[1]}", platforms=plats))
    return out


def travelling_bytes(root: str = ROOT) -> int:
    """Bytes of the working tree that a device command carries (tracked + untracked-not-ignored)."""
    r = subprocess.run(["git", "-C", root, "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True,
                       check=True)
    total = 0
    for rel in r.stdout.decode().split("\0"):
        p = os.path.join(root, rel)
        if rel and os.path.isfile(p) and not os.path.islink(p):
            total += os.path.getsize(p)
    return total


def check(out: str = DEFAULT_OUT, root: str = ROOT, limit: int = LIMIT_BYTES) -> Dict:
    """Problems of the kit in ``out`` (raises :class:`KitError` listing all); returns a summary."""
    from packaging.utils import parse_wheel_filename

    ok_tags = device_tags()
    wheels = sorted(f for f in os.listdir(out) if f.endswith(".whl")) if os.path.isdir(out) else []
    problems, seen = [], {}
    for f in wheels:
        name, version, _, wtags = parse_wheel_filename(f)
        if not set(wtags) & ok_tags:
            problems.append(f"{f}: tags {sorted(str(t) for t in wtags)} do not install on {PYTHON_TAG} / "
                            f"manylinux x86_64")
        if name in seen:
            problems.append(f"two versions of {name}: {seen[name]} and {version} (pip --target refuses the install)")
        seen[name] = str(version)
    missing = [s for s in kit_spec() if norm(s.split("==")[0]) not in seen]
    problems += [f"no wheel for {s}: run `python benchmarks/gpu_kit.py build`" for s in missing]
    for s in kit_spec():
        n, v = s.split("==")
        if norm(n) in seen and seen[norm(n)] != v:
            problems.append(f"{n}: the kit has {seen[norm(n)]}, this environment {v} (rebuild the kit)")
    dev = device_packages()
    problems += [f"{n} is already on the target ({DEVICE_PACKAGES}): carrying it risks a second version"
                 for n in seen if n in dev]
    kit_bytes = sum(os.path.getsize(os.path.join(out, f)) for f in wheels)
    tree = travelling_bytes(root)
    if kit_bytes + tree > limit:
        problems.append(f"kit {kit_bytes / 2**20:.1f} MiB + working tree {tree / 2**20:.1f} MiB = "
                        f"{(kit_bytes + tree) / 2**20:.1f} MiB, over the {limit / 2**20:.0f} MiB a device command carries")
    if problems:
        raise KitError("the GPU kit in %s is not ready:\n  - %s" % (out, "\n  - ".join(problems)))
    return {"wheels": {n: v for n, v in seen.items()}, "kit_mib": kit_bytes / 2**20, "tree_mib": tree / 2**20,
            "total_mib": (kit_bytes + tree) / 2**20, "limit_mib": limit / 2**20}


# ------------------------------------------------------------------ device view
def _site_dirs() -> List[str]:
    import sysconfig

    out = []
    for key in ("purelib", "platlib"):
        p = os.path.realpath(sysconfig.get_paths()[key])
        if p not in out:
            out.append(p)
    return out


def allowed_distributions() -> Dict[str, str]:
    """``{normalised name: 'device' | 'kit'}``."""
    out = {n: "device" for n in device_packages()}
    out.update({norm(n): "kit" for n in KIT})
    return out


def _entries_by_dist(site: str) -> Dict[str, Dict[str, List[str]]]:
    """``{top-level entry: {normalised dist: [second-level entries]}}`` of one site-packages folder."""
    from importlib import metadata

    entries: Dict[str, Dict[str, List[str]]] = {}
    for dist in metadata.distributions(path=[site]):
        name = norm(dist.metadata["Name"] or "")
        for f in dist.files or ():
            parts = f.parts
            if not parts or parts[0] in ("..", "__pycache__") or parts[0].endswith(".pth"):
                continue
            second = parts[1] if len(parts) > 2 else None
            seconds = entries.setdefault(parts[0], {}).setdefault(name, [])
            if second and second not in seconds:
                seconds.append(second)
    return entries


def make_device_view(dest: str) -> Dict[str, str]:
    """Fill ``dest`` with links to the installed files of the allowed distributions; returns
    ``{top-level entry: distribution}``. A folder shared by several distributions (a namespace
    package) gets a real folder with links to the allowed distributions' entries only."""
    allowed = allowed_distributions()
    os.makedirs(dest, exist_ok=True)
    owner: Dict[str, str] = {}
    for site in _site_dirs():
        for top, dists in _entries_by_dist(site).items():
            src = os.path.join(site, top)
            if not os.path.exists(src) or os.path.lexists(os.path.join(dest, top)):
                continue
            ok = [d for d in dists if d in allowed]
            if not ok:
                continue
            if len(dists) == 1 or set(ok) == set(dists) or not os.path.isdir(src):
                os.symlink(src, os.path.join(dest, top))
            else:
                os.makedirs(os.path.join(dest, top))
                for d in ok:
                    for second in dists[d]:
                        s = os.path.join(src, second)
                        if os.path.exists(s) and not os.path.lexists(os.path.join(dest, top, second)):
                            os.symlink(s, os.path.join(dest, top, second))
            owner[top] = ",".join(sorted(ok))
    return owner


class _Removed312:
    """Meta-path finder: the standard-library modules Python 3.12 no longer has."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname in REMOVED_IN_312:  # top level only: distutils' submodules come from setuptools' copy
            raise ModuleNotFoundError(f"No module named {fullname!r} (removed in Python 3.12, the GPU machine's "
                                      "Python)", name=fullname)
        return None


def _record_imports(path: str, view: str, owner: Dict[str, str]) -> None:
    mods = {}
    std = set(sys.stdlib_module_names) | set(sys.builtin_module_names)
    for name, mod in list(sys.modules.items()):
        top = name.partition(".")[0]
        if top in mods or mod is None:
            continue
        f = getattr(mod, "__file__", None) or ""
        paths = list(getattr(mod, "__path__", []) or [])
        where = f or (paths[0] if paths else "")
        if (top in std or top.startswith("_sysconfigdata")) and not where.startswith(view):
            src = "stdlib"
        elif where.startswith(view + os.sep):
            entry = os.path.relpath(where, view).split(os.sep)[0]
            dist = owner.get(entry) or owner.get(top, "?")
            src = "kit:" + dist if any(norm(d) in {norm(k) for k in KIT} for d in dist.split(",")) else "device:" + dist
        elif where.startswith(ROOT + os.sep):
            src = "repo"
        elif getattr(mod, "__openrlhf_div_stub__", False) or getattr(mod, "__openrlhf_div_standin__", False):
            src = "stub"
        elif not where:
            src = "in-memory"
        else:
            src = "elsewhere:" + where
        mods[top] = src
    with open(path, "w") as fh:
        json.dump(mods, fh, indent=1, sort_keys=True)


def _exec_in_view(view: str, record: Optional[str], argv: List[str]) -> None:
    """(Runs under ``python -S``.) Make ``view`` + the repository the whole path, run ``argv``."""
    import atexit
    import runpy

    with open(os.path.join(view, ".owner.json")) as fh:
        owner = json.load(fh)
    stdlib = [p for p in sys.path if p and "site-packages" not in p and not p.startswith(ROOT)]
    script_dir = os.path.dirname(os.path.abspath(argv[0]))
    # GPU_KIT_OVERLAY: folders of unpacked wheels put before the view, to try the device's versions
    # of pure-Python packages (e.g. transformers 5.17 with its tokenizers); not used by default
    overlay = [p for p in os.environ.get("GPU_KIT_OVERLAY", "").split(os.pathsep) if p]
    sys.path[:] = [script_dir, ROOT, *overlay, view] + stdlib
    sys.meta_path.insert(0, _Removed312())
    # Python 3.12 has no distutils; setuptools' distutils-precedence.pth (processed at start-up on the
    # device, where setuptools is installed) maps `import distutils` to setuptools._distutils.
    # DeepSpeed's op builder imports distutils at module level, so do what that .pth does.
    if "setuptools" in device_packages():
        import _distutils_hack

        _distutils_hack.add_shim()
    os.environ["OPENRLHF_DIV_DEVICE_VIEW"] = view
    # GPU_KIT_SITE: a folder whose sitecustomize runs here first, as Python's site module would run it
    # from PYTHONPATH without -S (gpu_bench.sh --dry-run: the CPU seams of the end-to-end tests)
    site_dir = os.environ.get("GPU_KIT_SITE")
    if site_dir:
        sys.path.insert(2, site_dir)
        import sitecustomize  # noqa: F401  (imported for what it runs)
    if record:
        atexit.register(_record_imports, record, view, owner)
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


def device_view_command(argv: List[str], view: Optional[str] = None, record: Optional[str] = None) -> List[str]:
    """The command that runs ``argv`` (a script and its arguments) in a fresh device view."""
    view = view or tempfile.mkdtemp(prefix="gpu_device_view_")
    owner = make_device_view(view)
    with open(os.path.join(view, ".owner.json"), "w") as fh:
        json.dump(owner, fh)
    cmd = [sys.executable, "-S", os.path.abspath(__file__), "_exec", view]
    if record:
        cmd += ["--record", os.path.abspath(record)]
    return cmd + ["--", *argv]


# ------------------------------------------------------------------ CLI
def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_exec"]:  # internal: under python -S
        view, rest = argv[1], argv[2:]
        record = None
        if rest[:1] == ["--record"]:
            record, rest = rest[1], rest[2:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        _exec_in_view(view, record, rest)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download / build the wheels (reused when kit.json matches)")
    b.add_argument("--out", default=DEFAULT_OUT)
    b.add_argument("--force", action="store_true")
    c = sub.add_parser("check", help="tags, one version each, size with the working tree")
    c.add_argument("--out", default=DEFAULT_OUT)
    v = sub.add_parser("device-view", help="run a script seeing only the device's packages + the kit")
    for x in (b, c, v):
        x.add_argument("--target-packages", metavar="FILE",
                       help="the target's `pip list --format freeze` (default: the example, "
                            "benchmarks/gpu_device_packages.txt)")
        x.add_argument("--python-tag", metavar="TAG", help="the target's CPython tag (default cp312)")
    v.add_argument("--record", help="write the imported top-level modules and their origin (JSON)")
    v.add_argument("script", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    try:
        set_target(a.target_packages, a.python_tag)
        if a.cmd == "build":
            man = build(a.out, force=a.force)
            mib = sum(f["bytes"] for f in man["files"].values()) / 2**20
            print(f"[gpu_kit] {len(man['files'])} wheels, {mib:.1f} MiB in {a.out}")
            print(json.dumps(check(a.out), indent=1))
        elif a.cmd == "check":
            print(json.dumps(check(a.out), indent=1))
        else:
            script = [s for s in a.script if s != "--"] if a.script[:1] == ["--"] else a.script
            if not script:
                p.error("device-view needs a script to run")
            view = tempfile.mkdtemp(prefix="gpu_device_view_")
            try:
                return subprocess.call(device_view_command(script, view=view, record=a.record))
            finally:
                shutil.rmtree(view, ignore_errors=True)
    except KitError as exc:
        print(f"[gpu_kit] {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
