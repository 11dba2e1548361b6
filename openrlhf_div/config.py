"""The one config loader: YAML files with ``extends:``, dotted ``key=value`` overrides and
``${VAR:-default}`` variables. Every entry point reads its YAML through here: the local engine
(:mod:`openrlhf_div.engines.local.config`, which adds its dataclass schema), the demo
(:mod:`openrlhf_div.demo.pipeline`) and the OpenRLHF / Megatron drivers
(:mod:`openrlhf_div.engines.openrlhf.launch`, which turn the sections into flags). Each keeps
its own schema and validation; the loading is this module's.

* **Files.** A config is a YAML mapping. Malformed YAML, a duplicate key or a file that is not
  a mapping is a :class:`ConfigError` of one line naming ``file:line:column`` and the problem.
* **extends.** ``extends: base.yaml`` (or a list of files, merged in order) reads those files
  first, relative to the extending file, and deep-merges this file over them: mappings merge
  key by key, anything else (lists included) is replaced. Chains are followed; a cycle is an
  error that shows it. ``configs/openrlhf/llama8b_bird_dph_js.yaml`` is the family base
  ``_llama8b_bird.yaml`` plus the method's lines.
* **Overrides.** ``["train.optim.steps=50", "method.name=dph_js"]``: dotted keys, values read
  as YAML (``true``, ``1e-3``, ``[1, 4]``, ``null``), merged like a file over the config.
* **Numbers.** Files and overrides share one loader, which reads YAML 1.2's floats as floats:
  ``1e-3``, ``1E+5``, ``-.5`` (PyYAML's YAML 1.1 rules read an exponent without a dot and a
  sign as a string). Quote a value to keep it a string: ``"1e3"``.
* **Renamed sections.** ``engine:`` (the engines' micro-batch layout) is ``layout:``; the old name
  still loads, in a file or an override, with one stderr line (:func:`renamed_sections`).
* **Variables.** ``${VAR}`` and ``${VAR:-default}`` in strings read the environment
  (:func:`expand_env`); the drivers expand the values they turn into paths and flags. An unset
  variable without a default is an error naming it. ``${name}`` in lower case naming a
  top-level scalar of the config itself (``${experiment}``) is filled in at load time
  (:func:`interpolate_self`): ``${RUN_DIR:-runs/${experiment}}/ckpt``.

``python -m openrlhf_div.config FILE [key=value ...]`` prints a file's resolved mapping;
``--section NAME`` exits 0 when the resolved config has that section and 10 when it has not
(the launchers use it; any other status is an error).
"""
from __future__ import annotations

import copy
import os
import re
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import yaml

from openrlhf_div._config_base import ConfigError, expand_env, unknown_key  # noqa: F401 (re-exported)

Merge = Callable[[Dict[str, Any], Dict[str, Any]], Dict[str, Any]]




# ------------------------------------------------------------------ one file
class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing duplicate keys (PyYAML keeps the last one silently) and
    reading YAML 1.2's floats as floats (:data:`YAML12_FLOAT`). Every file and every
    ``key=value`` override goes through it (:func:`read_yaml`, :func:`yaml_value`)."""


#: the floats YAML 1.2 has and PyYAML's YAML 1.1 resolver reads as strings: an exponent without a
#: dot or without a sign (``1e-3``, ``1E+5``, ``2e5``, ``1.0e3``) and a signed leading dot
#: (``-.5``). Without it ``lr: 1e-3`` is the string "1e-3" on one path and 0.001 on another.
YAML12_FLOAT = re.compile(r"""^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+
                              |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?)$""", re.X)
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", YAML12_FLOAT, list("-+0123456789."))


def _mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> Dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: Dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key].line + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def _yaml_error(path: str, exc: yaml.YAMLError) -> ConfigError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    cmark = getattr(exc, "context_mark", None)
    if context and cmark is not None and mark is not None and cmark.line != mark.line:
        context = f"{context} at line {cmark.line + 1}"
    return ConfigError(f"{where}: malformed YAML: {problem}" + (f" ({context})" if context else ""))


def yaml_value(text: str) -> Any:
    """One YAML value (``key=value``'s right side) through the files' loader: ``1e-3`` is a float."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def read_yaml(path: str, what: str = "config") -> Dict[str, Any]:
    """One YAML file as a mapping (an empty file is ``{}``); no ``extends`` processing."""
    if not os.path.isfile(path):
        raise ConfigError(f"{what} file {path!r} does not exist")
    with open(path) as fh:
        try:
            data = yaml.load(fh, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as exc:
            raise _yaml_error(path, exc) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1:1: a {what} file holds a YAML mapping (key: value lines), "
                          f"got a {type(data).__name__}")
    return data


# ------------------------------------------------------------------ merging
def deep_merge(base: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    """``extra`` over ``base``: mappings merge key by key, anything else is replaced (copies)."""
    out = copy.deepcopy(base)
    for k, v in (extra or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _parents(path: str, data: Dict[str, Any]) -> List[str]:
    ext = data.pop("extends", None)
    if ext is None:
        return []
    items = ext if isinstance(ext, list) else [ext]
    if not all(isinstance(e, str) and e for e in items):
        raise ConfigError(f"{path}: `extends` takes a file name or a list of them, got {ext!r}")
    here = os.path.dirname(os.path.abspath(path))
    return [e if os.path.isabs(e) else os.path.join(here, e) for e in items]


# ------------------------------------------------------------------ renamed sections
#: a config section's old name -> its new one. ``engine:`` was the engines' micro-batch layout; "engine"
#: is the trainer (``run --engine``, run_info.json's ``engine``), so the layout is ``layout:``. The old
#: name still loads (a file, a ``engine.x=V`` override, a saved run config), with one stderr line.
RENAMED_SECTIONS = {"engine": "layout"}
_TOLD: set = set()


def renamed_sections(data: Dict[str, Any], merge: Merge = deep_merge) -> Dict[str, Any]:
    """``data`` (one file's mapping, parsed overrides, a config mapping) with each old section name of
    :data:`RENAMED_SECTIONS` moved to its new one (merged under a new-named section beside it: the new
    spelling wins), saying so on stderr once per process and name."""
    if not isinstance(data, dict) or not any(old in data for old in RENAMED_SECTIONS):
        return data
    data = dict(data)
    for old, new in RENAMED_SECTIONS.items():
        if old not in data:
            continue
        value = data.pop(old)
        if isinstance(value, dict) and isinstance(data.get(new), dict):
            value = merge(value, data[new])
        elif new in data:
            value = data[new]
        data[new] = value
        if old not in _TOLD:
            _TOLD.add(old)
            print(f"config section {old}: is now {new}: (same keys)", file=sys.stderr)
    return data


def read_with_extends(path: str, *, merge: Merge = deep_merge, what: str = "config",
                      transform: Optional[Callable[[Dict[str, Any], str], Dict[str, Any]]] = None,
                      _chain: tuple = ()) -> Dict[str, Any]:
    """``path`` merged over the files it ``extends`` (recursively, relative to each file); an old
    section name (:data:`RENAMED_SECTIONS`) is read as its new one, file by file;
    ``transform(mapping, path)`` is applied to each file on its own before the merge (the
    experiment files' neutral settings rendered into flags: :func:`openrlhf_div.schema.render_file`)."""
    real = os.path.realpath(path)
    if real in _chain:
        cycle = " -> ".join(os.path.relpath(p) for p in _chain + (real,))
        raise ConfigError(f"{path}: `extends` cycle: {cycle}")
    data = renamed_sections(read_yaml(path, what))
    out: Dict[str, Any] = {}
    for parent in _parents(path, data):
        if not os.path.isfile(parent):
            raise ConfigError(f"{path}: extends {os.path.relpath(parent)!r}, which does not exist")
        out = merge(out, read_with_extends(parent, merge=merge, what=what, transform=transform,
                                           _chain=_chain + (real,)))
    if transform is not None:
        data = transform(data, os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path)
    return merge(out, data)


def parse_overrides(overrides: Sequence[str], example: str = "method.name=dph_js") -> Dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> ``{"a": {"b": 1}, "c": "x"}`` (values parsed as YAML; an old section
    name (``engine.<key>=V``) is read as its new one: :data:`RENAMED_SECTIONS`)."""
    out: Dict[str, Any] = {}
    for item in overrides or ():
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. {example})")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not p for p in key.split(".")):
            raise ConfigError(f"override {item!r} has an empty key")
        try:
            val = yaml_value(raw) if raw.strip() != "" else ""
        except yaml.YAMLError:
            val = raw
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r} conflicts with an earlier override of {p!r}")
            node = nxt
        node[parts[-1]] = val
    return renamed_sections(out)


def load(path: Optional[str], overrides: Sequence[str] = (), *, merge: Merge = deep_merge,
         what: str = "config", example: str = "method.name=dph_js",
         transform: Optional[Callable[[Dict[str, Any], str], Dict[str, Any]]] = None) -> Dict[str, Any]:
    """A config file with its ``extends`` chain resolved and ``key=value`` overrides applied
    (``path`` None: the overrides alone). ``merge`` is the schema's merge rule (default
    :func:`deep_merge`); ``what`` names the kind of file in errors; ``transform``: see
    :func:`read_with_extends`."""
    data = read_with_extends(path, merge=merge, what=what, transform=transform) if path is not None else {}
    if overrides:
        data = merge(data, parse_overrides(overrides, example))
    return interpolate_self(data)


# ------------------------------------------------------------------ variables
_SELF = re.compile(r"\$\{([a-z_][a-z0-9_]*)\}")


def interpolate_self(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """``${name}`` (lower case) where ``name`` is a top-level scalar of the config itself is
    replaced by its value when the config is loaded, so that a family base can write
    ``ckpt.path: ${RUN_DIR:-runs/${experiment}}/ckpt`` once for all its experiments.
    Other ``${...}`` are left for :func:`expand_env`."""
    names = {k: v for k, v in cfg.items()
             if isinstance(k, str) and isinstance(v, (str, int, float)) and not isinstance(v, bool)}

    def walk(node):
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, str) and "${" in node:
            return _SELF.sub(lambda m: str(names[m.group(1)]) if m.group(1) in names else m.group(0), node)
        return node
    return walk(cfg) if names else cfg


def expand_tree(node: Any, environ: Optional[Dict[str, str]] = None) -> Any:
    """:func:`expand_env` on every string of a nested mapping / list (keys untouched)."""
    if isinstance(node, dict):
        return {k: expand_tree(v, environ) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [expand_tree(v, environ) for v in node]
    return expand_env(node, environ) if isinstance(node, str) else node


# ------------------------------------------------------------------ key checks
# ------------------------------------------------------------------ experiment configs
#: the sections of an OpenRLHF / Megatron experiment config (configs/openrlhf/*.yaml)
EXPERIMENT_SECTIONS = ("experiment", "description", "paper", "plugins", "task", "method", "div", "layout", "openrlhf",
                       "cluster", "presample", "toy", "notes", "env", "tiny", "local",
                       # the schema's own names (openrlhf_div.schema.NEUTRAL_SECTIONS)
                       "seed", "model", "data", "rollout", "optim", "eval", "checkpoint")


def load_experiment(path: str) -> Dict[str, Any]:
    """An experiment config (``extends:`` followed, so ``configs/openrlhf/<family>_<method>.yaml``
    is its family base plus the method's lines) with its sections checked; ``${VAR:-default}``
    is expanded later, where values become flags. Light on purpose (YAML only, no torch): the
    launchers call it in a fresh process before every job."""
    from openrlhf_div.schema import presample_folder, render_file

    key = os.path.realpath(path)
    hit = _READ.get(key)
    if hit is not None and all(_mtime(f) == m for f, m in hit[0]):
        return copy.deepcopy(hit[1])  # read once per process (while none of its files changed)
    files: List[str] = []
    cfg = load(path, what="experiment config", transform=_recording(render_file, files))
    for section in cfg:
        if section not in EXPERIMENT_SECTIONS:
            raise unknown_key(section, EXPERIMENT_SECTIONS, what=f"section in {path}:")
    presample_folder(cfg, path)  # one folder across the extends chain: the old presample.out = data.presample_dir
    _READ[key] = ([(f, _mtime(f)) for f in files], copy.deepcopy(cfg))
    return cfg


#: the experiments read in this process: realpath -> ([(file of its extends chain, mtime)], mapping)
_READ: Dict[str, Any] = {}


def _mtime(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _recording(transform, files: List[str]):
    def run(data: Dict[str, Any], where: str) -> Dict[str, Any]:
        files.append(os.path.realpath(where) if os.path.exists(where) else where)
        return transform(data, where)
    return run


#: exit status of ``--section NAME`` when the section is absent (1 is Python's own for a crash)
NO_SECTION = 10


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m openrlhf_div.config",
                                 description="Print a config file's resolved mapping (extends + overrides).")
    ap.add_argument("file")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    ap.add_argument("--section", help=f"print nothing; exit 0 when the resolved config has this section, "
                                      f"{NO_SECTION} when it has not (2: the config cannot be read)")
    a = ap.parse_args(argv)
    try:
        cfg = load(a.file, a.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if a.section:
        return 0 if a.section in cfg else NO_SECTION
    sys.stdout.write(yaml.safe_dump(cfg, sort_keys=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
