"""``openrlhf-div methods``: the method registry as a table (or JSON)."""
from __future__ import annotations

import json


def add_parser(sub):
    p = sub.add_parser("methods", help="list the registered methods, their defaults and needs")
    p.add_argument("name", nargs="?", help="show one method in full")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from openrlhf_div.algorithms import get_method, method_table

    if args.name:
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
