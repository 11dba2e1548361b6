"""``openrlhf-div bandit``: the controlled 50-arm bandit (ALGORITHMS.md section 7).

One method::

    openrlhf-div bandit --method lad_js --json runs/lad_js.json --plot runs/lad_js.png

Every method (one JSON + one PNG each, summary.json, summary.md, the table printed)::

    openrlhf-div bandit --all --out runs/bandit

See :mod:`openrlhf_div.bandit` for the set-up and the analytic targets.
"""
from __future__ import annotations

import argparse
import math
import os
import sys


def _int_at_least(flag, lo):
    """argparse type: an integer >= ``lo``, with an error naming the flag."""
    what = "a positive integer" if lo == 1 else f"an integer >= {lo}"

    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be {what}, got {text!r}")
        if v < lo:
            raise argparse.ArgumentTypeError(f"{flag} must be {what}" + (" (>= 1)" if lo == 1 else "")
                                             + f", got {v}")
        return v
    return parse


def _float(flag, positive=True):
    def parse(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number, got {text!r}")
        ok = math.isfinite(v) and (v > 0 if positive else v >= 0)
        if not ok:
            raise argparse.ArgumentTypeError(f"{flag} must be a finite number {'> 0' if positive else '>= 0'}, got {text}")
        return v
    return parse


def _method(text):
    from openrlhf_div.bandit import check_method

    try:
        return check_method(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def add_parser(sub):
    from openrlhf_div.bandit import BANDIT_METHODS

    p = sub.add_parser(
        "bandit", help="the controlled 50-arm bandit: LAD / GRPO / DS against their analytic optima",
        description="The controlled 50-arm bandit of LAD's Figure 1 (three reward modes, 32 samples/step "
                    "from pi_old at T=1.5, Adam 5e-3, 4000 steps, pi_old refreshed twice) and the DS "
                    "closed-form check (DS Lemma B.5). Methods: " + ", ".join(BANDIT_METHODS) + ".",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--method", type=_method, metavar="NAME", help="one bandit method")
    what.add_argument("--all", action="store_true", help="run every bandit method into --out")
    p.add_argument("--steps", type=_int_at_least("--steps", 1), default=4000, help="training steps (default 4000)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--eta", type=_float("--eta"), default=1.0,
                   help="LAD eta = GRPO's KL(pi||pi_old) weight = DS beta (default 1)")
    p.add_argument("--json", metavar="PATH", help="(--method) write the result JSON here")
    p.add_argument("--plot", metavar="PATH", help="(--method) write the policy-vs-target PNG here")
    p.add_argument("--out", metavar="DIR", default="runs/bandit", help="(--all) output folder (default runs/bandit)")
    p.add_argument("--exact-expectation", action="store_true",
                   help="use all arms weighted by pi_old instead of 32 samples at T=1.5 (removes sampling noise)")
    p.add_argument("--batch", type=_int_at_least("--batch", 1), default=32, help="samples per step (default 32)")
    p.add_argument("--temperature", type=_float("--temperature"), default=1.5, help="sampling temperature (default 1.5)")
    p.add_argument("--lr", type=_float("--lr"), default=5e-3, help="Adam learning rate (default 5e-3)")
    p.add_argument("--refreshes", type=_int_at_least("--refreshes", 0), default=2,
                   help="pi_old refreshes for LAD/GRPO (default 2: three phases)")
    p.add_argument("--gamma-p", type=_float("--gamma-p", positive=False), default=0.5, help="DS gamma_p (default 0.5)")
    p.add_argument("--gamma-n", type=_float("--gamma-n", positive=False), default=0.5, help="DS gamma_n (default 0.5)")
    p.add_argument("--workers", type=_int_at_least("--workers", 1), default=None,
                   help="(--all) parallel processes (default: min(2, CPU count))")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    import torch

    from openrlhf_div.bandit import (
        BanditConfig, plot_result, run_all, run_bandit, summary_text, write_json,
    )

    cfg = BanditConfig(steps=args.steps, seed=args.seed, eta=args.eta, batch=args.batch,
                       temperature=args.temperature, lr=args.lr, refreshes=args.refreshes,
                       exact_expectation=args.exact_expectation,
                       ds_gamma_p=args.gamma_p, ds_gamma_n=args.gamma_n)
    try:
        cfg.validate()
    except ValueError as e:
        print(f"openrlhf-div bandit: error: {e}", file=sys.stderr)
        return 2
    if args.all:
        if args.json or args.plot:
            print("openrlhf-div bandit: error: --json/--plot are for --method; --all writes into --out",
                  file=sys.stderr)
            return 2
        workers = args.workers or min(2, os.cpu_count() or 1)
        results = run_all(args.out, cfg, workers=workers, show_progress=not args.no_progress)
        print(summary_text(results), end="")
        print(f"wrote {len(results)} JSON + PNG, summary.json, summary.md to {args.out}")
        return 0

    from openrlhf_div.progress import progress_bar

    torch.set_num_threads(1)
    with progress_bar(total=cfg.steps, desc=args.method, unit="step", disable=args.no_progress, mininterval=0.5,
                      dynamic_ncols=True) as bar:
        res = run_bandit(args.method, cfg, progress=bar.update)
    print(summary_text([res]), end="")
    if args.json:
        write_json(res, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot_result(res, args.plot)
        print(f"wrote {args.plot}")
    return 0
