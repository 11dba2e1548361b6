"""Which problems a trained model lost or gained against its base model, at the largest k evaluated.

pass@k at large k is an average over problems; this names the problems behind it: a problem is
**lost** when the base solves it in at least ``--min-base-rate`` of its samples (default 0.01: not a
one-off) and the model in none of its own, **gained** when the base never solves it and the model
does. Read it with the two sample counts in view (a model with fewer samples than the base loses
rare problems by chance more easily); issue 40's study (docs/real_model.md) compares pooled
evaluations: 256 samples of the base against 128 of each model.

    python benchmarks/coverage.py BASE_EVAL MODEL_EVAL [MODEL_EVAL ...] [--min-base-rate 0.01] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, Optional, Sequence


def _load(path: str) -> Dict[str, Any]:
    from openrlhf_div.eval.results import read_eval_json

    return read_eval_json(path)


def coverage(base: Dict[str, Any], model: Dict[str, Any], min_base_rate: float = 0.01) -> Dict[str, Any]:
    """``{"n_base", "n_model", "base_solved", "model_solved", "lost": [ids], "gained": [ids],
    "lost_base_rates": [...]}`` over the problems both evaluated (ValueError when they share none)."""
    b = {p["id"]: p["correct"] for p in base["problems"]}
    m = {p["id"]: p["correct"] for p in model["problems"]}
    ids = [i for i in b if i in m]
    if not ids:
        raise ValueError("the two evaluations share no problem")
    rate = {i: sum(b[i]) / len(b[i]) for i in ids}
    lost = [i for i in ids if rate[i] >= min_base_rate and sum(m[i]) == 0]
    gained = [i for i in ids if sum(b[i]) == 0 and sum(m[i]) > 0]
    return {"problems": len(ids), "n_base": len(b[ids[0]]), "n_model": len(m[ids[0]]),
            "base_solved": sum(1 for i in ids if sum(b[i]) > 0), "model_solved": sum(1 for i in ids if sum(m[i]) > 0),
            "lost": lost, "lost_base_rates": [round(rate[i], 4) for i in lost], "gained": gained}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base")
    ap.add_argument("models", nargs="+")
    ap.add_argument("--min-base-rate", type=float, default=0.01)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        base = _load(a.base)
        rows = {}
        for path in a.models:
            e = _load(path)
            rows[f"{e.get('name')} (seed {e.get('seed')})"] = coverage(base, e, a.min_base_rate)
    except (OSError, KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"| model | samples (base / model) | base solves | model solves | lost (base rate >= {a.min_base_rate:g}) | "
          "their base rates | gained |")
    print("|---|---|---:|---:|---:|---|---:|")
    for name, c in rows.items():
        print(f"| {name} | {c['n_base']} / {c['n_model']} | {c['base_solved']} of {c['problems']} | {c['model_solved']} | "
              f"{len(c['lost'])} | {', '.join(f'{r:.3f}' for r in c['lost_base_rates']) or '-'} | {len(c['gained'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
