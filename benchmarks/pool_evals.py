"""Pool several `openrlhf-div eval` outputs of one model into one evaluation with more samples.

Two evaluations of the same model, prompts and settings that differ only in their evaluation seed are
independent samples of the same distribution: their per-problem correct lists, put together, are one
evaluation with n1 + n2 samples per problem, and the unbiased pass@k estimator over the pooled list
has less variance (and reaches k up to the pooled n). Issue 40's study used it on the base model,
whose pass@64 moved by 0.19 between two 64-sample evaluations (docs/real_model.md).

    python benchmarks/pool_evals.py --out POOLED EVAL_DIR EVAL_DIR [...] [--base-results BASE_DIR]

Refused (one line, exit 2): evaluations of different models, tasks, prompts, sampling settings,
roles or training seeds; an evaluation seed given twice (the same samples counted twice). The output
is an ordinary eval.json (`compare` reads it); its `info.pooled_from` names the inputs and their
evaluation seeds. dist-n is left out (the samples' texts are in each input's samples.jsonl).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

#: settings that may differ between pooled evaluations (everything else must be equal)
FREE = ("n", "ks")


def pool(dirs: Sequence[str], base_dir: Optional[str] = None) -> Dict[str, Any]:
    """The pooled eval.json content of ``dirs`` (ValueError naming the first difference)."""
    from openrlhf_div.eval.results import model_metrics, read_eval_json

    evals = [(d, read_eval_json(d)) for d in dirs]
    if len(evals) < 2:
        raise ValueError("give at least two evaluations to pool")
    ref_path, ref = evals[0]
    keep = {k: v for k, v in ref["settings"].items() if k not in FREE}
    seeds: List[Any] = []
    for path, e in evals:
        for key in ("task", "role", "seed"):
            if e.get(key) != ref.get(key):
                raise ValueError(f"{path}: {key} {e.get(key)!r} differs from {ref_path}'s {ref.get(key)!r}; "
                                 "pool evaluations of one model only")
        mine = {k: v for k, v in e["settings"].items() if k not in FREE}
        if mine != keep:
            diff = sorted(k for k in set(mine) | set(keep) if mine.get(k) != keep.get(k))
            raise ValueError(f"{path}: settings {', '.join(diff)} differ from {ref_path}'s; pool evaluations that "
                             "differ only in their evaluation seed")
        es = (e.get("info") or {}).get("eval_seed")
        if es is None or es in seeds:
            raise ValueError(f"{path}: evaluation seed {es!r} {'unknown' if es is None else 'given twice'}: "
                             "pooling would count one set of samples twice")
        seeds.append(es)
        if [p["id"] for p in e["problems"]] != [p["id"] for p in ref["problems"]]:
            raise ValueError(f"{path}: its problems differ from {ref_path}'s")
    problems = []
    for ps in zip(*[e["problems"] for _, e in evals]):
        correct = [c for p in ps for c in p["correct"]]
        problems.append({"id": ps[0]["id"], "source": ps[0].get("source", ""), "correct": correct,
                         "n_correct": int(sum(correct))})
    n = len(problems[0]["correct"])
    if ref["role"] == "base":
        metrics = model_metrics(problems, is_base=True)
    else:
        base = None
        if base_dir:
            base = read_eval_json(base_dir)["problems"]
        metrics = model_metrics(problems, base=base)
    ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if k <= n} | {n})
    for k in ks:
        metrics[f"pass@{k}"] = metrics["pass_at_k"][str(k)]
    settings = dict(ref["settings"], n=n, ks=ks)
    info = dict(ref.get("info") or {}, eval_seed=None,
                pooled_from=[{"path": os.path.abspath(p), "eval_seed": e["info"]["eval_seed"],
                              "n": e["settings"]["n"]} for p, e in evals])
    return {"task": ref["task"], "name": ref["name"], "role": ref["role"], "metrics": metrics,
            "problems": problems, "settings": settings, "seed": ref.get("seed"), "info": info}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", metavar="EVAL_DIR")
    ap.add_argument("--out", required=True)
    ap.add_argument("--base-results", default=None, help="the base model's eval (keep / explore rates)")
    a = ap.parse_args(argv)
    try:
        pooled = pool(a.dirs, a.base_results)
    except (ValueError, OSError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from openrlhf_div.eval.results import write_eval_json

    path = write_eval_json(a.out, **pooled)
    m = pooled["metrics"]
    print(f"{path}: {pooled['name']} pooled from {len(a.dirs)} evaluations, n {pooled['settings']['n']}: "
          + ", ".join(f"pass@{k} {m[f'pass@{k}']:.3f}" for k in pooled["settings"]["ks"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
