"""An experiment rendered into the Ray driver's flags: a YAML file (``configs/openrlhf/*.yaml``,
read by the one loader :mod:`openrlhf_div.config`: ``extends:``, ``${VAR:-default}``) holds
``method:`` / ``task:`` (``--div.*``), ``layout:`` (:mod:`openrlhf_div.engines.layout`),
``openrlhf:`` (OpenRLHF flags by dotted name), ``cluster:`` (nodes x GPUs it must fit) and
``env:``; :func:`config_argv` turns the sections into flags, :func:`config_values` gives the
method's hyperparameters as the file holds them, :func:`split_overrides` / :func:`_split_config`
pick ``section.key=value`` and ``--config`` out of a command line, :func:`apply_config_env` puts
``env:`` into the process's environment.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Sequence

from openrlhf_div.config import expand_env, load_experiment

from ..flags import EXPLICIT_NONE, METHOD_KEYS_IN_DIV, hparam_table
from ..layout import LAYOUT_KEYS, deprecation, layout_argv


def _flag_values(prefix: str, key: str, value, bool_values: bool = False) -> List[str]:
    """One config entry as flags. OpenRLHF's booleans are store_true switches (``true`` -> the
    bare flag, ``false`` -> nothing); ours take a value (``bool_values``)."""
    flag = f"--{prefix}{key}"
    if isinstance(value, bool) and bool_values:
        return [flag, "true" if value else "false"]
    if value is None or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, (list, tuple)):
        return [flag] + [expand_env(str(v)) for v in value]
    if isinstance(value, dict):
        raise ValueError(f"config key {prefix}{key}: nested mappings are not flags; use dotted keys")
    return [flag, expand_env(str(value))]


#: an experiment config through the one loader (YAML only; see openrlhf_div.config)
load_config = load_experiment


def config_argv(cfg: Dict[str, Any], method_values: bool = True) -> List[str]:
    """The flags a config stands for: ``method:`` (name + hyperparameters) and ``task:`` ->
    ``--div.method`` / ``--div.<key>`` / ``--div.task``, ``div:`` -> ``--div.*`` (its method keys and
    task: the old spelling, read with a one-line deprecation), ``layout:`` -> ``--engine.*``
    (:mod:`openrlhf_div.engines.layout`), ``openrlhf:`` -> ``--<key>``. A layout key
    still under ``div:`` is read as ``layout.<key>`` with a one-line deprecation.

    ``method_values=False``: the method's hyperparameters (and aggregation, dynamic_sampling) are
    left out; :func:`plan` puts them into the parsed namespace as the values the file holds
    (:func:`config_values`), so that a value is converted once, by the registry's
    ``coerce_hparam``, not rendered to text and parsed again. The rendered form stays the
    printed command's."""
    from openrlhf_div.schema import refuse_on_ray

    refused = refuse_on_ray(cfg)
    if refused:  # a setting of the schema with no OpenRLHF flag: refused, never dropped
        raise ValueError(f"config: {refused}")
    argv: List[str] = []
    hparams = hparam_table()
    method = dict(cfg.get("method") or {})
    method_argv: List[str] = []  # after div:'s flags: the new spelling wins (argparse keeps the last)
    if "name" in method:
        method_argv += ["--div.method", str(method.pop("name"))]
    if cfg.get("task"):
        method_argv += ["--div.task", str(cfg["task"])]
    for k, v in method.items():  # the method section: its hyperparameters, as --div.<key>
        if not method_values and k in METHOD_KEYS_IN_DIV():
            continue  # any other key is rendered: argparse refuses a typo, a layout key is read with its deprecation
        if v is None and k in hparams:
            method_argv += [f"--div.{k}", EXPLICIT_NONE]
        else:
            method_argv += _flag_values("div.", k, v, bool_values=True)
    div = cfg.get("div") or {}
    new = dict(cfg.get("method") or {}, **({"task": cfg["task"]} if cfg.get("task") else {}))
    for k, v in div.items():  # both spellings in one (merged) experiment must agree
        nk = "name" if k == "method" else k
        if nk in new and new[nk] != v and (k in ("method", "task") or k in METHOD_KEYS_IN_DIV()):
            where = "task" if k == "task" else f"method.{nk}"
            raise ValueError(f"config: div.{k}={v} and {where}={new[nk]} (one experiment, two spellings, e.g. a file "
                             f"in the old spelling over a base in the new one); write {where} only")
    old = [k for k in div if k == "method" or k == "task" or k in METHOD_KEYS_IN_DIV()]
    if old:
        print(deprecation(", ".join(f"div.{k}" for k in old),
                          ", ".join("method.name" if k == "method" else "task" if k == "task" else f"method.{k}"
                                    for k in old)), file=sys.stderr)
    layout = dict(cfg.get("layout") or {})
    unknown = sorted(set(layout) - set(LAYOUT_KEYS))
    if unknown:
        raise ValueError(f"config section `layout`: unknown key(s) {unknown}; the OpenRLHF driver reads "
                         f"{sorted(LAYOUT_KEYS)} there")
    for k, v in (cfg.get("div") or {}).items():
        if k in LAYOUT_KEYS:
            print(deprecation(f"div.{k}", f"layout.{k}"), file=sys.stderr)
            layout.setdefault(k, v)
            continue
        if not method_values and k in METHOD_KEYS_IN_DIV():
            continue
        if v is None and k in hparams:  # `dual_clip: null`: the method gets None, not its default
            argv += [f"--div.{k}", EXPLICIT_NONE]
            continue
        argv += _flag_values("div.", k, v, bool_values=True)
    argv += method_argv + layout_argv(layout)
    for k, v in (cfg.get("openrlhf") or {}).items():
        argv += _flag_values("", k, v)
    return argv


def config_values(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """``{namespace dest: value}`` of an experiment's method hyperparameters (and aggregation,
    dynamic_sampling) as its file (and ``section.key=value`` overrides, through the one loader)
    hold them: put into the driver's namespace as they are, converted once by the method
    (``Method.with_overrides`` -> ``coerce_hparam``). An explicit null is :data:`EXPLICIT_NONE`."""
    from openrlhf_div.engines.experiment import method_section

    out: Dict[str, Any] = {}
    for k, v in method_section(cfg).items():
        if k == "name" or k not in METHOD_KEYS_IN_DIV():
            continue
        out[f"div.{k}"] = EXPLICIT_NONE if v is None else (list(v) if isinstance(v, tuple) else v)
    return out


def _given(argv: Sequence[str], dest: str) -> bool:
    flag = "--" + dest
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def split_overrides(argv: Sequence[str]):
    """``(overrides, rest)``: the ``section.key=value`` items of a driver's command line (a section
    of an experiment file: ``method.anchor_eta=0.3``, ``openrlhf.train.batch_size=64``), merged
    into the experiment by the one loader, and everything else."""
    import re

    from openrlhf_div.config import EXPERIMENT_SECTIONS, RENAMED_SECTIONS

    over, rest = [], []
    for a in argv:
        m = re.match(r"^([A-Za-z_]+)(\.[^=\s]+)?=", a)
        (over if m and (m.group(1) in EXPERIMENT_SECTIONS or m.group(1) in RENAMED_SECTIONS) else rest).append(a)
    return over, rest


def _split_config(argv: Sequence[str]):
    """Pull ``--config PATH`` / ``--config=PATH`` out of argv."""
    rest, path = [], None
    it = iter(range(len(argv)))
    for i in it:
        tok = argv[i]
        if tok == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config needs a path")
            path = argv[i + 1]
            next(it, None)
        elif tok.startswith("--config="):
            path = tok.split("=", 1)[1]
        else:
            rest.append(tok)
    return path, rest


def apply_config_env(cfg_or_env) -> None:
    """A config's ``env:`` section into this process's environment (a variable already set wins);
    ``OPENRLHF_DIV_*`` ones then reach every Ray worker (:func:`~.jobs.task_env`)."""
    env = cfg_or_env.get("env") if isinstance(cfg_or_env.get("env"), dict) else cfg_or_env
    for k, v in (env or {}).items():
        os.environ.setdefault(str(k), str(v))
