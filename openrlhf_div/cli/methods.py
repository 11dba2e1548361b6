"""``openrlhf-div methods``: the method registry as a table (or JSON)."""
from __future__ import annotations

import json


def add_parser(sub):
    p = sub.add_parser("methods", help="list the registered methods, their defaults and needs")
    p.add_argument("name", nargs="?", help="show one method in full")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--config", metavar="PATH",
                   help="with NAME: an OpenRLHF / Megatron experiment config (configs/openrlhf/*.yaml, "
                        "configs/megatron/*.yaml) whose method is NAME: also print the authors' layout of one rollout "
                        "step it implies (authors_world_size, per-step anchor weights)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from openrlhf_div.algorithms import get_method, method_table

    if args.name:
        if getattr(args, "config", None):
            return _with_config(args.name, args.config)
        d = get_method(args.name).describe()
        print(json.dumps(d, indent=2, default=str))
        return 0
    table = method_table()
    if args.json:
        print(json.dumps(table, indent=2, default=str))
        return 0
    print(f"{'method':<16} {'loss':<9} {'estimator':<8} needs                      summary")
    for name, d in table.items():
        needs = ",".join(k for k, v in d["needs"].items() if v and k != "old_log_probs") or "-"
        print(f"{name:<16} {d['policy_loss']:<9} {d['estimator']:<8} {needs:<26} {d['summary']}")
    return 0


def _with_config(name: str, path: str) -> int:
    """The method as the config builds it, and the authors' layout of one rollout step."""
    from openrlhf_div.engines.openrlhf import launch

    p = launch.plan(["--config", path, "--dry-run"])
    if p.method.name != name:
        raise SystemExit(f"{path} trains method {p.method.name!r}, not {name!r}: "
                         f"run `openrlhf-div methods {p.method.name} --config {path}`")
    h = p.method.hparams
    print(f"{name} as {path} runs it: " + ", ".join(f"{k}={h[k]}" for k in sorted(h)))
    lines = launch.authors_layout_lines(p.method, p.args)
    print("\n".join(lines) if lines else "no authors' layout (aggregation is not micro-batch-token-mean or the "
                                         "method has no anchors)")
    return 0
