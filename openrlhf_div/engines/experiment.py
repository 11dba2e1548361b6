"""One experiment file, any engine: ``openrlhf-div run EXPERIMENT [--engine local|openrlhf|megatron]``.

An experiment file (``configs/openrlhf/*.yaml``, ``configs/megatron/*.yaml``) names its method
(``method: {name, hyperparameters}``; the old ``div:`` spelling of those keys is read for one
release with a one-line deprecation), its task (``task:``), its micro-batch layout (``layout:``), its
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

from openrlhf_div.config import ConfigError, deep_merge, expand_env, load_experiment, parse_overrides
from openrlhf_div import shipped

ENGINES = ("local", "openrlhf", "megatron")
#: where configs/ and examples/ live: the checkout, or the installed wheel's copy (openrlhf_div.shipped)
ROOT = shipped.root(strict=False)

#: OpenRLHF 0.11.2's defaults of the flags the local translation reads (an experiment file that
#: leaves a flag out trains with OpenRLHF's default on Ray, so the local run takes the same one;
#: tests/test_one_experiment.py checks this table against OpenRLHF's own parser)
OPENRLHF_DEFAULTS = {
    "rollout.batch_size": 1024, "rollout.n_samples_per_prompt": 1, "rollout.max_new_tokens": None,
    "rollout.temperature": 1.0, "rollout.top_p": 1.0, "actor.adam.lr": 1e-06, "actor.adam.betas": (0.9, 0.95),
    "actor.adam.weight_decay": 0.0, "actor.max_norm": 1.0, "actor.lr_scheduler": "cosine_with_min_lr",
    "actor.lr_warmup_ratio": 0.03, "actor.min_lr_ratio": 0.1, "train.max_epochs": 1, "train.num_episodes": 1,
    "train.seed": 42, "train.batch_size": 128, "data.input_key": "input", "data.label_key": None,
    "data.apply_chat_template": False, "data.input_template": None, "eval.steps": -1,
    "eval.n_samples_per_prompt": 4, "eval.temperature": 0.6, "data.max_samples": 100000000,
    "data.prompt_dataset": None, "eval.dataset": None,
}
#: ``openrlhf:`` keys that set how the Ray engines run, not what is trained (placement, ZeRO, vLLM,
#: packing, checkpoints, logging, micro-batches, dtype): the local engine leaves them
ENGINE_ONLY = ("actor.num_nodes", "actor.num_gpus_per_node", "ref.", "vllm.", "ds.", "megatron.", "ckpt.",
               "logger.", "rollout.micro_batch_size", "train.micro_batch_size", "train.colocate",
               "actor.gradient_checkpointing_enable", "data.max_len", "actor.model_name_or_path")
#: the presample: keys the local pre-sampling stage shares
SHARED_PRESAMPLE = ("n_pre", "tau", "drop_unsolved", "resample_anchor_responses", "chunk_size")

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
        from openrlhf_div.schema import presample_folder, render_file

        cfg = deep_merge(cfg, render_file(over, "the command line", override=True))  # rollout.group_size=4 -> its flag
        presample_folder(cfg, f"{path} with the command line's overrides")
        from openrlhf_div.engines.overrides import check_overrides

        check_overrides(cfg, overrides, path, method_section=method_section)  # a typo: one line, on every engine
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
def _upstream(cfg: Dict[str, Any], key: str) -> Any:
    """An ``openrlhf:`` flag's value as the Ray driver sees it (``${VAR}`` expanded; OpenRLHF's
    default when the file leaves it out)."""
    from openrlhf_div.config import expand_env

    up = cfg.get("openrlhf") or {}
    v = up.get(key, OPENRLHF_DEFAULTS.get(key))
    return expand_env(v) if isinstance(v, str) else v


#: the Ray drivers' own ``div:`` settings that the local engine has no counterpart of, and why (each
#: refused on the local engine when set, listed by ``openrlhf-div config fields``)
RAY_ONLY_DIV: Dict[str, str] = {
    "eval_greedy": "the local engine's evaluation samples only (its greedy column is the `eval --greedy` "
                   "command's)",
    "drop_long_prompts": "the local engine stops on an over-long prompt naming it (data.max_prompt_tokens); "
                         "cut the file instead",
    "truncate_prompts": "the local engine stops on an over-long prompt naming it (data.max_prompt_tokens); "
                        "cut the file instead",
}


def local_refusals(cfg: Dict[str, Any], toy: bool) -> List[str]:
    """What the local engine cannot honour, by name (empty: it can run the experiment)."""
    from openrlhf_div.engines.layout import EngineLayout, refuse_on_local

    out = []
    layout = EngineLayout.from_mapping(cfg.get("layout"))
    msg = refuse_on_local(layout)
    if msg and not toy:
        out.append(msg)
    div = cfg.get("div") or {}
    backend = str(div.get("actor_backend") or "deepspeed")
    if backend not in ("deepspeed", "megatron"):
        out.append(f"div.actor_backend={backend}: unknown")
    if toy:  # the toy overlay sets its own scale, data and model
        return out
    sched = str(_upstream(cfg, "actor.lr_scheduler"))
    from openrlhf_div.engines.provenance import LR_SCHEDULES

    if sched not in LR_SCHEDULES:
        out.append(f"openrlhf.actor.lr_scheduler={sched}: the local engine has constant and cosine schedules "
                   f"(one of {', '.join(sorted(LR_SCHEDULES))})")
    up = cfg.get("openrlhf") or {}
    if "data.max_samples" in up:
        out.append(f"openrlhf.data.max_samples={up['data.max_samples']}: the local engine trains on the whole "
                   "file (cut the file instead)")
    if div.get("anchor_seed") is not None:
        out.append("div.anchor_seed: the local engine draws anchors from the run's seed")
    # the Ray drivers' own settings with no local counterpart: refused by name, never dropped
    for key, why in RAY_ONLY_DIV.items():
        if div.get(key) not in (None, False):
            out.append(f"div.{key}={div[key]}: {why}")
    pre = cfg.get("presample") or {}
    top_p = float(_upstream(cfg, "rollout.top_p"))
    for k in ("rollout.top_p", "anchor_top_p"):
        if k in pre and float(pre[k]) != top_p and method_needs_anchors(cfg):
            out.append(f"presample.{k}={pre[k]}: the local pre-sampling stage samples with the rollout's top_p "
                       f"({top_p})")
    if _upstream(cfg, "data.prompt_dataset") is None:
        out.append("data.train: not set (the training prompts)")
    return out


def method_needs_anchors(cfg: Dict[str, Any]) -> bool:
    try:
        from openrlhf_div.algorithms import preset

        m = method_section(cfg)
        return bool(preset(str(m.get("name") or "grpo")).needs.anchor_batch)
    except Exception:  # noqa: BLE001 - a plug-in method not loaded yet: the TrainConfig decides later
        return False


def _set(d: Dict[str, Any], dotted: str, value: Any) -> None:
    node = d
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def _abs(path: Any) -> Any:
    from openrlhf_div.engines.provenance import norm_path

    return norm_path(path)


def to_local(cfg: Dict[str, Any], *, run_dir: str, toy: bool,
             environ: Optional[Dict[str, str]] = None) -> Tuple[Dict[str, Any], List[str]]:
    """``(TrainConfig mapping, notes)`` of an experiment on the local engine: everything the file
    says that reaches training on the Ray engines, in the local engine's keys (the same
    :func:`openrlhf_div.engines.provenance.settings_of` on both: tests/test_one_experiment.py), or
    :class:`ConfigError` naming what the local engine cannot honour. ``notes`` say what the local
    run leaves to the Ray engines (placement, ZeRO, vLLM, checkpoints).

    Translated: the method and task; the model; the seed (``train.seed``); prompts per step,
    samples, response length, temperature, top-p; learning rate, Adam betas / weight decay,
    clipping, the schedule (OpenRLHF's warm-up ratio as RL steps), epochs, optimiser steps per
    rollout step; the number of rollout steps (OpenRLHF's: ``num_episodes x`` whole batches of
    prompts); the data file and fields, the prompt rendering (``data.apply_chat_template`` /
    ``data.input_template``: raw text or the chat template); the grading options of the file's
    ``env:`` (``OPENRLHF_DIV_MATH_EXTRACT`` -> ``task_options.extract``); the evaluation data,
    cadence, samples, temperature, top-p; the anchor batch, the pre-sampling split and its folder
    (``data.presample_dir``, which the Ray engines read as ``div.anchor_data``; not under ``--toy``)."""
    from openrlhf_div.engines.provenance import count_prompts, grading_options, rollout_steps

    refused = local_refusals(cfg, toy)
    if refused:
        raise ConfigError("--engine local: " + "; ".join(refused))
    notes: List[str] = []
    g = lambda k: _upstream(cfg, k)  # noqa: E731
    task = task_of(cfg)
    out: Dict[str, Any] = {"task": task, "method": method_section(cfg), "output_dir": run_dir,
                           "experiment": cfg.get("experiment")}
    if cfg.get("plugins"):
        out["plugins"] = list(cfg["plugins"]) if not isinstance(cfg["plugins"], str) else [cfg["plugins"]]
    env = {str(k): str(v) for k, v in (cfg.get("env") or {}).items()}
    env.update({k: v for k, v in (os.environ if environ is None else environ).items() if k.startswith("OPENRLHF_DIV_")})
    div = cfg.get("div") or {}
    B, G = int(g("rollout.batch_size")), int(g("rollout.n_samples_per_prompt"))
    online = B * G
    _set(out, "seed", int(g("train.seed")))
    _set(out, "model.path", _abs(g("actor.model_name_or_path")))
    _set(out, "rollout.prompts_per_step", B)
    _set(out, "rollout.group_size", G)
    if g("rollout.max_new_tokens") is not None:
        _set(out, "rollout.max_new_tokens", int(g("rollout.max_new_tokens")))
    _set(out, "rollout.temperature", float(g("rollout.temperature")))
    _set(out, "rollout.top_p", float(g("rollout.top_p")))
    _set(out, "optim.learning_rate", float(g("actor.adam.lr")))
    _set(out, "optim.adam_betas", [float(x) for x in g("actor.adam.betas")])
    _set(out, "optim.weight_decay", float(g("actor.adam.weight_decay")))
    _set(out, "optim.max_grad_norm", float(g("actor.max_norm")))
    _set(out, "optim.ppo_epochs", int(g("train.max_epochs")))
    # the prompts: OpenRLHF's data.prompt_dataset; an anchor method whose Ray prompts are the
    # pre-sampling stage's D_exp trains on D_exp cut from the presample stage's prompts
    pre = cfg.get("presample") or {}
    train = g("data.prompt_dataset")
    anchors = method_needs_anchors(cfg)
    if anchors:
        exp_file = os.path.join(str(expand_env(str(div.get("anchor_data") or ""))), "d_exp.jsonl")
        on_exp = bool(div.get("anchor_data")) and _abs(train) == _abs(exp_file)
        if on_exp:
            train = expand_env(str(pre["data.prompt_dataset"])) if pre.get("data.prompt_dataset") else train
        if not toy:
            _set(out, "data.train_on_exp", on_exp)
    if not toy:  # the toy overlay brings its own data (local.data): its fields and rendering are the toy's
        _set(out, "data.train", _abs(train))
        _set(out, "data.prompt_field", g("data.input_key"))
        if g("data.label_key") is not None:
            _set(out, "data.label_field", g("data.label_key"))
        template = g("data.input_template")
        template = template.replace("{}", "{prompt}") if template and "{}" in template else None
        if g("data.apply_chat_template"):  # the prompt field as the user message, no system message
            _set(out, "data.prompt_template", template or "{prompt}")
            _set(out, "data.system_prompt", "")
        else:  # the prompt text as it is
            _set(out, "data.chat_template", False)
            _set(out, "data.prompt_template", template or "{prompt}")
    out["task_options"] = grading_options(task, env)
    # rollout steps: OpenRLHF's controller count over the prompts; an anchor method trained on
    # D_exp counts them once the pre-sampling stage has cut D_exp (apply_steps, `openrlhf-div run`)
    pending = None
    if not toy:
        pending = {"prompts_per_step": B, "episodes": int(g("train.num_episodes")),
                   "lr_warmup_ratio": float(g("actor.lr_warmup_ratio")), "eval_steps": int(g("eval.steps"))}
        from openrlhf_div.engines.provenance import LR_SCHEDULES

        sched = str(g("actor.lr_scheduler"))
        _set(out, "optim.lr_schedule", LR_SCHEDULES[sched])
        if LR_SCHEDULES[sched] == "cosine":
            _set(out, "optim.min_lr_ratio", float(g("actor.min_lr_ratio")) if sched == "cosine_with_min_lr" else 0.0)
    # rows per optimiser step: OpenRLHF's train.batch_size of the step's online + anchor rows
    from openrlhf_div.engines.anchor_data import anchor_count
    from openrlhf_div.engines.flags import DEFAULT_ANCHOR_RATIO

    n_anchor = 0
    if anchors:
        n_anchor = anchor_count(online, div.get("anchor_batch_size"), float(div.get("anchor_ratio") or DEFAULT_ANCHOR_RATIO))
    mini = max(1, (online + n_anchor) // int(g("train.batch_size")))
    _set(out, "optim.mini_batches", mini)
    if div.get("anchor_batch_size"):
        # anchors per mini-batch: ceil(rows / ratio) each; the ratio that gives the file's count per step
        _set(out, "optim.anchor_ratio", online / float(div["anchor_batch_size"]))
    elif div.get("anchor_ratio"):
        _set(out, "optim.anchor_ratio", float(div["anchor_ratio"]))
    if div.get("log_z_lr") is not None:  # optim.log_z_lr, rendered as the drivers' --div.log_z_lr
        _set(out, "optim.log_z_lr", float(expand_env(str(div["log_z_lr"]))))
    if div.get("anchor_data") and not toy:
        # the pre-sampling folder (data.presample_dir, rendered as the Ray driver's --div.anchor_data), as the Ray
        # side sees it; the toy's tiny model pre-samples its own (a D_pef holds the base model's log-probs)
        _set(out, "data.presample_dir", expand_env(str(div["anchor_data"])))
    save = (cfg.get("openrlhf") or {}).get("ckpt.save_steps")
    if not toy and save is not None and int(save) > 0:  # checkpoints as often as on Ray: a killed run resumes there
        _set(out, "checkpoint.every", int(save))
    pres = {k: v for k, v in pre.items() if k in SHARED_PRESAMPLE}
    if pres:
        out["presample"] = pres
    # the evaluation: the Ray run folder's (before the first step, after the last; OpenRLHF's own
    # every eval.steps), on every prompt of eval.dataset
    if g("eval.dataset") and not toy:
        ne = int(g("eval.n_samples_per_prompt"))
        ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= ne]
        if ne not in ks:
            ks.append(ne)
        top_p = div.get("eval_top_p")
        _set(out, "data.eval", _abs(g("eval.dataset")))
        out["eval"] = {"at_start": True, "n_samples": ne, "k": ks, "max_prompts": None,
                       "temperature": float(g("eval.temperature")),
                       "top_p": float(top_p) if top_p is not None else None}
    elif not toy:
        _set(out, "data.eval", None)
    if pending is not None:
        n = count_prompts(_abs(g("data.prompt_dataset")))
        on_exp = anchors and (out.get("data") or {}).get("train_on_exp")
        if n is None and cfg.get("tiny") and not on_exp:  # built on first use: tiny.n_prompts prompts
            n = int((cfg.get("tiny") or {}).get("n_prompts", 8))
        if n is not None:
            apply_steps(out, pending, n)
        elif on_exp:
            out[PENDING_STEPS] = pending  # D_exp does not exist yet: counted after the pre-sampling stage
        else:
            raise ConfigError(f"the local engine cannot honour data.train={g('data.prompt_dataset')}: "
                              "no such file here, so the file's number of rollout steps (openrlhf.train.num_episodes x "
                              "its prompts / rollout.prompts_per_step) is unknown; point DATA_DIR (or the override "
                              "data.train=FILE) at the data")
    layout = cfg.get("layout") or {}
    if toy and layout:
        notes.append(f"layout {dict(layout)} is the Ray engines' (the local engine keeps its own "
                     "micro-batches): not applied to this toy run")
    local = copy.deepcopy((cfg.get("local") or {}))  # the toy overlay's local-engine keys
    for key in ("train", "eval"):  # the toy's data ship with the repository: its paths are the repository's
        v = (local.get("data") or {}).get(key)
        if isinstance(v, str) and not os.path.isabs(v):
            local["data"][key] = os.path.join(ROOT, v)
    if "task_options" in local:  # one task factory's keyword arguments: replaced whole
        out["task_options"] = {}
    from openrlhf_div.schema import NEUTRAL_SECTIONS

    # the schema's settings that no OpenRLHF flag carries (the rest arrived above, through the flags)
    out = deep_merge(out, {k: copy.deepcopy(cfg[k]) for k in NEUTRAL_SECTIONS if k in cfg})
    out = deep_merge(out, local)
    notes.append("not applied on the local engine: vLLM / DeepSpeed / Ray settings of `openrlhf:` "
                 "(placement, ZeRO, dtype, packing, checkpoints)")
    return out, notes


#: the key of :func:`to_local`'s mapping that holds what :func:`apply_steps` needs when the
#: prompts (D_exp) are only known after the pre-sampling stage
PENDING_STEPS = "_pending_steps"


def apply_steps(data: Dict[str, Any], pending: Dict[str, Any], n_prompts: int) -> Dict[str, Any]:
    """``optim.steps`` (OpenRLHF's rollout steps over ``n_prompts``), the warm-up as RL steps and
    the evaluation cadence (OpenRLHF's ``eval.steps`` when inside the run, else start and end only)."""
    from openrlhf_div.engines.provenance import rollout_steps

    steps = rollout_steps(n_prompts, pending["prompts_per_step"], pending["episodes"])
    _set(data, "optim.steps", steps)
    _set(data, "optim.warmup_steps", int(round(pending["lr_warmup_ratio"] * steps)))
    if (data.get("data") or {}).get("eval"):
        es = int(pending["eval_steps"])
        _set(data, "eval.every", es if 0 < es < steps else 0)
    return data


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


if __name__ == "__main__":  # the launchers' lookup: python -m openrlhf_div.engines.experiment NAME -> its path
    import sys

    try:
        print(find_experiment(sys.argv[1]))
    except (ConfigError, IndexError) as _e:
        print(f"error: {_e if sys.argv[1:] else 'give an experiment name'}", file=sys.stderr)
        raise SystemExit(1)
