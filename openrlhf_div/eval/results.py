"""Per-model metrics from scored samples, and the ``eval.json`` file a run directory holds.

A model is evaluated by sampling ``n`` responses for each evaluation problem and scoring
them with the task. :func:`model_metrics` turns those scored samples into the metric dict
``M`` that ``metrics.json`` / ``report.md`` / ``openrlhf-div compare`` use::

    problems = [{"id": "demo-537", "source": "demo/regular",
                 "correct": [1, 0, 1, ...],            # n outcomes
                 "styles":  ["A", "B", "A", ...],      # n style labels (optional)
                 "responses": ["A537", "B520+7", ...]}, # n texts (optional: dist-n)
                ...]
    M = model_metrics(problems, base=base_problems)

``M`` keys (all over every evaluation problem unless said otherwise):

- ``pass@1``, ``pass@8``, ``pass@16`` (those ``k <= n``) and ``pass_at_k`` = ``{"1": ..,
  .., "n": ..}``: the unbiased estimator ``1 - C(n-c, k) / C(n, k)`` averaged over problems.
- ``mean_styles``: the mean number of distinct styles among the correct samples of a
  problem; ``share_ge_3_styles``; ``styles_hist`` = ``{"0": share, .., "5": share}`` of
  problems by that number (DPH Figure 5 / DS Table 7).
- ``style_mix``: the share of *correct* samples in each style; ``sample_style_mix``: the
  share of *all* samples by their style prefix (``"other"`` for an unknown prefix, as DPH
  App. A counts "Others"); ``style_accuracy``: the share of a style's samples that are
  correct (the base's style count is lowered by its own errors: read the two together).
- ``keep_rate`` / ``explore_rate`` against the base (ALGORITHMS.md 6, DPH 6.2): a problem is
  *solved at pass@8* when one of its **first 8** samples is correct (one draw of the pass@8
  event); keep = share of base-solved problems the model solves, explore = share of
  base-unsolved ones it solves (``None`` when that split is empty). For the base itself they
  are 1.0 and 0.0 by definition.
- ``dist-2``, ``dist-3``: distinct character n-grams / all character n-grams over a
  problem's samples, averaged over problems (LAD Table 4; responses here are one "word",
  so characters are the unit); ``unique_frac``: distinct responses / n, averaged.
- ``splits``: the same accuracy and style metrics per ``source`` (e.g. ``demo/regular``,
  ``demo/rare``).

The eval-output file of a run directory is ``eval.json`` (:func:`write_eval_json`)::

    {"format": "openrlhf-div.eval/1", "task": "demo", "name": "grpo", "role": "method",
     "seed": 0, "settings": {...}, "metrics": M, "problems": [per-problem records]}

``role`` is ``"base"`` or ``"method"``; ``problems`` carries ``id``, ``source``,
``correct`` and ``styles`` per problem (no texts), so ``openrlhf-div compare`` can recompute
keep / explore rates against any base. ``compare`` also reads the ``results.json`` that
``openrlhf-div eval`` writes (:func:`load_run`), so run directories of any engine compare.
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from .diversity import distinct_n, keep_explore_rates
from .passk import pass_at_k
from openrlhf_div.io import atomic_write_text as _atomic_write_text

EVAL_FORMAT = "openrlhf-div.eval/1"
EVAL_FILE = "eval.json"
REPORT_KS = (1, 8, 16)


def _check(problems: Sequence[Mapping[str, Any]]) -> int:
    if not problems:
        raise ValueError("model_metrics: no problems given")
    ns = {len(p["correct"]) for p in problems}
    if len(ns) != 1:
        raise ValueError(f"model_metrics: every problem needs the same number of samples, got {sorted(ns)}")
    n = ns.pop()
    if n == 0:
        raise ValueError("model_metrics: problems have 0 samples")
    for p in problems:
        if "styles" in p and p["styles"] is not None and len(p["styles"]) != n:
            raise ValueError(f"model_metrics: problem {p.get('id')!r} has {len(p['styles'])} styles for {n} samples")
    return n


def solved_at(problems: Sequence[Mapping[str, Any]], k: int = 8) -> Dict[str, bool]:
    """``{id: any of the first k samples correct}`` (one draw of the pass@k event)."""
    return {str(p["id"]): bool(any(p["correct"][:k])) for p in problems}


def _accuracy_and_styles(problems: Sequence[Mapping[str, Any]], n: int,
                         styles: Optional[Sequence[str]]) -> Dict[str, Any]:
    c = np.array([int(sum(bool(x) for x in p["correct"])) for p in problems])
    out: Dict[str, Any] = {"n_problems": len(problems), "n_samples": n}
    curve = {str(k): float(np.mean(pass_at_k(n, c, k))) for k in range(1, n + 1)}
    for k in REPORT_KS:
        if k <= n:
            out[f"pass@{k}"] = curve[str(k)]
    out["pass_at_k"] = curve
    have_styles = all(p.get("styles") is not None for p in problems)
    if not have_styles:
        return out
    names = list(styles) if styles is not None else sorted(
        {s for p in problems for s in p["styles"]} - {"other"})
    counts = []
    correct_by_style = {s: 0 for s in names}
    all_by_style = {s: 0 for s in list(names) + ["other"]}
    for p in problems:
        cs = {s for s, ok in zip(p["styles"], p["correct"]) if ok}
        counts.append(len(cs))
        for s, ok in zip(p["styles"], p["correct"]):
            key = s if s in all_by_style else "other"
            all_by_style[key] += 1
            if ok and s in correct_by_style:
                correct_by_style[s] += 1
    counts_a = np.array(counts)
    n_correct = sum(correct_by_style.values())
    n_all = sum(all_by_style.values())
    out["mean_styles"] = float(counts_a.mean())
    out["share_ge_3_styles"] = float((counts_a >= 3).mean())
    out["styles_hist"] = {str(j): float((counts_a == j).mean()) for j in range(len(names) + 1)}
    out["style_mix"] = {s: (correct_by_style[s] / n_correct if n_correct else 0.0) for s in names}
    out["sample_style_mix"] = {s: all_by_style[s] / n_all for s in all_by_style}
    out["style_accuracy"] = {s: (correct_by_style[s] / all_by_style[s] if all_by_style[s] else None)
                             for s in names}
    return out


def model_metrics(problems: Sequence[Mapping[str, Any]], base: Optional[Sequence[Mapping[str, Any]]] = None,
                  *, is_base: bool = False, styles: Optional[Sequence[str]] = None,
                  keep_k: int = 8) -> Dict[str, Any]:
    """The metric dict ``M`` of one model (see the module docstring).

    ``base``: the base model's problems (same ids) for keep / explore rates; ``is_base``
    marks the base itself (keep 1.0, explore 0.0). With neither, both rates are ``None``.
    """
    n = _check(problems)
    M = _accuracy_and_styles(problems, n, styles)
    if is_base:
        M["keep_rate"], M["explore_rate"] = 1.0, 0.0
    elif base is not None:
        keep, explore = keep_explore_rates(solved_at(base, keep_k), solved_at(problems, keep_k))
        M["keep_rate"] = None if math.isnan(keep) else float(keep)
        M["explore_rate"] = None if math.isnan(explore) else float(explore)
    else:
        M["keep_rate"], M["explore_rate"] = None, None
    if all(p.get("responses") is not None for p in problems):
        for k in (2, 3):
            M[f"dist-{k}"] = float(np.mean([distinct_n(p["responses"], k, tokenize=list) for p in problems]))
        M["unique_frac"] = float(np.mean([len(set(p["responses"])) / n for p in problems]))
    sources = sorted({str(p.get("source", "")) for p in problems})
    if len(sources) > 1:
        M["splits"] = {s: _accuracy_and_styles([p for p in problems if str(p.get("source", "")) == s], n, styles)
                       for s in sources}
    return M


# ------------------------------------------------------------------ files
def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary sibling and ``os.replace``."""
    _atomic_write_text(path, text)


def atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n")


def strip_problems(problems: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Per-problem records for ``eval.json``: id, source, correct (0/1), styles; no texts."""
    out = []
    for p in problems:
        r = {"id": str(p["id"]), "source": str(p.get("source", "")),
             "correct": [int(bool(x)) for x in p["correct"]]}
        if p.get("styles") is not None:
            r["styles"] = list(p["styles"])
        out.append(r)
    return out


def write_eval_json(run_dir: str, *, task: str, name: str, role: str, metrics: Mapping[str, Any],
                    problems: Sequence[Mapping[str, Any]], seed: Optional[int] = None,
                    settings: Optional[Mapping[str, Any]] = None) -> str:
    """Write ``run_dir/eval.json`` (the format in the module docstring); returns its path."""
    if role not in ("base", "method"):
        raise ValueError(f"eval.json role must be 'base' or 'method', got {role!r}")
    path = os.path.join(run_dir, EVAL_FILE)
    atomic_write_json(path, {
        "format": EVAL_FORMAT, "task": task, "name": name, "role": role, "seed": seed,
        "settings": dict(settings or {}), "metrics": dict(metrics),
        "problems": strip_problems(problems),
    })
    return path


def read_eval_json(path: str) -> Dict[str, Any]:
    """Read an ``eval.json`` (``path`` may be the file or the run directory holding it)."""
    if os.path.isdir(path):
        path = os.path.join(path, EVAL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no {EVAL_FILE} at {path!r}: a run directory must hold the eval output "
            f"(written by openrlhf-div demo / eval; format in openrlhf_div/eval/results.py)")
    with open(path) as f:
        d = json.load(f)
    if d.get("format") != EVAL_FORMAT:
        raise ValueError(f"{path}: format {d.get('format')!r} is not {EVAL_FORMAT!r}")
    for key in ("task", "name", "role", "metrics"):
        if key not in d:
            raise ValueError(f"{path}: eval.json lacks the {key!r} field")
    return d


RESULTS_FILE = "results.json"  # written by `openrlhf-div eval` (openrlhf_div.eval.evaluate)
_SEED_DIR = re.compile(r"seed[_-]?(\d+)$")


def load_run(spec: str, role: Optional[str] = None) -> Dict[str, Any]:
    """One run for ``compare``, as an ``eval.json``-shaped dict.

    ``spec`` is ``[NAME=]PATH``; ``PATH`` is a run directory (or file) holding ``eval.json``
    or, failing that, ``results.json`` from ``openrlhf-div eval``. For a ``results.json`` the
    metrics are recomputed from its per-problem ``correct`` lists (no styles), the name is
    ``NAME`` or the directory name (``.../grpo/seed1`` -> name ``grpo``, seed 1), and the
    role is ``role`` (default ``"method"``).
    """
    name = None
    if "=" in spec and not os.path.exists(spec):
        name, spec = spec.split("=", 1)
    path = spec
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, EVAL_FILE)) \
            and os.path.isfile(os.path.join(path, RESULTS_FILE)):
        path = os.path.join(path, RESULTS_FILE)
    if os.path.basename(path) != RESULTS_FILE:
        d = read_eval_json(path)
        d["_path"] = os.path.abspath(path if os.path.isfile(path) else os.path.join(path, EVAL_FILE))
        if name:
            d["name"] = name
        if role:
            d["role"] = role
        return d
    with open(path) as f:
        r = json.load(f)
    if not isinstance(r, dict) or "problems" not in r:
        raise ValueError(f"{path}: not an `openrlhf-div eval` results file (no 'problems' list)")
    run_dir = os.path.dirname(os.path.abspath(path))
    seed = r.get("seed")
    if name is None:
        m = _SEED_DIR.search(os.path.basename(run_dir))
        if m:
            seed = int(m.group(1))
            name = os.path.basename(os.path.dirname(run_dir))
        else:
            name = os.path.basename(run_dir)
    problems = [{"id": str(p["id"]), "source": str(p.get("source", "")), "correct": [int(bool(c)) for c in p["correct"]]}
                for p in r["problems"]]
    role = role or "method"
    return {"_path": os.path.abspath(path), "format": EVAL_FORMAT, "task": r.get("task", "?"), "name": name,
            "role": role, "seed": seed,
            "settings": {k: r[k] for k in ("model", "sampling", "n") if k in r},
            "metrics": model_metrics(problems, is_base=(role == "base")), "problems": problems}
