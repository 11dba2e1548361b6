"""``openrlhf-div compare``: one comparison report from run directories.

    openrlhf-div compare runs/demo/runs/base runs/demo/runs/*/seed* --out runs/cmp

Each RUN_DIR holds an ``eval.json`` (format: :mod:`openrlhf_div.eval.results`) or the
``results.json`` of ``openrlhf-div eval``; ``NAME=RUN_DIR`` names a run (default: from the
eval.json, or the directory: ``.../grpo/seed1`` is method ``grpo``, seed 1). Exactly one run
has ``role: base``, or name it with ``--base``. Runs of one method name with different
seeds are averaged (mean +- sd). Writes metrics.json, report.md, passk.png, styles.png.
"""
from __future__ import annotations

import sys


def add_parser(sub):
    p = sub.add_parser("compare", help="comparison report (metrics.json, report.md, plots) from run directories",
                       description="Build metrics.json, report.md and the pass@k / style plots from run "
                                   "directories that each hold an eval.json.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (or eval.json / results.json files), optionally NAME=DIR")
    p.add_argument("--out", required=True, help="output directory of the report")
    p.add_argument("--base", default=None, help="the base model's run directory (default: the run with role 'base')")
    p.add_argument("--style-split", default="auto",
                   help="split used for the style plot/table (default: a '*regular' split if present)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from openrlhf_div.eval.report import compare_runs

    try:
        paths = compare_runs(args.run_dirs, args.out, base_dir=args.base, style_split=args.style_split)
    except (FileNotFoundError, ValueError) as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(paths.values()))
    return 0
