"""What reaches training, as one flat dict, the same on every engine: ``run_info.json``'s ``"settings"``.

:func:`settings_of` reads a run's settings from what the engine actually trains with -- the local
engine's validated :class:`~openrlhf_div.engines.local.config.TrainConfig`, or the Ray driver's
:class:`~openrlhf_div.engines.openrlhf.launch.Plan` (OpenRLHF's parsed, validated namespace, its
defaults included) -- under one set of canonical dotted keys::

    method.name, method.<hparam> (every resolved hyperparameter), method.estimator,
    method.aggregation, method.dynamic_sampling, model.path, train.steps,
    rollout.prompts_per_step, rollout.n_samples_per_prompt, rollout.max_new_tokens,
    rollout.temperature, rollout.top_p, optim.lr, optim.adam_betas, optim.weight_decay,
    optim.max_grad_norm, optim.lr_schedule, optim.warmup_steps, optim.min_lr_ratio,
    optim.ppo_epochs, optim.mini_batches, data.train, data.prompt_field, data.label_field,
    data.template, task.name, task.options, eval.data, eval.every, eval.n_samples, eval.k,
    eval.max_new_tokens, eval.temperature, eval.top_p
    (+ anchor.per_step, data.train_on_exp, presample.* for methods with a D_pef anchor batch)

The seed is not a setting (``run_info.json`` has it as ``"seed"``): two runs whose settings are
equal differ only by their seed. ``compare`` groups runs by these settings; the translation of an
experiment file to the local engine (:func:`openrlhf_div.engines.experiment.to_local`) is tested
key by key against the Ray engine's (tests/test_one_experiment.py).

No torch import.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, Mapping, Optional

#: OpenRLHF's learning-rate schedulers -> the local engine's (``optim.lr_schedule``); the min-lr
#: ratio applies to the cosine ones only
LR_SCHEDULES = {"constant": "constant", "constant_with_warmup": "constant", "cosine_with_min_lr": "cosine",
                "cosine": "cosine"}


def count_prompts(path: Optional[str]) -> Optional[int]:
    """Rows of a prompt file (.jsonl / .json / .parquet / a ``save_to_disk`` folder); None when the
    path does not exist here (e.g. a hub name, or data not built yet)."""
    if not path or not os.path.exists(path):
        return None
    if os.path.isdir(path):
        try:
            import datasets

            d = datasets.load_from_disk(path)
            return len(d) if not hasattr(d, "keys") else len(d[list(d.keys())[0]])
        except Exception:  # noqa: BLE001 - not a dataset folder: unknown
            return None
    if path.endswith(".jsonl"):
        with open(path) as fh:
            return sum(1 for line in fh if line.strip())
    if path.endswith(".json"):
        with open(path) as fh:
            data = json.load(fh)
        return len(data) if isinstance(data, list) else None
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq

            return int(pq.ParquetFile(path).metadata.num_rows)
        except Exception:  # noqa: BLE001
            return None
    return None


def rollout_steps(n_prompts: Optional[int], prompts_per_step: int, episodes: int) -> Optional[int]:
    """Rollout steps of an OpenRLHF run over ``n_prompts`` prompts (its controller's count: whole
    batches of ``rollout.batch_size`` prompts per episode, at least one)."""
    if n_prompts is None:
        return None
    return max(1, int(n_prompts) // max(1, int(prompts_per_step))) * max(1, int(episodes))


def norm_path(p: Any) -> Any:
    """A local path as an absolute one (a hub name or None is kept as it is)."""
    if not isinstance(p, str) or not p:
        return p
    if os.path.isabs(p) or os.path.exists(p) or p.startswith("."):
        return os.path.abspath(p)
    return p


def _num(v: Any) -> Any:
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, (int, float)):
        return v
    if isinstance(v, (list, tuple)):
        return [_num(x) for x in v]
    if isinstance(v, str):
        try:
            f = float(v)
        except ValueError:
            return v
        return int(f) if f == int(f) and "." not in v and "e" not in v.lower() else f
    return v


def template_name(chat: bool, prompt_template: Optional[str] = None, system_prompt: Optional[str] = None,
                  task: Optional[str] = None) -> str:
    """How prompts are rendered, as one string: ``raw`` (the prompt text as it is), ``chat`` (the
    prompt as the user message through the tokenizer's chat template), either with ``:TEMPLATE``
    when a template wraps the prompt, ``+system:TEXT`` for a system message; ``task:NAME`` for
    the task's own template (the local engine's default)."""
    if chat and prompt_template is None and system_prompt is None:
        return f"task:{task}"
    out = "chat" if chat else "raw"
    if prompt_template not in (None, "{prompt}"):
        out += f":{prompt_template}"
    if chat and system_prompt:
        out += f"+system:{system_prompt}"
    return out


def grading_options(task: Optional[str], environ: Mapping[str, str]) -> Dict[str, Any]:
    """The grading options the task's OpenRLHF reward file reads from ``environ`` (its ``_ENV``
    table: ``OPENRLHF_DIV_MATH_EXTRACT`` -> ``extract``, ...), converted as the file converts them."""
    if not task:
        return {}
    import importlib

    try:
        mod = importlib.import_module(f"openrlhf_div.tasks.reward_funcs.{task}")
    except ImportError:
        return {}
    from openrlhf_div.tasks.reward_funcs._common import env_options

    return env_options(getattr(mod, "_ENV", {}), environ)


def _method_keys(method) -> Dict[str, Any]:
    out: Dict[str, Any] = {"method.name": method.name, "method.estimator": method.estimator,
                           "method.aggregation": method.aggregation,
                           "method.dynamic_sampling": bool(method.dynamic_sampling)}
    for k, v in sorted(method.hparams.items()):
        out[f"method.{k}"] = _num(v)
    return out


def _eval_ks(n: int):
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n]
    if n not in ks:
        ks.append(n)
    return ks


def _local(cfg) -> Dict[str, Any]:
    method = cfg.build_method()
    r, o, d, e = cfg.rollout, cfg.optim, cfg.data, cfg.eval
    out = _method_keys(method)
    out.update({
        "model.path": norm_path(cfg.model.path),
        "train.steps": int(o.steps),
        "rollout.prompts_per_step": int(r.prompts_per_step),
        "rollout.n_samples_per_prompt": int(r.group_size),
        "rollout.max_new_tokens": int(r.max_new_tokens),
        "rollout.temperature": float(r.temperature),
        "rollout.top_p": float(r.top_p),
        "optim.lr": float(o.learning_rate),
        "optim.adam_betas": [float(x) for x in o.adam_betas],
        "optim.weight_decay": float(o.weight_decay),
        "optim.max_grad_norm": float(o.max_grad_norm),
        "optim.lr_schedule": o.lr_schedule,
        "optim.warmup_steps": int(o.warmup_steps),
        "optim.min_lr_ratio": float(o.min_lr_ratio) if o.lr_schedule == "cosine" else None,
        "optim.ppo_epochs": int(o.ppo_epochs),
        "optim.mini_batches": int(o.mini_batches),
        "data.train": norm_path(d.train),
        "data.prompt_field": d.prompt_field,
        "data.label_field": d.label_field,
        "data.template": template_name(d.chat_template, d.prompt_template,
                                       d.system_prompt if d.chat_template else None, cfg.task),
        "task.name": cfg.task,
        "task.options": {k: _num(v) for k, v in sorted((cfg.task_options or {}).items())},
    })
    if d.eval:
        n = int(e.n_samples)
        out.update({"eval.data": norm_path(d.eval), "eval.every": int(e.every), "eval.n_samples": n,
                    "eval.k": sorted(k for k in e.k if 1 <= k <= n) or [1],
                    "eval.max_new_tokens": int(e.max_new_tokens or r.max_new_tokens),
                    "eval.temperature": float(r.temperature if e.temperature is None else e.temperature),
                    "eval.top_p": float(r.top_p if e.top_p is None else e.top_p), "eval.max_prompts": e.max_prompts})
    else:
        out.update({"eval.data": None, "eval.every": None, "eval.n_samples": None, "eval.k": None,
                    "eval.max_new_tokens": None, "eval.temperature": None, "eval.top_p": None,
                    "eval.max_prompts": None})
    if method.needs.anchor_batch:
        online = int(r.prompts_per_step) * int(r.group_size)
        per_mb = [len(x) for x in _split_sizes(online, int(o.mini_batches))]
        out["anchor.per_step"] = sum(cfg.anchors_per_mini_batch(k, i) for i, k in enumerate(per_mb) if k)
        out["data.train_on_exp"] = bool(d.train_on_exp) and not d.anchor
        p = cfg.presample
        out.update({"presample.n_pre": int(p.n_pre), "presample.tau": int(p.n_pre if p.tau is None else p.tau),
                    "presample.drop_unsolved": bool(p.drop_unsolved),
                    "presample.resample_anchor_responses": bool(p.resample_anchor_responses)})
    return out


def _split_sizes(n: int, parts: int):
    """The sizes ``torch.tensor_split`` cuts ``n`` rows into (as lists, for len())."""
    q, rem = divmod(n, parts)
    return [[0] * (q + (1 if i < rem else 0)) for i in range(parts)]


def ray_settings(args, method, experiment: Optional[Mapping[str, Any]] = None,
                 environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """:func:`settings_of` of the Ray engine: OpenRLHF's hierarchized namespace ``args`` (every
    default included), the method it resolved, the experiment as read (its ``env:`` and
    ``tiny:``/``presample:`` sections) and the driver's environment."""
    from openrlhf_div.config import expand_env
    from openrlhf_div.engines.anchor_data import anchor_count
    from openrlhf_div.engines.flags import div_namespace

    experiment = dict(experiment or {})
    env = {str(k): str(v) for k, v in (experiment.get("env") or {}).items()}
    env.update({k: v for k, v in (os.environ if environ is None else environ).items() if k.startswith("OPENRLHF_DIV_")})
    div = div_namespace(args)
    a = args
    n = count_prompts(a.data.prompt_dataset)
    on_exp = bool(div.anchor_data) and norm_path(a.data.prompt_dataset) == norm_path(
        os.path.join(str(div.anchor_data), "d_exp.jsonl"))
    if n is None and experiment.get("tiny") and not on_exp:  # built on first use: tiny.n_prompts prompts
        n = int((experiment.get("tiny") or {}).get("n_prompts", 8))
    if n is not None and getattr(a.data, "max_samples", None):
        n = min(n, int(a.data.max_samples))
    steps = rollout_steps(n, a.rollout.batch_size, a.train.num_episodes)
    sched = str(a.actor.lr_scheduler)
    schedule = LR_SCHEDULES.get(sched, sched)
    warm = float(a.actor.lr_warmup_ratio)
    template = a.data.input_template
    if template and "{}" in template:
        template = template.replace("{}", "{prompt}")
    elif template:
        template = None  # OpenRLHF drops a template without {} (its own warning)
    online = int(a.rollout.batch_size) * int(a.rollout.n_samples_per_prompt)
    out = _method_keys(method)
    out.update({
        "model.path": norm_path(a.actor.model_name_or_path),
        "train.steps": steps,
        "rollout.prompts_per_step": int(a.rollout.batch_size),
        "rollout.n_samples_per_prompt": int(a.rollout.n_samples_per_prompt),
        "rollout.max_new_tokens": int(a.rollout.max_new_tokens),
        "rollout.temperature": float(a.rollout.temperature),
        "rollout.top_p": float(a.rollout.top_p),
        "optim.lr": float(a.actor.adam.lr),
        "optim.adam_betas": [float(x) for x in a.actor.adam.betas],
        "optim.weight_decay": float(a.actor.adam.weight_decay),
        "optim.max_grad_norm": float(a.actor.max_norm),
        "optim.lr_schedule": schedule,
        "optim.warmup_steps": int(round(warm * steps)) if steps is not None else None,
        "optim.min_lr_ratio": (float(a.actor.min_lr_ratio) if sched == "cosine_with_min_lr" else 0.0)
        if schedule == "cosine" else None,
        "optim.ppo_epochs": int(a.train.max_epochs),
        "data.train": norm_path(a.data.prompt_dataset),
        "data.prompt_field": a.data.input_key,
        "data.label_field": a.data.label_key,
        "data.template": template_name(bool(a.data.apply_chat_template), template, None if not
                                       a.data.apply_chat_template else "", div.task),
        "task.name": div.task,
        "task.options": {k: _num(v) for k, v in sorted(grading_options(div.task, env).items())},
    })
    anchors = 0
    if method.needs.anchor_batch:
        anchors = anchor_count(online, div.anchor_batch_size, div.anchor_ratio)
        out["anchor.per_step"] = anchors
        exp_file = os.path.join(str(div.anchor_data or ""), "d_exp.jsonl")
        on_exp = bool(div.anchor_data) and norm_path(a.data.prompt_dataset) == norm_path(exp_file)
        out["data.train_on_exp"] = on_exp
        pre = experiment.get("presample") or {}
        if on_exp and pre.get("data.prompt_dataset"):  # the prompts D_exp is cut from
            out["data.train"] = norm_path(expand_env(str(pre["data.prompt_dataset"])))
        out.update({"presample.n_pre": int(pre.get("n_pre", 8)),
                    "presample.tau": int(pre.get("tau", pre.get("n_pre", 8)) if pre.get("tau") is not None
                                         else pre.get("n_pre", 8)),
                    "presample.drop_unsolved": bool(pre.get("drop_unsolved", False)),
                    "presample.resample_anchor_responses": bool(pre.get("resample_anchor_responses", False))})
    out["optim.mini_batches"] = max(1, (online + anchors) // int(a.train.batch_size))
    if getattr(a.eval, "dataset", None):
        ne = int(a.eval.n_samples_per_prompt)
        es = int(a.eval.steps)
        top_p = div.eval_top_p if getattr(div, "eval_top_p", None) is not None else a.rollout.top_p
        out.update({"eval.data": norm_path(a.eval.dataset),
                    "eval.every": es if 0 < es and (steps is None or es < steps) else 0,
                    "eval.n_samples": ne, "eval.k": _eval_ks(ne),
                    "eval.max_new_tokens": int(a.rollout.max_new_tokens),
                    "eval.temperature": float(a.eval.temperature), "eval.top_p": float(top_p),
                    "eval.max_prompts": None})
    else:
        out.update({"eval.data": None, "eval.every": None, "eval.n_samples": None, "eval.k": None,
                    "eval.max_new_tokens": None, "eval.temperature": None, "eval.top_p": None,
                    "eval.max_prompts": None})
    return out


def settings_of(source, experiment: Optional[Mapping[str, Any]] = None,
                environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """The flat ``{canonical dotted key: value}`` of everything that reaches training except the
    seed (module docstring), from a local :class:`TrainConfig` or a Ray driver's ``Plan``."""
    if hasattr(source, "optim") and hasattr(source, "rollout"):
        return _local(source)
    if hasattr(source, "args") and hasattr(source, "method"):
        return ray_settings(source.args, source.method, experiment if experiment is not None
                            else getattr(source, "experiment", None), environ)
    raise TypeError(f"settings_of: a local TrainConfig or a Ray Plan, got {type(source).__name__}")


def differing(a: Mapping[str, Any], b: Mapping[str, Any]) -> Dict[str, Any]:
    """``{key: (a's value, b's value)}`` for every key where two settings dicts differ."""
    out = {}
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k, "<absent>"), b.get(k, "<absent>")
        if isinstance(va, float) and isinstance(vb, float) and math.isclose(va, vb, rel_tol=1e-9, abs_tol=1e-12):
            continue
        if va != vb:
            out[k] = (va, vb)
    return out
