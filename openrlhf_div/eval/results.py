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
  problem's samples, averaged over problems (LAD Table 4; the one definition,
  :func:`openrlhf_div.eval.diversity.distinct_n`, also that of ``by_source``); ``unique_frac``: distinct responses / n, averaged.
- ``mean_reward``: the mean task reward of the samples (when the records carry ``rewards``).
- ``splits``: the same accuracy and style metrics per ``source`` (e.g. ``demo/regular``,
  ``demo/rare``).

The one results file of every evaluation (``openrlhf-div eval``, the demo, the local trainer's
in-training evaluation, the OpenRLHF driver's vLLM evaluation) is ``eval.json``
(:func:`write_eval`), written next to ``samples.jsonl`` (texts) and ``results.md`` (a table)::

    {"format": "openrlhf-div.eval/2", "task": "demo", "name": "grpo", "role": "trained", "seed": 0,
     "settings": {"n", "ks", "temperature", "top_p", "max_new_tokens", "greedy", "keep_k",
                  "grading", "data": {"hash", "problems", "paths"}, "model", "engine", ...},
     "metrics": M, "by_source": {source: {pass@k, mean@n, greedy, mean_reward, dist-m, ...}},
     "info": {caller's provenance: training step, demo settings, timing, ...},
     "problems": [per-problem records: id, source, correct, styles, rewards, reasons, ...]}

``role`` is ``"base"`` (the model before RL) or ``"trained"`` (a trained model; ``"method"``, the
older spelling, is read as ``"trained"``). ``seed`` is the seed of the *training* run the model
came from (``None`` when unknown, and for a base model); ``openrlhf-div eval`` keeps its own
sampling seed in ``info["eval_seed"]`` and, for a model of a run folder, that folder in
``info["run_dir"]``. ``problems`` carries no texts, so ``openrlhf-div
compare`` can recompute keep / explore rates against any base. ``settings`` is what makes two
evaluations comparable: :func:`settings_differences` lists where two runs differ
(``compare`` and ``eval --base-results`` refuse such runs unless told to allow them).
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .diversity import keep_explore_rates, mean_distinct_n
from .passk import pass_at_k
from openrlhf_div.io import atomic_write_text as _atomic_write_text

EVAL_FORMAT = "openrlhf-div.eval/2"
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
    if all(p.get("rewards") is not None for p in problems):
        out["mean_reward"] = float(np.mean([float(np.mean(p["rewards"])) for p in problems]))
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
        mine = solved_at(problems, keep_k)
        # problems of the base that this model did not see are left out (the data hashes differ then)
        keep, explore = keep_explore_rates({i: v for i, v in solved_at(base, keep_k).items() if i in mine}, mine)
        M["keep_rate"] = None if math.isnan(keep) else float(keep)
        M["explore_rate"] = None if math.isnan(explore) else float(explore)
    else:
        M["keep_rate"], M["explore_rate"] = None, None
    if all(p.get("responses") is not None for p in problems):
        for k in (2, 3):
            M[f"dist-{k}"] = mean_distinct_n([p["responses"] for p in problems], k)
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


_TEXT_KEYS = ("responses", "greedy_response", "prompt", "answers", "_responses", "label")


def strip_problems(problems: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Per-problem records for ``eval.json``: everything but the texts (``correct`` as 0/1)."""
    out = []
    for p in problems:
        r = {k: v for k, v in p.items() if k not in _TEXT_KEYS}
        r["id"], r["source"] = str(p["id"]), str(p.get("source", ""))
        r["correct"] = [int(bool(x)) for x in p["correct"]]
        if r.get("styles") is None:
            r.pop("styles", None)
        out.append(r)
    return out


def data_hash(examples: Sequence[Mapping[str, Any]]) -> str:
    """A short SHA-256 of the evaluation problems (source, id, prompt, label), order-free: two
    evaluations on the same problems have the same hash whatever file or engine loaded them."""
    import hashlib

    rows = sorted(json.dumps([str(e.get("source", "")), str(e.get("id", "")), e.get("prompt"), e.get("label")],
                             sort_keys=True, default=str) for e in examples)
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()[:16]


#: the roles an eval.json may carry; "method" is the older spelling of "trained"
ROLES = ("base", "trained")


def normalize_role(role: Any) -> str:
    """``"base"`` or ``"trained"`` (``"method"`` read as ``"trained"``); anything else is an error."""
    if role == "method":
        return "trained"
    if role not in ROLES:
        raise ValueError(f"eval.json role must be 'base' or 'trained', got {role!r}")
    return role


def write_eval_json(run_dir: str, *, task: str, name: str, role: str, metrics: Mapping[str, Any],
                    problems: Sequence[Mapping[str, Any]], settings: Mapping[str, Any], seed: Optional[int] = None,
                    by_source: Optional[Mapping[str, Any]] = None, info: Optional[Mapping[str, Any]] = None) -> str:
    """Write ``run_dir/eval.json`` (the format in the module docstring); returns its path."""
    role = normalize_role(role)
    path = os.path.join(run_dir, EVAL_FILE)
    atomic_write_json(path, {
        "format": EVAL_FORMAT, "task": task, "name": name, "role": role, "seed": seed,
        "settings": dict(settings), "metrics": dict(metrics), "by_source": dict(by_source or {}),
        "info": dict(info or {}), "problems": strip_problems(problems),
    })
    return path


def results_markdown(result: Mapping[str, Any]) -> str:
    """A Markdown table: one row per dataset, columns pass@k, mean@n, greedy, dist-2, keep /
    explore (when present), all in percent."""
    st = result["settings"]
    n, ks = st["n"], st["ks"]
    metrics = result["by_source"]
    cols = [f"pass@{k}" for k in ks] + [f"mean@{n}"]
    if st.get("greedy"):
        cols.append("greedy")
    any_m = next(iter(metrics.values()))
    for extra in ("dist-2", "distinct_correct", "keep_rate", "explore_rate"):
        if extra in any_m:
            cols.append(extra)

    def fmt(c, v):
        if v is None:
            return "-"
        if c == "distinct_correct":
            return f"{v:.2f}"
        return f"{100 * v:.1f}"

    lines = [f"Task `{result['task']}`, n={n}, temperature={st['temperature']}, top_p={st['top_p']}, "
             f"max_new_tokens={st['max_new_tokens']} (percent; distinct_correct is a count)"
             + (f"; grading: {st['grading']}" if st.get("grading") else ""), "",
             "| dataset | problems | " + " | ".join(cols) + " |",
             "|---|---:|" + "---:|" * len(cols)]
    for src, m in metrics.items():
        lines.append(f"| {src} | {m['problems']} | " + " | ".join(fmt(c, m.get(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def write_eval(out_dir: str, result: Mapping[str, Any], *, name: str, role: str = "trained",
               seed: Optional[int] = None, info: Optional[Mapping[str, Any]] = None,
               **settings: Any) -> Dict[str, str]:
    """Write an :func:`openrlhf_div.eval.evaluate.evaluate` result into ``out_dir``:
    ``eval.json`` (metrics + per-problem correctness), ``results.md`` (the table) and
    ``samples.jsonl`` (one problem per line: prompt, responses, extracted answers, rewards,
    reasons, correct, styles, truncated flags). ``settings`` (``model=``, ``engine=``,
    ``data_paths=``) are added to the result's settings. Returns the three paths."""

    os.makedirs(out_dir, exist_ok=True)
    s = dict(result["settings"])
    if "data_paths" in settings:
        s["data"] = {**s.get("data", {}), "paths": settings.pop("data_paths")}
    s.update(settings)
    result = {**result, "settings": s}
    paths = {"json": os.path.join(out_dir, EVAL_FILE), "markdown": os.path.join(out_dir, "results.md"),
             "samples": os.path.join(out_dir, "samples.jsonl")}
    lines = []
    for p in result["problems"]:
        if "responses" in p:
            lines.append(json.dumps({"id": p["id"], "source": p["source"], "prompt": p.get("prompt"),
                                     "label": p.get("label"), "responses": p["responses"], "answers": p.get("answers"),
                                     "rewards": p["rewards"], "reasons": p["reasons"], "correct": p["correct"],
                                     "styles": p.get("styles"), "truncated": p.get("truncated"),
                                     "greedy_response": p.get("greedy_response")}, default=str) + "\n")
    atomic_write_text(paths["samples"], "".join(lines))
    atomic_write_text(paths["markdown"], results_markdown(result))
    write_eval_json(out_dir, task=result["task"], name=name, role=role, metrics=result["metrics"],
                    problems=result["problems"], settings=s, seed=seed, by_source=result.get("by_source"),
                    info=info)
    return paths


def read_eval_json(path: str) -> Dict[str, Any]:
    """Read an ``eval.json`` (``path`` may be the file or the run directory holding it)."""
    if os.path.isdir(path):
        path = os.path.join(path, EVAL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no {EVAL_FILE} at {path!r}: a run directory must hold the eval output "
            f"(written by openrlhf-div demo / eval / train; format in openrlhf_div/eval/results.py)")
    with open(path) as f:
        d = json.load(f)
    if not isinstance(d, dict) or d.get("format") != EVAL_FORMAT:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"{path}: format {got!r} is not {EVAL_FORMAT!r} (an older openrlhf-div wrote it: "
                         f"evaluate the model again with `openrlhf-div eval`)")
    for key in ("task", "name", "role", "metrics", "settings"):
        if key not in d:
            raise ValueError(f"{path}: eval.json lacks the {key!r} field")
    try:
        d["role"] = normalize_role(d["role"])
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return d


# ------------------------------------------------------------------ comparable settings
#: the settings that must agree for two evaluations to be compared
COMPARED_SETTINGS = ("n", "temperature", "top_p", "max_new_tokens", "grading", "data_hash", "keep_k")


def _setting(s: Mapping[str, Any], key: str) -> Any:
    if key == "data_hash":
        return (s.get("data") or {}).get("hash")
    return s.get(key)


def settings_differences(runs: Sequence[Tuple[str, Mapping[str, Any]]]) -> List[str]:
    """Where the evaluation settings of ``runs`` (``[(label, settings)]``) disagree, one line
    each (empty when they agree): ``n``, ``temperature``, ``top_p``, ``max_new_tokens``,
    ``grading``, the evaluation data (its hash) and ``keep_k`` -- plus any run whose ``keep_k``
    exceeds its ``n`` (keep / explore would then use fewer samples than they say)."""
    out = []
    for key in COMPARED_SETTINGS:
        vals = [(label, _setting(s, key)) for label, s in runs]
        if len({json.dumps(v, sort_keys=True) for _, v in vals}) > 1:
            out.append(f"{key}: " + ", ".join(f"{label}={v!r}" for label, v in vals))
    for label, s in runs:
        if s.get("keep_k") is not None and s.get("n") is not None and int(s["keep_k"]) > int(s["n"]):
            out.append(f"keep_k > n: {label} has keep_k={s['keep_k']} but n={s['n']} (lower --keep-k or raise --n)")
    return out


def check_settings(runs: Sequence[Tuple[str, Mapping[str, Any]]], allow_mismatch: bool = False,
                   what: str = "compare") -> List[str]:
    """:func:`settings_differences`; raises ``ValueError`` listing them unless ``allow_mismatch``
    (then they are returned, for the report to mark)."""
    diffs = settings_differences(runs)
    if diffs and not allow_mismatch:
        raise ValueError(f"{what}: the runs were evaluated with different settings, so their numbers are not "
                         "comparable:\n  " + "\n  ".join(diffs) +
                         "\nEvaluate them alike, or pass --allow-mismatch to compare anyway (the report marks it)")
    return diffs


RUN_INFO_FILE = "run_info.json"
#: settings keys that name the seed (never part of what a group of seeds shares)
SEED_KEYS = ("seed", "train.seed")


def _int_seed(v: Any) -> Optional[int]:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def run_provenance(d: Mapping[str, Any]) -> Dict[str, Any]:
    """What produced one evaluated run (``d``: an :func:`load_run` dict), for ``compare``.

    Read from the run folder's ``run_info.json`` (next to the ``eval.json``, or the folder
    ``info["run_dir"]`` that ``openrlhf-div eval`` records for a model of a run folder):

    - ``seed``: ``run_info.json``'s ``seed`` (the seed training used), else ``eval.json``'s ``seed``
      (the training seed its writer knew), else ``None`` (unknown; never guessed from a folder name).
      An ``eval.json`` of an older ``openrlhf-div eval`` (no ``info["eval_seed"]``) held the
      sampling seed there, not a training seed: unknown;
    - ``engine``: ``run_info.json``'s (``openrlhf(megatron)`` for the Megatron actor), else the
      engine of an in-training evaluation, else ``"unknown"``;
    - ``experiment``; ``settings``: ``run_info.json``'s flat ``{dotted key: value}`` of everything
      that reached training except the seed, or ``None`` for a folder written before it was
      recorded (``compare`` flags "settings unknown").
    """
    info = d.get("info") or {}
    here = os.path.dirname(d["_path"])
    folder = None
    for cand in (here, info.get("run_dir")):
        if cand and os.path.isfile(os.path.join(cand, RUN_INFO_FILE)):
            folder = cand
            break
    run_info: Dict[str, Any] = {}
    notes: List[str] = []
    if folder is not None:
        try:
            with open(os.path.join(folder, RUN_INFO_FILE)) as f:
                run_info = json.load(f)
        except (OSError, ValueError) as exc:
            notes.append(f"{os.path.join(folder, RUN_INFO_FILE)} unreadable ({type(exc).__name__})")
        if not isinstance(run_info, dict):
            run_info = {}
    eval_seed = _int_seed(d.get("seed"))
    if info.get("source") == "eval" and "eval_seed" not in info:
        eval_seed = None  # an older `openrlhf-div eval` wrote its sampling seed there
    seed = _int_seed(run_info.get("seed"))
    if seed is not None and eval_seed is not None and seed != eval_seed:
        notes.append(f"eval.json says seed {eval_seed}, run_info.json says {seed}: run_info.json's is used")
    if seed is None:
        seed = eval_seed
    engine = run_info.get("engine")
    if engine == "openrlhf" and run_info.get("actor_backend") == "megatron":
        engine = "openrlhf(megatron)"
    if not engine and info.get("source") == "train":
        engine = (d.get("settings") or {}).get("engine") or info.get("engine")
    settings = run_info.get("settings")
    if isinstance(settings, dict):
        settings = {k: v for k, v in settings.items() if k not in SEED_KEYS}
    else:
        settings = None
    return {"run_dir": os.path.abspath(folder) if folder else None, "seed": seed, "engine": engine or "unknown",
            "experiment": run_info.get("experiment"), "settings": settings, "notes": notes}


def load_run(spec: str, role: Optional[str] = None, *,
             evaluate_missing: Optional[Callable[[str], Any]] = None) -> Dict[str, Any]:
    """One run for ``compare``, as an ``eval.json`` dict (plus ``_path``).

    ``spec`` is ``[NAME=]PATH``; ``PATH`` is an ``eval.json`` file, a directory holding one
    (``openrlhf-div eval``/``demo`` outputs, and ``train`` run directories with an in-training
    evaluation), or a ``train`` run directory without one: ``evaluate_missing(run_dir)`` then
    writes its ``eval.json`` (the command line passes the engine's
    :func:`openrlhf_div.engines.local.evaluation.evaluate_run_dir`, which owns the models; this
    layer only reads results). ``NAME`` overrides the name. The run's seed, engine and settings
    are :func:`run_provenance`'s (``_provenance``).
    """
    name = None
    if "=" in spec and not os.path.exists(spec):
        name, spec = spec.split("=", 1)
    path = spec
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, EVAL_FILE)) \
            and os.path.isfile(os.path.join(path, "config.yaml")):
        if evaluate_missing is None:
            raise FileNotFoundError(f"{path}: a train run directory without {EVAL_FILE}; evaluate it first "
                                    "(`openrlhf-div compare` does, or `openrlhf-div eval --model "
                                    f"{os.path.join(path, 'final_model')} ... --role trained --out {path}`)")
        evaluate_missing(path)
    d = read_eval_json(path)
    d["_path"] = os.path.abspath(path if os.path.isfile(path) else os.path.join(path, EVAL_FILE))
    d["_provenance"] = prov = run_provenance(d)
    d["seed"] = prov["seed"]
    if name:
        d["name"] = name
    if role:
        d["role"] = normalize_role(role)
    return d
