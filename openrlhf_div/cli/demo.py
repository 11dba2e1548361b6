"""``openrlhf-div demo``: the diversity demo from nothing (base model, pre-sampling, RL with
every method, evaluation, report). See :mod:`openrlhf_div.demo.pipeline`.

    openrlhf-div demo                       # 6 methods x 3 seeds, out: runs/demo
    openrlhf-div demo --quick               # 1 seed, short budget, out: runs/demo_quick
    openrlhf-div demo --methods grpo dph_f --seeds 0 1 --set train.optim.steps=50
"""
from __future__ import annotations

import sys


def add_parser(sub):
    p = sub.add_parser("demo", help="the diversity demo: base model, pre-sampling, RL per method, report",
                       description="Build (or reuse) the demo's base model, pre-sample D_pef, train every "
                                   "method with the same budget and seeds, evaluate base and methods (16 "
                                   "samples per problem) and write metrics.json, report.md and plots.")
    p.add_argument("--quick", action="store_true", help="1 seed and a short budget (the config's `quick` section)")
    p.add_argument("--out", default=None, help="output directory (default runs/demo, or runs/demo_quick with --quick)")
    p.add_argument("--seeds", type=int, nargs="+", help="seeds (default: the config's)")
    p.add_argument("--methods", nargs="+", help="methods (default: the config's; see `openrlhf-div methods`)")
    p.add_argument("--config", default=None, help="demo YAML (default: configs/demo.yaml)")
    p.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="key=value",
                   help="override config entries, e.g. train.optim.steps=50 method_settings.dph_f.anchor_eta=0.1")
    p.add_argument("--cache-dir", default=None, help="base-model cache (default $OPENRLHF_DIV_CACHE or "
                                                     "~/.cache/openrlhf-div)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    import os

    import torch

    from openrlhf_div.demo.pipeline import load_demo_config, run_demo

    if not torch.cuda.is_available():
        # transformers imports DeepSpeed lazily; without this it logs a "Setting accelerator to CPU"
        # warning in the middle of the demo's progress output
        os.environ.setdefault("DS_ACCELERATOR", "cpu")

    try:
        cfg = load_demo_config(args.config, quick=args.quick, overrides=args.overrides)
    except (FileNotFoundError, ValueError) as e:
        print(f"demo config error: {e}", file=sys.stderr)
        return 2
    if args.seeds:
        cfg["seeds"] = list(args.seeds)
    if args.methods:
        from openrlhf_div.algorithms import list_methods

        known = set(list_methods()) | {k for k, v in (cfg.get("method_settings") or {}).items()
                                       if isinstance(v, dict) and "method" in v}
        bad = [m for m in args.methods if m not in known]
        if bad:
            print(f"unknown method(s) {bad}: give registered methods (`openrlhf-div methods`) or variants "
                  f"defined in the config's method_settings with a `method:` key", file=sys.stderr)
            return 2
        cfg["methods"] = list(args.methods)
        for m in args.methods:
            cfg.setdefault("method_settings", {}).setdefault(m, {})
    out = args.out or ("runs/demo_quick" if args.quick else "runs/demo")
    run_demo(cfg, out, cache_dir=args.cache_dir, progress=not args.no_progress)
    return 0
