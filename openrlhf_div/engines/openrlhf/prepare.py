"""What the launcher (``examples/scripts/run.sh``) does before a run, in one place:

``python -m openrlhf_div.engines.openrlhf.prepare CONFIG [--submit]`` prints ``export NAME=VALUE``
lines for the shell to ``eval``:

* **A new run folder.** ``RUN_DIR`` (when unset) becomes ``<repo>/runs/<experiment>/<timestamp>``:
  every run gets its own folder (its TensorBoard folder included); set ``RUN_DIR`` to reuse one
  (e.g. to resume with ``--ckpt.load_enable``).
* **Absolute paths.** Every other path variable of :data:`PATH_VARS` that the config uses with a
  relative default (``${DATA_DIR:-runs/tiny_cpu/data}``) and that is unset is exported as that
  default under the repository, so that a submitted job (which runs in Ray's copy of the
  repository) reads and writes the same files as a local run.
* **The config's ``env:`` section** (variables the experiment needs, e.g. the tiny model's
  ``OPENRLHF_DIV_MATH_EXTRACT: lenient``): exported unless already set.
* **The config's ``tiny:`` section** (``model:`` / ``data:`` paths): the tiny model and data
  built there on first use, cached afterwards (:mod:`.tiny_experiment`).

Exit status 2 with one line on stderr for a bad config.
"""
from __future__ import annotations

import datetime
import os
import re
import shlex
import sys
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

#: variables that name a path in the configs (``${VAR:-relative/default}``)
PATH_VARS = ("RUN_DIR", "DATA_DIR", "PRESAMPLE_DIR", "TINY_MODEL")
_DEFAULT = re.compile(r"\$\{([A-Z_][A-Z0-9_]*):-([^}]*)\}")


def _strings(node: Any) -> Iterable[str]:
    if isinstance(node, dict):
        for v in node.values():
            yield from _strings(v)
    elif isinstance(node, (list, tuple)):
        for v in node:
            yield from _strings(v)
    elif isinstance(node, str):
        yield node


def relative_defaults(cfg: Mapping[str, Any]) -> Dict[str, str]:
    """``{VAR: default}`` for each path variable used with one relative default throughout the
    config (a variable with two different defaults is left alone)."""
    seen: Dict[str, set] = {}
    for s in _strings(dict(cfg)):
        for name, default in _DEFAULT.findall(s):
            if name in PATH_VARS and default and not os.path.isabs(default):
                seen.setdefault(name, set()).add(default)
    return {k: next(iter(v)) for k, v in seen.items() if len(v) == 1}


def run_dir_default(repo: str, experiment: str, now: Optional[datetime.datetime] = None) -> str:
    """``<repo>/runs/<experiment>/<YYYYmmdd-HHMMSS>``, with ``-2``, ``-3`` ... when taken."""
    now = now or datetime.datetime.now()
    base = os.path.join(repo, "runs", experiment, now.strftime("%Y%m%d-%H%M%S"))
    path, i = base, 1
    while os.path.exists(path):
        i += 1
        path = f"{base}-{i}"
    return path


def exports(cfg: Mapping[str, Any], repo: str, experiment: str,
            environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The variables to export (none that ``environ`` already has)."""
    environ = os.environ if environ is None else environ
    out: Dict[str, str] = {}
    if "RUN_DIR" not in environ:
        out["RUN_DIR"] = run_dir_default(repo, experiment)
    for name, default in relative_defaults(cfg).items():
        if name not in environ and name not in out:
            out[name] = os.path.join(repo, default)
    for k, v in (cfg.get("env") or {}).items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(k)):
            raise ValueError(f"env: {k!r} is not a variable name")
        if k not in environ:
            out[str(k)] = str(v)
    return out


def ensure_tiny(cfg: Mapping[str, Any], environ: Mapping[str, str], repo: str, say=None) -> Dict[str, str]:
    """Build the ``tiny:`` section's model / data (paths expanded with ``environ``, relative to
    ``repo``) unless they exist."""
    from openrlhf_div.config import expand_env

    from .tiny_experiment import ensure

    tiny = cfg.get("tiny") or {}
    unknown = sorted(set(tiny) - {"model", "data", "n_prompts", "seed"})
    if unknown:
        from openrlhf_div.config import unknown_key

        raise unknown_key(unknown[0], ["model", "data", "n_prompts", "seed"], where="tiny")

    def path(key):
        v = tiny.get(key)
        if not v:
            return None
        v = expand_env(str(v), dict(environ))
        return v if os.path.isabs(v) else os.path.join(repo, v)
    return ensure(path("model"), path("data"), n_prompts=int(tiny.get("n_prompts", 8)),
                  seed=int(tiny.get("seed", 0)), say=say)


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    from openrlhf_div.config import load_experiment

    ap = argparse.ArgumentParser(prog="python -m openrlhf_div.engines.openrlhf.prepare",
                                 description="Print the exports of a run (new run folder, absolute paths, the "
                                             "config's env:) and build its tiny: model/data on first use.")
    ap.add_argument("config")
    ap.add_argument("--repo", default=os.getcwd())
    ap.add_argument("--experiment", default=None, help="default: the config's experiment: or file name")
    ap.add_argument("--no-build", action="store_true", help="print the exports only (dry runs)")
    a = ap.parse_args(argv)
    say = lambda msg: print(f"[openrlhf-div] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        cfg = load_experiment(a.config)
        experiment = a.experiment or str(cfg.get("experiment") or os.path.splitext(os.path.basename(a.config))[0])
        out = exports(cfg, os.path.abspath(a.repo), experiment)
        if cfg.get("tiny") and not a.no_build:
            # stdout carries only the exports (the shell evaluates it): anything the build prints,
            # from Python or from a library's C code, goes to stderr
            sys.stdout.flush()
            saved = os.dup(1)
            os.dup2(2, 1)
            try:
                ensure_tiny(cfg, {**os.environ, **out}, os.path.abspath(a.repo), say=say)
            finally:
                sys.stdout.flush()
                os.dup2(saved, 1)
                os.close(saved)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for k, v in out.items():
        print(f"export {k}={shlex.quote(v)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
