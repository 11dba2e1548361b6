"""One experiment file, any engine: ``openrlhf-div run EXPERIMENT [--engine local|openrlhf|megatron]``.

An experiment file (``configs/openrlhf/*.yaml``, ``configs/megatron/*.yaml``) names its method
(``method: {name, hyperparameters}``; the old ``div:`` spelling of those keys is read for one
release with a one-line deprecation), its task (``task:``), its engine layout (``engine:``), its
plug-ins (``plugins:``) and OpenRLHF's own settings (``openrlhf:``, passed through). This module

* finds an experiment by name (:func:`find_experiment`);
* reads ``section.key=value`` overrides into the experiment (:func:`load`); the Ray driver gets
  them through the function that renders a file (``launch.config_argv``; ``openrlhf_div.cli.run``),
  so ``method.anchor_eta=0.1`` means one thing on every engine;
* translates an experiment into the local engine's TrainConfig (:func:`to_local`): the method
  section as it is, the rollout / optimiser settings the local engine shares with OpenRLHF by
  their OpenRLHF names, and ``--toy``'s overlay (the ``toy:`` section a family base carries: a
  tiny model, a handful of prompts, a few steps) -- and refuses by name what the local engine
  cannot honour (:func:`local_refusals`) before anything starts.

No torch import: the CLI's ``--help`` and the config tests use it.
"""
from __future__ import annotations

import copy
import glob
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from openrlhf_div.config import ConfigError, deep_merge, load_experiment, parse_overrides
from openrlhf_div import shipped

ENGINES = ("local", "openrlhf", "megatron")
#: where configs/ and examples/ live: the checkout, or the installed wheel's copy (openrlhf_div.shipped)
ROOT = shipped.root(strict=False)

#: OpenRLHF flag -> the local engine's key (settings both engines have, under OpenRLHF's name in a file)
SHARED = {
    "rollout.batch_size": "rollout.prompts_per_step",
    "rollout.n_samples_per_prompt": "rollout.group_size",
    "rollout.max_new_tokens": "rollout.max_new_tokens",
    "rollout.temperature": "rollout.temperature",
    "rollout.top_p": "rollout.top_p",
    "actor.adam.lr": "optim.learning_rate",
    "train.max_epochs": "optim.ppo_epochs",
    "train.seed": "seed",
    "data.prompt_dataset": "data.train",
    "actor.model_name_or_path": "model.path",
}
#: the presample: keys the local pre-sampling stage shares
SHARED_PRESAMPLE = ("n_pre", "tau", "drop_unsolved", "resample_anchor_responses")


def find_experiment(name: str) -> str:
    """``configs/{openrlhf,megatron}/NAME.yaml`` (or a path); an unknown name is an error naming
    the closest experiments."""
    if os.path.isfile(name):
        return os.path.abspath(name)
    found = [p for sub in ("openrlhf", "megatron") for p in glob.glob(os.path.join(ROOT, "configs", sub, name + ".yaml"))]
    if found and not os.path.basename(found[0]).startswith("_"):
        return found[0]
    import difflib

    shipped.root()  # no configs/ at all (neither a checkout nor the wheel's copy): say so in one line
    names = sorted(os.path.basename(p)[:-5] for sub in ("openrlhf", "megatron")
                   for p in glob.glob(os.path.join(ROOT, "configs", sub, "[!_]*.yaml")))
    close = difflib.get_close_matches(name, names, n=3)
    raise ConfigError(f"no experiment {name!r}" + (f"; did you mean {', '.join(close)}?" if close else "")
                      + " (the names of configs/openrlhf/*.yaml and configs/megatron/*.yaml)")


def method_section(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The method (``name`` + hyperparameters) of an experiment: its ``method:`` section, or the
    method keys of the old ``div:`` spelling."""
    from openrlhf_div.engines.flags import METHOD_KEYS_IN_DIV

    m = dict(cfg.get("method") or {})
    div = cfg.get("div") or {}
    if "method" in div:
        m.setdefault("name", div["method"])
    for k, v in div.items():
        if k in METHOD_KEYS_IN_DIV():
            m.setdefault(k, v)
    return m


def task_of(cfg: Dict[str, Any]) -> Optional[str]:
    return cfg.get("task") or (cfg.get("div") or {}).get("task")


def load(path: str, overrides: Sequence[str] = (), toy: bool = False) -> Dict[str, Any]:
    """An experiment with ``toy:``'s overlay (``toy=True``; its ``local:`` part stays for
    :func:`to_local`) and ``section.key=value`` overrides merged over it."""
    cfg = load_experiment(path)
    overlay = cfg.pop("toy", None) or {}
    if toy:
        if not overlay:
            raise ConfigError(f"{path}: no `toy:` overlay (a family base carries one: configs/toy/*.yaml); "
                              "--toy needs it")
        cfg = deep_merge(cfg, overlay)
    if overrides:
        over = parse_overrides(overrides, example="method.anchor_eta=0.1")
        for section in FLAT_SECTIONS:  # OpenRLHF's flags are dotted keys there: openrlhf.train.batch_size=64
            if isinstance(over.get(section), dict):
                over[section] = _flatten(over[section])
        cfg = deep_merge(cfg, over)
        from openrlhf_div.engines.overrides import check_overrides

        check_overrides(cfg, overrides, path)  # a typo: one line, the same on every engine
    return cfg


#: sections whose keys are OpenRLHF's dotted flag names (``train.batch_size``), not nested mappings
FLAT_SECTIONS = ("openrlhf", "presample")


def _flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ------------------------------------------------------------------ the local engine
def local_refusals(cfg: Dict[str, Any], toy: bool) -> List[str]:
    """What the local engine cannot honour, by name (empty: it can run the experiment)."""
    from openrlhf_div.engines.layout import EngineLayout, refuse_on_local

    out = []
    layout = EngineLayout.from_mapping(cfg.get("engine"))
    msg = refuse_on_local(layout)
    if msg and not toy:
        out.append(msg)
    backend = str((cfg.get("div") or {}).get("actor_backend") or "deepspeed")
    if backend not in ("deepspeed", "megatron"):
        out.append(f"div.actor_backend={backend}: unknown")
    return out


def _set(d: Dict[str, Any], dotted: str, value: Any) -> None:
    node = d
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def to_local(cfg: Dict[str, Any], *, run_dir: str, toy: bool) -> Tuple[Dict[str, Any], List[str]]:
    """``(TrainConfig mapping, notes)`` of an experiment on the local engine (see the module
    docstring); ``notes`` say what the local run leaves to the Ray engines."""
    from openrlhf_div.config import expand_env

    refused = local_refusals(cfg, toy)
    if refused:
        raise ConfigError("; ".join(refused))
    notes: List[str] = []
    up = cfg.get("openrlhf") or {}
    out: Dict[str, Any] = {"task": task_of(cfg), "method": method_section(cfg), "output_dir": run_dir}
    if cfg.get("plugins"):
        out["plugins"] = list(cfg["plugins"]) if not isinstance(cfg["plugins"], str) else [cfg["plugins"]]
    for flag, key in SHARED.items():
        if flag in up:
            v = up[flag]
            _set(out, key, expand_env(v) if isinstance(v, str) else v)
    # rows per optimiser step: OpenRLHF's train.batch_size of the step's online rows
    online = int(up.get("rollout.batch_size", 1)) * int(up.get("rollout.n_samples_per_prompt", 1))
    if up.get("train.batch_size"):
        out.setdefault("optim", {})["mini_batches"] = max(1, online // int(up["train.batch_size"]))
    div = cfg.get("div") or {}
    if div.get("anchor_batch_size"):
        out.setdefault("optim", {})["anchor_ratio"] = online / float(div["anchor_batch_size"])
    elif div.get("anchor_ratio"):
        out.setdefault("optim", {})["anchor_ratio"] = float(div["anchor_ratio"])
    pre = {k: v for k, v in (cfg.get("presample") or {}).items() if k in SHARED_PRESAMPLE}
    if pre:
        out["presample"] = pre
    layout = cfg.get("engine") or {}
    if toy and layout:
        notes.append(f"engine layout {dict(layout)} is the Ray engines' (the local engine keeps its own "
                     "micro-batches): not applied to this toy run")
    local = copy.deepcopy((cfg.get("local") or {}))  # the toy overlay's local-engine keys
    for key in ("train", "eval"):  # the toy's data ship with the repository: its paths are the repository's
        v = (local.get("data") or {}).get(key)
        if isinstance(v, str) and not os.path.isabs(v):
            local["data"][key] = os.path.join(ROOT, v)
    out = deep_merge(out, local)
    notes.append("not applied on the local engine: vLLM / DeepSpeed / Ray settings of `openrlhf:` "
                 "(placement, ZeRO, packing, checkpoints)")
    return out, notes


def build_sql_databases(scripts_dir: str, out_dir: str) -> str:
    """``{db_id}/{db_id}.sqlite`` under ``out_dir`` from every ``{db_id}.sql`` script of
    ``scripts_dir`` (the toy's BIRD-style fixtures; relative paths: the repository's). Returns ``out_dir``."""
    import sqlite3

    src = scripts_dir if os.path.isabs(scripts_dir) else os.path.join(ROOT, scripts_dir)
    scripts = sorted(glob.glob(os.path.join(src, "*.sql")))
    if not scripts:
        raise ConfigError(f"toy_sql_scripts: no .sql script in {src}")
    for script in scripts:
        db_id = os.path.basename(script)[:-4]
        path = os.path.join(out_dir, db_id, db_id + ".sqlite")
        if os.path.exists(path):
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(script) as fh, sqlite3.connect(path + ".tmp") as con:
            con.executescript(fh.read())
        os.replace(path + ".tmp", path)
    return out_dir
