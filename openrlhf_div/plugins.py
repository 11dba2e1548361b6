"""Plug-ins: the user's own modules that register methods, components or tasks.

A method registered in a module of your own (``register_method``, ``register_policy_loss``,
``register_task``, ...) exists only in the processes that import that module. This is the one
hook that imports it everywhere a method is resolved:

* ``openrlhf-div --plugin my_pkg.methods train ...`` (repeatable; anywhere on the command line),
  and the Ray driver (``python -m openrlhf_div.cli.train_ppo_ray --plugin ...``, also
  ``presample_ray``), and an experiment file's ``plugins: [...]`` list (module names or ``.py``
  paths relative to the file; every engine reads it: :func:`config_plugins`);
* ``OPENRLHF_DIV_PLUGINS=my_pkg.methods,other.module``: read by every process that resolves a
  method (:func:`load_plugins` is called by the local engine and by
  :func:`openrlhf_div.engines.flags.method_from_args`, which the OpenRLHF driver, its policy,
  reference and trainer actors and the Megatron actors all use). The command-line plug-ins are
  added to this variable, and the launchers hand every ``OPENRLHF_DIV_*`` variable to the Ray
  workers (:mod:`openrlhf_div.engines.openrlhf.jobs`), so a worker imports what the driver did.

A plug-in is a module name (importable on ``sys.path``, e.g. ``my_pkg.methods``) or the path of a
``.py`` file (relative paths are taken from the working directory: for ``ray job submit`` the
job's ``working_dir``). Importing one twice does nothing. Standard library only.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Iterable, List, Sequence, Tuple

ENV_VAR = "OPENRLHF_DIV_PLUGINS"
FLAG = "--plugin"

_loaded: List[str] = []


class PluginError(ValueError):
    """A plug-in could not be imported; the message names it and how it was looked up."""


def _split(value: str) -> List[str]:
    return [p.strip() for p in value.replace(";", ",").split(",") if p.strip()]


def from_env() -> List[str]:
    """The plug-ins named by ``OPENRLHF_DIV_PLUGINS`` (comma-separated)."""
    return _split(os.environ.get(ENV_VAR, ""))


def _is_file(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec or "/" in spec


def _import(spec: str) -> None:
    if _is_file(spec):
        path = os.path.abspath(os.path.expanduser(spec))
        if not os.path.isfile(path):
            raise PluginError(f"plug-in {spec!r}: no such file ({path}); pass a module name on sys.path or the "
                              f"path of a .py file (via {FLAG} or {ENV_VAR})")
        name = "openrlhf_div_plugin_" + "".join(c if c.isalnum() else "_" for c in os.path.splitext(path)[0])
        if name in sys.modules:
            return
        loader_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        try:
            loader_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return
    try:
        importlib.import_module(spec)
    except ModuleNotFoundError as exc:
        if exc.name and spec.startswith(exc.name):
            raise PluginError(f"plug-in {spec!r} cannot be imported: no module named {exc.name!r} on sys.path "
                              f"(working directory {os.getcwd()}); add its folder to PYTHONPATH or pass the "
                              f"path of its .py file") from exc
        raise


def load_plugins(specs: Iterable[str] = (), *, env: bool = True, export: bool = True) -> List[str]:
    """Import the plug-ins ``specs`` and (``env``) those of ``OPENRLHF_DIV_PLUGINS``, each once,
    in order; with ``export`` the given ones are appended to ``OPENRLHF_DIV_PLUGINS`` so child
    processes and Ray workers import them too. Returns every plug-in loaded so far."""
    specs = list(specs)
    todo = (from_env() if env else []) + specs
    for spec in todo:
        key = os.path.abspath(os.path.expanduser(spec)) if _is_file(spec) else spec
        if key in _loaded:
            continue
        _import(spec)
        _loaded.append(key)
    if export and specs:
        have = from_env()
        # a file travels as an absolute path: Ray workers need not share the driver's directory
        new = [os.path.abspath(os.path.expanduser(s)) if _is_file(s) else s for s in specs]
        os.environ[ENV_VAR] = ",".join(have + [s for s in new if s not in have])
    return list(_loaded)


def in_effect(specs: Iterable[str] = ()) -> List[str]:
    """The plug-ins a run depends on, to record in its run folder so that a resume loads them:
    ``specs`` (a config's ``plugins:``) then those of ``OPENRLHF_DIV_PLUGINS`` (where the
    ``--plugin`` ones of the command line are), each once; a file as an absolute path."""
    out: List[str] = []
    for spec in [specs] if isinstance(specs, str) else list(specs or ()):
        key = os.path.abspath(os.path.expanduser(spec)) if _is_file(spec) else spec
        if key not in out:
            out.append(key)
    for spec in from_env():
        key = os.path.abspath(os.path.expanduser(spec)) if _is_file(spec) else spec
        if key not in out:
            out.append(key)
    return out


def config_plugins(value, config_path: str) -> List[str]:
    """The ``plugins:`` entry of an experiment file as plug-in specs: a list of module names or
    ``.py`` paths (one string is a list of one); a relative path is taken from the file's folder
    (as ``extends:`` is)."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) and v.strip() for v in items):
        raise PluginError(f"{config_path}: `plugins` takes a list of module names or .py paths, got {value!r}")
    here = os.path.dirname(os.path.abspath(config_path))
    return [os.path.normpath(os.path.join(here, v)) if _is_file(v) and not os.path.isabs(os.path.expanduser(v)) else v
            for v in items]


def split_plugin_args(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """``(plug-ins, the other arguments)`` of a command line: every ``--plugin X`` /
    ``--plugin=X`` is taken out, wherever it stands (before or after a subcommand)."""
    plugins: List[str] = []
    rest: List[str] = []
    it = iter(range(len(argv)))
    args = list(argv)
    for i in it:
        a = args[i]
        if a == FLAG:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise PluginError(f"{FLAG} needs a module name or a .py file")
            plugins.append(args[i + 1])
            next(it, None)
        elif a.startswith(FLAG + "="):
            plugins.append(a[len(FLAG) + 1:])
        else:
            rest.append(a)
    return plugins, rest
