"""``openrlhf-div demo``: the diversity demo from nothing, in five stages.

1. **data**: ``OUT/data/train.jsonl`` and ``eval.jsonl`` of the demo task
   (:func:`openrlhf_div.tasks.demo.write_splits`);
2. **base model**: the supervised warm-up (:mod:`.warmup`), cached by its settings;
3. **pre-sampling**: DPH's ``D_pef`` / ``D_exp`` split by the base model
   (:func:`openrlhf_div.engines.local.presample.presample`), once, in ``OUT/presample``;
4. **RL**: every method with the same budget and seeds (the local engine's
   :class:`~openrlhf_div.engines.local.trainer.Trainer`), each run in
   ``OUT/runs/<method>/seed<k>``, then evaluated (``eval.json``, ``samples.jsonl``);
   the base is evaluated in ``OUT/runs/base``;
5. **report**: ``OUT/metrics.json``, ``report.md``, ``passk.png``, ``styles.png``
   (:mod:`openrlhf_div.eval.report`), the same files ``openrlhf-div compare OUT/runs/*/*``
   would write.

A finished run whose ``eval.json`` records the same settings is reused, so an interrupted
demo continues where it stopped and ``--methods`` / ``--seeds`` can add runs to a directory.
"""
from __future__ import annotations

import copy
import json
import os
import sys
import shutil
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from .. import shipped
from ..config import ConfigError, deep_merge, load, parse_overrides
from ..eval.report import build_metrics, write_report
from ..eval.results import read_eval_json, write_eval
from ..tasks.demo import STYLES, STYLE_NAMES, SplitSpec, read_jsonl, render, write_splits
from .evaluate import evaluate_model
from .warmup import WarmupConfig, build_base_model

REPO_CONFIG = os.path.join(shipped.root(strict=False), "configs", "demo.yaml")  # the checkout's or the wheel's
STAGES = 5


# ------------------------------------------------------------------ config
def load_demo_config(path: Optional[str] = None, *, quick: bool = False,
                     overrides: Sequence[str] = ()) -> Dict[str, Any]:
    """The demo settings: ``configs/demo.yaml`` (or ``path``; ``extends:`` followed by the one
    config loader, :mod:`openrlhf_div.config`: mappings merge, lists such as ``methods`` are
    replaced), its ``quick`` section merged in when ``quick``, then ``key=value`` overrides with
    dotted keys (values parsed as YAML)."""
    path = path or REPO_CONFIG
    if not os.path.isfile(path):
        raise ConfigError(f"demo config {path!r} not found; pass --config PATH (the repository ships "
                          f"configs/demo.yaml)")
    cfg = load(path, what="demo config")
    quick_part = cfg.pop("quick", {}) or {}
    if quick:
        cfg = deep_merge(cfg, quick_part)
    cfg = deep_merge(cfg, parse_overrides(overrides, example="train.optim.steps=50"))
    if "threads" in cfg:  # the schema's name is num_threads (TrainConfig's, every engine's)
        print(f"note: {path}: `threads` is spelt `num_threads` now (the old spelling still loads)", file=sys.stderr)
        cfg.setdefault("num_threads", cfg.pop("threads"))
    for key in ("seeds", "methods", "train", "evaluation", "warmup", "splits"):
        if key not in cfg:
            raise ConfigError(f"demo config {path!r} lacks the {key!r} section")
    unknown = [m for m in cfg["methods"] if m not in (cfg.get("method_settings") or {})]
    if unknown:
        cfg.setdefault("method_settings", {}).update({m: {} for m in unknown})
    cfg["quick"] = bool(quick)
    cfg["config_path"] = os.path.abspath(path)
    return cfg


def _mode(reg: str, hp: Dict[str, Any]) -> str:
    """Which form the method ran in: the spec's clean form or the papers' code (its options and
    values; docs/ALGORITHMS.md section 9)."""
    from ..algorithms import get_method
    from ..algorithms.authors import mode_summary

    return mode_summary(get_method(reg, **hp))


def method_spec(cfg: Dict[str, Any], name: str):
    """``(registry method, hyperparameters, train overrides)`` of a demo entry.

    ``method_settings[name]`` holds the hyperparameters of registry method ``name``, or, for a
    *variant* (a sweep point shown as its own row), ``method: <registry name>`` plus its
    hyperparameters and optionally ``train: {...}`` overrides of the shared budget, e.g.
    ``lad_js_eta1: {method: lad_js, lad_eta: 1.0}``.
    """
    entry = dict((cfg.get("method_settings") or {}).get(name) or {})
    base = entry.pop("method", name)
    train = entry.pop("train", None) or {}
    return str(base), entry, train


def train_config_dict(cfg: Dict[str, Any], method: str, seed: int, *, base_dir: str, data_dir: str,
                      presample_dir: Optional[str], run_dir: str) -> Dict[str, Any]:
    """The local engine's TrainConfig (as a dict) of one demo run (``method``: a demo entry)."""
    reg, hp, train_over = method_spec(cfg, method)
    t = deep_merge(copy.deepcopy(cfg["train"]), train_over)
    d = {
        "task": cfg.get("task", "demo"), "seed": int(seed), "output_dir": run_dir,
        "num_threads": cfg.get("num_threads", 1),
        "method": {"name": reg, **hp},
        "model": {"path": base_dir},
        "data": {"train": os.path.join(data_dir, "train.jsonl"), "eval": None,
                 "presample_dir": presample_dir},
        "eval": {"at_start": False, "every": 0},
        "checkpoint": {"every": 0, "keep": 1},
        "logging": {"tensorboard": False, "progress": True, "entropy": False},
    }
    return deep_merge(d, t)


# ------------------------------------------------------------------ helpers
class _Clock:
    def __init__(self, log):
        self.t0 = time.time()
        self.c0 = time.process_time()
        self.log = log

    def stage(self, i: int, text: str) -> None:
        self.log(f"\n[{i}/{STAGES}] {text}   (elapsed {time.time() - self.t0:.0f} s, "
                 f"CPU {time.process_time() - self.c0:.0f} s)")


def _eval_settings(cfg: Dict[str, Any]) -> Dict[str, Any]:
    return dict(cfg["evaluation"])


def _reusable(run_dir: str, settings: Dict[str, Any]) -> bool:
    try:
        e = read_eval_json(run_dir)
    except (FileNotFoundError, ValueError):
        return False
    return json.loads(json.dumps(e.get("info"))) == json.loads(json.dumps(settings))


def _eval_kw(cfg: Dict[str, Any], seed: int) -> Dict[str, Any]:
    ev = cfg["evaluation"]
    return dict(task=cfg.get("task", "demo"), n_samples=int(ev["n_samples"]), temperature=float(ev["temperature"]),
                max_new_tokens=int(ev["max_new_tokens"]), seed=int(ev.get("seed", 0)) + int(seed))


def _short(M: Dict[str, Any]) -> str:
    rare = (M.get("splits") or {}).get("demo/rare", {})
    reg = (M.get("splits") or {}).get("demo/regular", {})
    return (f"pass@1 {M['pass@1']:.3f}  pass@16 {M['pass@16']:.3f}  rare pass@16 {rare.get('pass@16', float('nan')):.3f}"
            f"  styles(regular) {reg.get('mean_styles', float('nan')):.2f}")


# ------------------------------------------------------------------ the demo
def run_demo(cfg: Dict[str, Any], out_dir: str, *, cache_dir: Optional[str] = None,
             log: Callable[[str], None] = print, progress: bool = True) -> Dict[str, str]:
    """Run the five stages (module docstring) into ``out_dir``; returns the report's paths."""
    import torch

    clock = _Clock(log)
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    threads = cfg.get("num_threads", 1)
    if threads:
        torch.set_num_threads(int(threads))
    seeds = [int(s) for s in cfg["seeds"]]
    methods = list(cfg["methods"])
    task = cfg.get("task", "demo")
    log(f"openrlhf-div demo{' --quick' if cfg.get('quick') else ''}: {len(methods)} methods x {len(seeds)} seed(s) "
        f"-> {out_dir}")
    log("  task: write N (100..999) in one of five marked styles, e.g. for 537: " +
        ", ".join(f"{render(537, s)} ({STYLE_NAMES[s]})" for s in STYLES))

    # 1. data
    clock.stage(1, "data: the demo task's train / eval split")
    spec = SplitSpec(**cfg["splits"])
    data_dir = os.path.join(out_dir, "data")
    write_splits(data_dir, spec)
    train_rows, eval_rows = read_jsonl(os.path.join(data_dir, "train.jsonl")), read_jsonl(os.path.join(data_dir, "eval.jsonl"))
    n_rare = sum(r["source"] == "demo/rare" for r in eval_rows)
    log(f"  {len(train_rows)} training prompts (RL); {len(eval_rows)} evaluation problems = "
        f"{len(eval_rows) - n_rare} held-out regular + {n_rare} rare-style (N ending in {spec.rare_digit}: only style "
        f"{spec.rare_styles} counts; never seen in RL)")

    # 2. base model
    clock.stage(2, "base model: supervised warm-up of a tiny Qwen2 on style-mixed data with deliberate errors")
    wcfg = WarmupConfig.from_dict(cfg["warmup"])
    base_dir = build_base_model(wcfg, cache_dir, progress=progress, log=lambda s: log("  " + s))
    runs_dir = os.path.join(out_dir, "runs")
    base_run = os.path.join(runs_dir, "base")
    base_settings = {"base_model": wcfg.to_dict(), "base_key": wcfg.key(), "evaluation": _eval_settings(cfg),
                     "splits": spec.to_dict()}
    from ..engines.local.models import load_model

    if _reusable(base_run, base_settings):
        base_eval = read_eval_json(base_run)
        base_M, base_problems = base_eval["metrics"], base_eval["problems"]
        log(f"  base evaluation: reused {base_run}/eval.json")
    else:
        model, tok = load_model(base_dir)
        res = evaluate_model(model, tok, eval_rows, is_base=True, styles=STYLES, **_eval_kw(cfg, 0))
        base_M, base_problems = res["metrics"], res["problems"]
        write_eval(base_run, res, name="base", role="base", seed=None, info=base_settings, model=base_dir,
                   engine="local", data_paths=[os.path.join(data_dir, "eval.jsonl")])
        del model
    log(f"  base: {_short(base_M)}")

    # 3. pre-sampling (only when a method needs D_pef)
    from ..algorithms import get_method

    for m in methods:  # fail early on a bad method name or hyperparameter
        reg, hp, _ = method_spec(cfg, m)
        get_method(reg, **hp)
    needs_anchor = [m for m in methods if get_method(method_spec(cfg, m)[0], **method_spec(cfg, m)[1]).needs.anchor_batch]
    presample_dir = None
    if needs_anchor:
        clock.stage(3, f"pre-sampling (DPH): the base answers every training prompt "
                       f"{cfg['train'].get('presample', {}).get('n_pre', 8)} times; prompts it always solves "
                       f"become D_pef anchors for {', '.join(needs_anchor)}")
        presample_dir = os.path.join(out_dir, "presample")
        summary = _presample(cfg, base_dir, data_dir, presample_dir, progress)
        from ..engines.local.presample import format_summary

        log("  " + format_summary(summary).replace("\n", "\n  "))
        if summary.get("n_pef", 0) == 0:
            log("  WARNING: D_pef is empty (the base solved no training prompt every time): the DPH anchor "
                "loss has nothing to anchor, so DPH runs reduce to PPO-clip without KL. Lower "
                "train.presample.tau or improve the base model.")
    else:
        clock.stage(3, "pre-sampling: skipped (no selected method uses a D_pef anchor)")

    # 4. RL + evaluation of every method and seed
    clock.stage(4, f"RL: {len(methods)} method(s) x {len(seeds)} seed(s), same budget "
                   f"({cfg['train']['optim'].get('steps')} steps x {cfg['train']['rollout'].get('prompts_per_step')} "
                   f"prompts x {cfg['train']['rollout'].get('group_size')} samples), then evaluation")
    per_method: Dict[str, Dict[int, Dict[str, Any]]] = {m: {} for m in methods}
    timings: Dict[str, List[float]] = {m: [] for m in methods}
    total = len(methods) * len(seeds)
    i = 0
    for seed in seeds:
        for m in methods:
            i += 1
            run_dir = os.path.join(runs_dir, m, f"seed{seed}")
            tdict = train_config_dict(cfg, m, seed, base_dir=base_dir, data_dir=data_dir,
                                      presample_dir=presample_dir if m in needs_anchor else None, run_dir=run_dir)
            settings = {"entry": m, "method": tdict["method"], "train": {k: tdict[k] for k in ("rollout", "optim")},
                        "presample": tdict.get("presample"), "base_key": wcfg.key(),
                        "evaluation": _eval_settings(cfg), "splits": spec.to_dict(), "seed": seed}
            if _reusable(run_dir, settings):
                e = read_eval_json(run_dir)
                per_method[m][seed] = e["metrics"]
                log(f"  ({i}/{total}) {m} seed {seed}: reused {run_dir}/eval.json")
                continue
            log(f"  ({i}/{total}) {m} seed {seed}: training ...")
            t0 = time.time()
            M, secs, cpu = _train_and_eval(cfg, tdict, run_dir, eval_rows, base_problems, seed, settings, task,
                                           progress)
            timings[m].append(secs)
            per_method[m][seed] = M
            log(f"      done in {time.time() - t0:.0f} s (training {secs:.0f} s wall, {cpu:.0f} s CPU): {_short(M)}")

    # 5. report
    clock.stage(5, "report")
    settings_md = {}
    for m in methods:
        reg, hp, train_over = method_spec(cfg, m)
        s = {"method": reg, "hyperparameters": json.dumps(hp), "mode": _mode(reg, hp)}
        if train_over:
            s["budget changes"] = json.dumps(train_over)
        s["why"] = (cfg.get("method_notes") or {}).get(m, "-")
        settings_md[m] = s
    common = {"budget": f"{cfg['train']['optim'].get('steps')} steps x {cfg['train']['rollout'].get('prompts_per_step')} "
                        f"prompts x {cfg['train']['rollout'].get('group_size')} samples",
              "lr": cfg["train"]["optim"].get("learning_rate"),
              "temperature": cfg["train"]["rollout"].get("temperature"), "seeds": seeds}
    metrics = build_metrics(task, base_M, per_method, settings={"common": common, "methods": cfg["method_settings"],
                                                                "warmup": wcfg.to_dict(), "splits": spec.to_dict(),
                                                                "evaluation": cfg["evaluation"],
                                                                "quick": bool(cfg.get("quick"))},
                            timing={"total_s": time.time() - clock.t0,
                                    "cpu_s": time.process_time() - clock.c0,
                                    "train_s_per_run": {m: (sum(v) / len(v) if v else None) for m, v in timings.items()}})
    paths = write_report(out_dir, metrics, settings={"all methods": common, **settings_md},
                         notes=demo_notes(cfg, metrics), title="openrlhf-div demo: diversity under RL on a toy task",
                         intro=demo_intro(cfg, spec))
    log(f"  wrote {paths['report']}, {paths['metrics']}, {os.path.basename(paths['passk_plot'])}, "
        f"{os.path.basename(paths.get('styles_plot', ''))}")
    log(f"\ndone in {time.time() - clock.t0:.0f} s (CPU time {time.process_time() - clock.c0:.0f} s; the two differ "
        f"when other processes share the cores). Summary (mean over seeds):")
    log(f"  {'model':<10} {'pass@1':>7} {'pass@16':>8} {'rare@16':>8} {'styles':>7}")
    for name, M in [("base", metrics["base"])] + list(metrics["methods"].items()):
        rare = (M.get("splits") or {}).get("demo/rare", {}).get("pass@16", float("nan"))
        sty = (M.get("splits") or {}).get("demo/regular", {}).get("mean_styles", float("nan"))
        log(f"  {name:<10} {M['pass@1']:7.3f} {M['pass@16']:8.3f} {rare:8.3f} {sty:7.2f}")
    log(f"  full report: {paths['report']}")
    return paths


def _presample(cfg, base_dir, data_dir, presample_dir, progress):
    from ..engines.local.config import config_from_dict
    from ..engines.local.presample import presample

    tdict = train_config_dict(cfg, "grpo", 0, base_dir=base_dir, data_dir=data_dir, presample_dir=None,
                              run_dir=os.path.dirname(presample_dir))
    tdict["method"] = {"name": "grpo"}
    tcfg = config_from_dict(tdict)
    try:
        return presample(tcfg, presample_dir, progress=progress)
    except ValueError as e:
        if "different settings" not in str(e):
            raise
        return presample(tcfg, presample_dir, overwrite=True, progress=progress)


def _train_and_eval(cfg, tdict, run_dir, eval_rows, base_problems, seed, settings, task, progress):
    from ..engines.local.config import config_from_dict
    from ..engines.local.trainer import Trainer

    if os.path.isdir(run_dir):
        shutil.rmtree(run_dir)  # stale or unfinished: start the run afresh
    tdict = copy.deepcopy(tdict)
    tdict["logging"]["progress"] = bool(progress)
    tcfg = config_from_dict(tdict)
    t0, c0 = time.time(), time.process_time()
    trainer = Trainer(tcfg)
    trainer.train()
    secs, cpu = time.time() - t0, time.process_time() - c0
    trainer.model.eval()
    res = evaluate_model(trainer.model, trainer.tokenizer, eval_rows, base_problems=base_problems, styles=STYLES,
                         **_eval_kw(cfg, seed))
    M = res["metrics"]
    write_eval(run_dir, res, name=settings["entry"], role="method", seed=seed, info=settings,
               model=os.path.join(run_dir, "final_model"), engine="local",
               data_paths=[os.path.normpath(os.path.join(run_dir, "..", "..", "..", "data", "eval.jsonl"))])
    # keep the run small: the final model stays, the (identical) last checkpoint goes
    shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
    return M, secs, cpu


# ------------------------------------------------------------------ report text
def demo_intro(cfg: Dict[str, Any], spec: SplitSpec) -> str:
    ex = ", ".join(f"`{render(537, s)}` ({STYLE_NAMES[s]})" for s in STYLES)
    w = cfg["warmup"]
    return (
        "**Task.** The prompt is `N =` with N in 100..999; a correct answer writes N in one of five styles, "
        f"marked by the first character: {ex}. Reward 1 for a correct answer in an allowed style, else 0. "
        f"Every N ending in {spec.rare_digit} is a *rare-style* problem that only style {spec.rare_styles} solves; "
        "these problems are never used in RL (they are evaluation-only), so their pass@k measures whether a policy "
        "still produces the rare style correctly after RL. The other N split into "
        f"{spec.n_eval_regular} held-out *regular* evaluation problems (any style counts) and the RL training prompts.\n\n"
        f"**Base model.** A {w.get('num_layers', 2)}-layer, width-{w.get('hidden_size', 64)} Qwen2 trained from "
        f"scratch for {w.get('steps')} steps x {w.get('batch_size')} synthetic answers with styles A-E at "
        f"{'/'.join(str(int(round(100 * x))) for x in w.get('style_weights', []))} % and deliberate one-digit "
        f"errors ({int(round(100 * w.get('err_easy', 0)))} % for N < {w.get('easy_below')}, "
        f"{'/'.join(str(int(round(100 * x))) for x in w.get('err_by_style', []))} % by style otherwise): it "
        "samples every style and is often wrong, so RL has something to improve and something to lose."
    )


def demo_notes(cfg: Dict[str, Any], metrics: Dict[str, Any]) -> List[str]:
    notes = [
        "Settings are the toy's, not the papers': the LLM hyperparameters (eta 0.01 for DPH-F, gamma 0.01 for "
        "DS, ...) are tuned for 7B models over thousands of steps; here 2-layer models train for "
        f"{cfg['train']['optim'].get('steps')} steps. The values used and why are listed under *Settings used*.",
        "`mean_styles` over all problems mixes two kinds of problems: a rare-style problem has at most one correct "
        "style. Read the `styles regular` column (held-out regular problems, where all five styles count) for the "
        "style collapse, and the `pass@16 rare` column for the pass@k collapse.",
        "The base's style count is lowered by its own errors: its correct samples per style are few, so read the "
        "style mix (share of correct samples per style, and each style's accuracy) next to the count.",
        "keep / explore: a problem counts as solved at pass@8 when one of the model's first 8 samples is correct; "
        "explore is the share of problems the base did not solve that the model solves.",
    ]
    notes.append("How much of this rests on the settings (the papers' own hyperparameters, LAD's eta and number "
                 "of passes per batch, a strong reverse KL, twice the steps) is measured in docs/demo.md; "
                 "reproduce it with `openrlhf-div demo --config configs/demo_investigate.yaml`.")
    if len(cfg["seeds"]) < 3:
        notes.append(f"Only {len(cfg['seeds'])} seed(s) ran: differences between methods are not established by "
                     "this run (use the default 3 seeds, or more, before drawing a conclusion).")
    extra = cfg.get("report_notes") or []
    return notes + list(extra)
