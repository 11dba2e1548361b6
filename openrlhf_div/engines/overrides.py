"""``section.key=value`` overrides checked before anything starts, with the same wording on every engine.

An override names a section of an experiment file (``method.anchor_eta=0.1``,
``layout.step_layout=spread``, ``openrlhf.train.batch_size=64``, ``presample.n_pre=4``,
``div.anchor_ratio=4``, ``task=math``). :func:`check_overrides` judges each against what reads it:

* ``method.*``: the method registry (the name, then each hyperparameter), worded as the local
  engine words it (``config section `method`: method 'dph_js' has no hyperparameter 'anchr_eta'.
  Did you mean 'anchor_eta', ...``);
* ``layout.*`` (the old ``engine.*`` read as it, :data:`openrlhf_div.config.RENAMED_SECTIONS`): the layout
  keys (:data:`openrlhf_div.engines.layout.LAYOUT_KEYS`);
* ``task``: the task registry;
* ``div.*``, ``openrlhf.*`` and dotted ``presample.*`` keys: the Ray driver's own parser (OpenRLHF's
  flags plus ``--div.*`` / ``--megatron.*``), when OpenRLHF is installed; plain ``presample.*``
  keys: the pre-sampling stage's options;
* an unknown section (``methd.anchor_eta=1``): the experiment sections.

:func:`openrlhf_div.engines.experiment.load` calls it whenever overrides are given, so the local
engine, the Ray drivers and ``openrlhf-div run`` refuse a typo in one line; the Ray launcher
(``examples/scripts/run.sh``) runs ``python -m openrlhf_div.engines.openrlhf.check_overrides CONFIG [flags...]``
before it starts a Ray head, a pre-sampling stage or a job.
"""
from __future__ import annotations

import difflib
import os
import re
from typing import Any, Callable, Dict, List, Optional, Sequence

from openrlhf_div.config import EXPERIMENT_SECTIONS, RENAMED_SECTIONS, ConfigError, unknown_key

#: a token that looks like an override: ``word.rest=value`` or ``word=value``
_OVERRIDE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)((?:\.[^=\s]+)?)=")


def _did_you_mean(key: str, valid: Sequence[str], shown: str) -> ConfigError:
    """``unknown <shown> 'key'. Did you mean ...?`` without listing hundreds of valid flags."""
    close = difflib.get_close_matches(key, list(valid), n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return ConfigError(f"unknown {shown} {key!r}.{hint}")


#: the Ray drivers' option names, from the layer that owns those parsers: ``engines.openrlhf.presample``
#: registers :func:`~openrlhf_div.engines.openrlhf.presample.driver_flag_names` when imported
#: (``openrlhf-div run``, the launcher's check and the pre-sampling driver import it; the training driver's
#: own parser refuses a flag in one line); this module sits below it
_DRIVER_FLAGS: Optional[Callable[[], List[str]]] = None


def register_driver_flags(provider: Callable[[], List[str]]) -> None:
    """Give :func:`check_overrides` the Ray driver's option names (without ``--``)."""
    global _DRIVER_FLAGS
    _DRIVER_FLAGS = provider


def _driver_flags() -> Optional[List[str]]:
    """The Ray driver's option names without ``--`` (OpenRLHF's, ``div.*``, ``megatron.*``,
    ``presample.*``); None when no Ray driver is known in this process or OpenRLHF's parser cannot be
    read here (no OpenRLHF installed)."""
    if _DRIVER_FLAGS is None:
        return None
    try:
        return _DRIVER_FLAGS()
    except (ImportError, RuntimeError, OSError):
        return None


def check_overrides(cfg: Dict[str, Any], overrides: Sequence[str], path: Optional[str] = None, *,
                    method_section: Callable[[Dict[str, Any]], Dict[str, Any]]) -> None:
    """Raise :class:`ConfigError` (one line naming the key and the closest valid ones) for the first
    override of ``overrides`` that nothing reads; ``cfg`` is the experiment with them merged;
    ``method_section``: :func:`openrlhf_div.engines.experiment.method_section` (passed in: the loader
    calls this module)."""
    items = [o.split("=", 1)[0].strip() for o in overrides if "=" in o]
    items = [RENAMED_SECTIONS.get(k.split(".", 1)[0], k.split(".", 1)[0]) + k[len(k.split(".", 1)[0]):]
             for k in items]  # engine.x: layout.x (the loader read it so)
    sections = {k.split(".", 1)[0] for k in items}
    for k in items:
        head = k.split(".", 1)[0]
        if head not in EXPERIMENT_SECTIONS and head != "local":  # local: the toy overlay's local-engine keys
            close = difflib.get_close_matches(head, EXPERIMENT_SECTIONS, n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(f"override {k!r}: unknown config section {head!r}.{hint} "
                              f"Sections: {', '.join(EXPERIMENT_SECTIONS)}")
    if cfg.get("plugins"):  # a plug-in's methods and tasks are valid names
        from openrlhf_div.plugins import config_plugins, load_plugins

        load_plugins(config_plugins(cfg["plugins"], path or os.getcwd()))
    if sections & {"method", "div", "plugins"}:
        _check_method(cfg, method_section)
    if "task" in sections and cfg.get("task"):
        from openrlhf_div.tasks import list_tasks

        name, valid = str(cfg["task"]), list_tasks()
        if name not in valid:  # tasks.get_task's wording
            close = difflib.get_close_matches(name, valid, n=3)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(f"unknown task {name!r}.{hint} Valid tasks: {', '.join(valid)}")
    from openrlhf_div.engines.layout import LAYOUT_KEYS

    flags: Optional[List[str]] = None
    for k in items:
        head, _, rest = k.partition(".")
        if not rest:
            continue
        if head == "layout" and rest not in LAYOUT_KEYS:
            raise unknown_key(k, LAYOUT_KEYS, where="layout")
        if head in ("div", "openrlhf", "presample"):
            if flags is None:
                flags = _driver_flags()
                if flags is None:
                    return  # no OpenRLHF here: the Ray sections are not read on this machine
            if head == "div" or (head == "presample" and "." not in rest):
                if k not in flags:  # --div.<key>, --presample.<key>
                    raise _did_you_mean(k, [f for f in flags if f.startswith(head + ".")], "key")
            elif rest not in flags:  # OpenRLHF's own flag (openrlhf.train.batch_size, presample.vllm.num_engines)
                raise _did_you_mean(k, [f"{head}.{f}" for f in flags], "key")


def _check_method(cfg: Dict[str, Any], method_section: Callable[[Dict[str, Any]], Dict[str, Any]]) -> None:
    """The experiment's method (name + hyperparameters) through the registry, as the local engine does."""
    from openrlhf_div.algorithms import method_from_spec
    from openrlhf_div.config import expand_tree

    opts = method_section(cfg)
    name = opts.pop("name", None)
    if not name:
        return
    try:
        opts = expand_tree(opts)
    except ConfigError:
        return  # an unset ${VAR}: the driver names it where the value is used
    try:
        method_from_spec({"name": str(name), "hparams": opts})  # built here once: the driver's plan reuses it
    except ValueError as e:
        raise ConfigError(f"config section `method`: {e}") from None


def overrides_of(argv: Sequence[str]) -> List[str]:
    """The override-like tokens of a launcher's command line (``section.key=value`` /
    ``section=value``, and ``word.key=value`` whose section is a typo, so that
    :func:`check_overrides` names it)."""
    out: List[str] = []
    for a in argv:
        m = _OVERRIDE.match(a)
        if m and not a.startswith("-") and (m.group(1) in EXPERIMENT_SECTIONS or m.group(1) in RENAMED_SECTIONS
                                              or m.group(2)):
            out.append(a)
    return out
