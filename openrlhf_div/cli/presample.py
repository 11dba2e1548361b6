"""``openrlhf-div presample``: DPH-RL's pre-sampling split into D_pef / D_exp.

    openrlhf-div presample --config configs/local_example.yaml [--out DIR] [--n-pre 8]
                           [--tau 8] [--drop-unsolved] [--resample-anchor-responses] [key=value ...]

Interrupt it at any time; the same command continues where it stopped.
"""
from __future__ import annotations

import sys


def add_parser(sub):
    p = sub.add_parser("presample", help="DPH-RL pre-sampling: split training prompts into D_pef / D_exp",
                       description="Sample n_pre responses per training prompt from the base policy, keep one "
                                   "correct response with its base log-probs for near-perfect prompts (D_pef) "
                                   "and the rest as D_exp. Resumable.")
    p.add_argument("--config", "-c", required=True, help="YAML config (model, task, data.train, rollout)")
    p.add_argument("--out", help="output directory (default: presample.output_dir, else data.presample_dir (the "
                                 "folder training reads), else OUTPUT_DIR/presample)")
    p.add_argument("--n-pre", type=int, help="samples per prompt (presample.n_pre, default 8)")
    p.add_argument("--tau", type=int, help="near-perfect threshold #correct >= tau (default n_pre)")
    p.add_argument("--drop-unsolved", action="store_true", help="leave prompts with 0 correct out of D_exp")
    p.add_argument("--resample-anchor-responses", action="store_true",
                   help="draw each anchor response afresh (n=1, kept if correct), as the DPH-RL authors' code does")
    p.add_argument("--chunk-size", type=int, help="prompts per resumable chunk (default 32)")
    p.add_argument("--overwrite", action="store_true", help="discard an existing run in the output directory")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from openrlhf_div.engines.local.config import ConfigError, load_config
    from openrlhf_div.engines.local.presample import format_summary, presample

    ov = list(args.overrides)
    for flag, key in ((args.n_pre, "presample.n_pre"), (args.tau, "presample.tau"),
                      (args.chunk_size, "presample.chunk_size")):
        if flag is not None:
            ov.append(f"{key}={flag}")
    if args.drop_unsolved:
        ov.append("presample.drop_unsolved=true")
    if args.resample_anchor_responses:
        ov.append("presample.resample_anchor_responses=true")
    try:
        cfg = load_config(args.config, ov)
        summary = presample(cfg, args.out, overwrite=args.overwrite)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"presample: {e}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0
