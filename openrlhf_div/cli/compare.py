"""``openrlhf-div compare``: one comparison report from run directories.

    openrlhf-div compare runs/demo/runs/base runs/demo/runs/*/seed* --out runs/cmp

Each RUN_DIR is an eval output (a folder holding ``eval.json``, format:
:mod:`openrlhf_div.eval.results`, written by ``openrlhf-div eval`` / ``demo`` / ``train``) or a
``train`` run directory: its in-training evaluation (``eval.json``), or, when it has none, its
final model is evaluated on its config's ``data.eval`` first. ``NAME=RUN_DIR`` names a run
(default: from the eval.json). Exactly one run has ``role: base``, or name it with ``--base``
(without one, a run folder's ``eval_step0.json``).

Runs are grouped by what they ran (method, engine, the resolved settings of the run folder's
``run_info.json`` except the seed, evaluation settings); a group's runs are its seeds (mean +-
sd). A method whose runs differ in a setting gets one row per setting, labelled by the differing
keys (``dph_js [method.anchor_eta=0.3]``); a repeated (method, settings, seed) is refused in one
line; a seed is never invented (``unknown`` when no file records it); rows that differ in
anything but the method's own settings, and runs whose settings are unknown, are flagged at the
top of the report. Runs evaluated with different settings (n, temperature, top_p,
max_new_tokens, grading, data, keep_k) are refused with the list of differences unless
``--allow-mismatch`` (the report then says so). Writes metrics.json, report.md, passk.png,
styles.png, and, when the runs kept periodic held-out evaluations (``eval.jsonl``), curves.png
and a table of pass@k against training steps (mean and sd over each row's seeds). Rules: docs/demo.md.
"""
from __future__ import annotations

import sys


def add_parser(sub):
    p = sub.add_parser("compare", help="comparison report (metrics.json, report.md, plots) from run directories",
                       description="Build metrics.json, report.md and the pass@k / style plots from eval outputs "
                                   "(eval.json) and train run directories.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="eval outputs or train run directories (or eval.json files), optionally NAME=DIR")
    p.add_argument("--out", required=True, help="output directory of the report")
    p.add_argument("--base", default=None, help="the base model's run directory (default: the run with role 'base')")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="compare runs evaluated with different settings (the report marks it)")
    p.add_argument("--style-split", default="auto",
                   help="split used for the style plot/table (default: a '*regular' split if present)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from openrlhf_div.engines.local.evaluation import evaluate_run_dir
    from openrlhf_div.eval.report import compare_runs

    try:
        paths = compare_runs(args.run_dirs, args.out, base_dir=args.base, style_split=args.style_split,
                             allow_mismatch=args.allow_mismatch, evaluate_missing=evaluate_run_dir)
    except (FileNotFoundError, ValueError) as e:
        msg = str(e)
        print(msg if msg.startswith("compare:") else f"compare: {msg}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(paths.values()))
    return 0
