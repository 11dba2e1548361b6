"""Comparison reports: ``metrics.json``, ``report.md`` and PNG plots from per-model metrics.

Input: the base model's metric dict ``M`` and, per method, one ``M`` per seed (see
:mod:`openrlhf_div.eval.results` for the keys). Output, in ``out_dir``:

- ``metrics.json``: ``{"task": ..., "base": M, "methods": {name: M}, ...}``. A method's ``M``
  holds the **mean over seeds** of every numeric entry (nested dicts averaged leaf by leaf),
  plus ``n_seeds``, ``seeds``, ``per_seed`` (``{seed: M_seed}``) and, with two or more seeds,
  ``sd`` (sample standard deviation, ``ddof = 1``, leaf by leaf).
- ``report.md``: the comparison table (mean +- sd over seeds), the style mix, the prediction
  checks (measured, with the seed spread), the per-method settings and notes.
- ``passk.png``: pass@k curves, k = 1..n, per method (mean over seeds, band = +-1 sd), one
  panel for all problems and one per split.
- ``styles.png``: the style distribution per method, like DPH's Figure 5: (a) the share of
  samples by style prefix, split into correct and wrong; (b) problems by the number of
  distinct correct styles (0..5).

:func:`compare_runs` builds the same report from run directories' ``eval.json`` files
(``openrlhf-div compare``).
"""
from __future__ import annotations

import math
import os
import sys
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .results import atomic_write_json, atomic_write_text, check_settings, load_run, model_metrics, read_eval_json

STYLE_COLORS = {"A": "#4C72B0", "B": "#DD8452", "C": "#55A868", "D": "#C44E52", "E": "#8172B3",
                "other": "#7f7f7f"}
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


# ------------------------------------------------------------------ aggregation
def _reduce_tree(values: Sequence[Any], leaf, other, drop_none: bool) -> Any:
    """Reduce parallel nested dicts key by key: numeric leaves with ``leaf(list)``, anything
    else with ``other(list)``; ``None`` values are skipped (and ``None`` results dropped from
    dicts when ``drop_none``)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    if all(isinstance(v, Mapping) for v in vals):
        keys: List[str] = []
        for v in vals:
            keys += [k for k in v if k not in keys]
        out = {k: _reduce_tree([v.get(k) for v in vals], leaf, other, drop_none) for k in keys}
        return {k: v for k, v in out.items() if v is not None} if drop_none else out
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
        return leaf(vals)
    return other(vals)


def _mean_tree(values: Sequence[Any]) -> Any:
    return _reduce_tree(values, lambda v: float(np.mean(v)), lambda v: v[0], drop_none=False)


def _sd_tree(values: Sequence[Any]) -> Any:
    return _reduce_tree(values, lambda v: float(np.std(v, ddof=1)) if len(v) >= 2 else None, lambda v: None,
                        drop_none=True)


def aggregate_seeds(per_seed: Mapping[Any, Mapping[str, Any]]) -> Dict[str, Any]:
    """One method's ``M`` from ``{seed: M_seed}``: means, ``sd`` (2+ seeds), ``per_seed``."""
    if not per_seed:
        raise ValueError("aggregate_seeds: no seeds given")
    seeds = list(per_seed)
    Ms = [dict(per_seed[s]) for s in seeds]
    M = _mean_tree(Ms)
    M["n_seeds"] = len(seeds)
    M["seeds"] = seeds
    M["per_seed"] = {str(s): per_seed[s] for s in seeds}
    if len(seeds) >= 2:
        M["sd"] = _sd_tree(Ms)
    return M


def build_metrics(task: str, base: Mapping[str, Any], methods: Mapping[str, Mapping[Any, Mapping[str, Any]]],
                  **extra) -> Dict[str, Any]:
    """``{"task", "base", "methods": {name: aggregate_seeds(per_seed)}, **extra}``."""
    out: Dict[str, Any] = {"task": task, "base": dict(base),
                           "methods": {name: aggregate_seeds(ps) for name, ps in methods.items()}}
    out.update(extra)
    return out


# ------------------------------------------------------------------ formatting
def _get(M: Mapping[str, Any], path: str) -> Any:
    cur: Any = M
    for part in path.split("::"):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _fmt(M: Mapping[str, Any], path: str, digits: int = 3) -> str:
    v = _get(M, path)
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    s = f"{v:.{digits}f}"
    sd = _get(M.get("sd", {}) or {}, path)
    if sd is not None:
        s += f" ± {sd:.{digits}f}"
    return s


def _split_key(M: Mapping[str, Any], want: Optional[str], prefer: str) -> Optional[str]:
    splits = M.get("splits") or {}
    if want and want in splits:
        return want
    for k in splits:
        if k.endswith(prefer):
            return k
    return None


def _columns(metrics: Mapping[str, Any], style_split: Optional[str]) -> List[Tuple[str, str]]:
    base = metrics["base"]
    cols = [("pass@1", "pass@1"), ("pass@8", "pass@8"), ("pass@16", "pass@16")]
    if any(_get(M, "greedy") is not None for M in [base, *(metrics.get("methods") or {}).values()]
           if isinstance(M, Mapping)):
        cols.append(("greedy", "greedy"))  # one temperature-0 response per problem (eval --greedy)
    for s in (base.get("splits") or {}):
        cols.append((f"pass@1 {s.split('/')[-1]}", f"splits::{s}::pass@1"))
        cols.append((f"pass@16 {s.split('/')[-1]}", f"splits::{s}::pass@16"))
    if "mean_styles" in base:
        cols.append(("mean_styles", "mean_styles"))
        if style_split:
            cols.append((f"styles {style_split.split('/')[-1]}", f"splits::{style_split}::mean_styles"))
            cols.append((f">=3 styles {style_split.split('/')[-1]}", f"splits::{style_split}::share_ge_3_styles"))
    cols += [("keep", "keep_rate"), ("explore", "explore_rate")]
    if "dist-2" in base:
        cols.append(("dist-2", "dist-2"))
    return [(h, p) for h, p in cols if not (p.startswith("pass@") and _get(base, p) is None)]


def _table(rows: Sequence[Tuple[str, Mapping[str, Any]]], cols: Sequence[Tuple[str, str]]) -> str:
    head = "| model | " + " | ".join(h for h, _ in cols) + " |"
    sep = "|---|" + "---|" * len(cols)
    lines = [head, sep]
    for name, M in rows:
        lines.append(f"| {name} | " + " | ".join(_fmt(M, p) for _, p in cols) + " |")
    return "\n".join(lines)


def _style_table(rows: Sequence[Tuple[str, Mapping[str, Any]]], split: Optional[str]) -> str:
    pref = f"splits::{split}::" if split else ""
    styles = [s for s in (_get(rows[0][1], pref + "style_mix") or {})]
    if not styles:
        return ""
    head = ("| model | " + " | ".join(f"{s} (acc)" for s in styles) + " | other prefix |")
    lines = [head, "|---|" + "---|" * (len(styles) + 1)]
    for name, M in rows:
        cells = []
        for s in styles:
            mix = _get(M, f"{pref}style_mix::{s}")
            acc = _get(M, f"{pref}style_accuracy::{s}")
            cells.append("-" if mix is None else f"{mix:.2f} ({'-' if acc is None else f'{acc:.2f}'})")
        oth = _get(M, f"{pref}sample_style_mix::other")
        cells.append("-" if oth is None else f"{oth:.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _diff(M: Mapping[str, Any], B: Mapping[str, Any], path: str) -> Optional[Tuple[float, float, int]]:
    """(mean difference M - B, sd of the method's seeds or 0, n_seeds)."""
    a, b = _get(M, path), _get(B, path)
    if a is None or b is None:
        return None
    sd = _get(M.get("sd") or {}, path) or 0.0
    return float(a) - float(b), float(sd), int(M.get("n_seeds", 1))


def prediction_checks(metrics: Mapping[str, Any], style_split: Optional[str] = None) -> List[str]:
    """The papers' predictions, each checked against the measured numbers.

    A difference counts as shown when it exceeds the larger seed sd of the two sides
    (a rough bar, not a significance test; with one seed the sd is unknown and it says so).
    """
    base, methods = metrics["base"], metrics["methods"]
    out: List[str] = []
    sty = f"splits::{style_split}::mean_styles" if style_split else "mean_styles"
    sty_label = f"styles ({style_split.split('/')[-1]} split)" if style_split else "styles"
    rare = next((f"splits::{s}::pass@16" for s in (base.get("splits") or {}) if s.endswith("rare")), "pass@16")

    def verdict(delta: float, sd: float, n: int, want_positive: bool) -> str:
        if n < 2:
            tag = "single seed, spread unknown"
        else:
            tag = f"seed sd {sd:.3f}"
        ok = delta > 0 if want_positive else delta < 0
        strong = abs(delta) > sd
        word = "yes" if ok and strong else ("within noise" if ok else "NO")
        return f"{word} ({tag})"

    def cmp(a: str, b: str, path: str) -> Optional[Tuple[float, float, int]]:
        if a not in methods or b not in methods:
            return None
        A, B = methods[a], methods[b]
        va, vb = _get(A, path), _get(B, path)
        if va is None or vb is None:
            return None
        sd = max(_get(A.get("sd") or {}, path) or 0.0, _get(B.get("sd") or {}, path) or 0.0)
        return float(va) - float(vb), float(sd), min(int(A.get("n_seeds", 1)), int(B.get("n_seeds", 1)))

    for name, M in methods.items():
        d = _diff(M, base, "pass@1")
        if d:
            out.append(f"- RL raises pass@1 over the base — {name}: {_get(base, 'pass@1'):.3f} -> "
                       f"{_get(M, 'pass@1'):.3f}: {verdict(d[0], d[1], d[2], True)}")
    for name in ("grpo", "rkl"):
        if name in methods:
            d = _diff(methods[name], base, sty)
            if d:
                out.append(f"- {name} narrows the styles — {sty_label}: {_get(base, sty):.2f} -> "
                           f"{_get(methods[name], sty):.2f}: {verdict(d[0], d[1], d[2], False)}")
    for a in ("dph_f", "dph_js"):
        for b in ("grpo", "rkl"):
            for path, label in ((sty, sty_label), (rare, "pass@16 (rare)"), ("pass@16", "pass@16")):
                d = cmp(a, b, path)
                if d:
                    out.append(f"- {a} keeps more {label} than {b}: {_get(methods[a], path):.3f} vs "
                               f"{_get(methods[b], path):.3f}: {verdict(d[0], d[1], d[2], True)}")
    p1 = f"splits::{style_split}::pass@1" if style_split else "pass@1"
    p1_label = f"pass@1 ({style_split.split('/')[-1]} split)" if style_split else "pass@1"
    for a in ("dph_f", "dph_js", "ds_grpo", "lad_js"):
        d = cmp(a, "grpo", p1)
        if d:
            out.append(f"- (the price) {a} vs grpo, {p1_label}: {_get(methods[a], p1):.3f} vs "
                       f"{_get(methods['grpo'], p1):.3f} (difference {d[0]:+.3f}, larger seed sd {d[1]:.3f})")
    for a in ("ds_grpo", "lad_js"):
        for path, label in ((sty, sty_label), (rare, "pass@16 (rare)"), ("dist-2", "dist-2")):
            d = cmp(a, "grpo", path)
            if d:
                out.append(f"- {a} keeps more {label} than grpo: {_get(methods[a], path):.3f} vs "
                           f"{_get(methods['grpo'], path):.3f}: {verdict(d[0], d[1], d[2], True)}")
    return out


# ------------------------------------------------------------------ plots
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _wrapped(text: str, fig_width_in: float, fontsize: float = 12.0) -> str:
    """``text`` broken into lines that fit a figure ``fig_width_in`` inches wide."""
    import textwrap

    per_line = max(20, int(fig_width_in * 72 / (0.55 * fontsize)))  # ~0.55 em per character
    return "\n".join(textwrap.wrap(text, per_line))


def _k_axis(ax, plt, kmax: int) -> None:
    """A log2 k axis with ticks 1, 2, 4, ... up to ``kmax`` (and ``kmax`` itself), ending at ``kmax``."""
    ticks = [1 << i for i in range(kmax.bit_length()) if (1 << i) <= kmax]
    if ticks[-1] != kmax:
        ticks.append(kmax)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.get_xaxis().set_major_formatter(plt.FuncFormatter(lambda v, _: f"{int(round(v))}"))
    ax.get_xaxis().set_minor_locator(plt.NullLocator())
    ax.set_xlim(1 / 1.15, kmax * 1.15) if kmax > 1 else ax.set_xlim(0.5, 2)


def passk_figure(metrics: Mapping[str, Any]):
    """The pass@k figure (see :func:`plot_passk`), not yet saved."""
    plt = _plt()
    base = metrics["base"]
    panels = [("all evaluation problems", "pass_at_k")]
    for s in (base.get("splits") or {}):
        if _get(base, f"splits::{s}::pass_at_k"):
            panels.append((f"split {s}", f"splits::{s}::pass_at_k"))
    rows = [("base", base)] + list(metrics["methods"].items())
    width = max(6.0, 5.2 * len(panels))
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 4.4), squeeze=False, layout="constrained")
    cmap = plt.get_cmap("tab10")
    for ax, (title, p) in zip(axes[0], panels):
        kmax = 1
        for i, (name, M) in enumerate(rows):
            curve = _get(M, p)
            if not curve:
                continue
            ks = sorted(int(k) for k in curve)
            kmax = max(kmax, ks[-1])
            y = np.array([curve[str(k)] for k in ks])
            style = (dict(color="black", lw=2.2, ls="--", marker="o") if name == "base" else
                     dict(color=cmap(i % 10), lw=1.6, marker=MARKERS[i % len(MARKERS)],
                          ls=("-", "-.", ":")[(i // 10) % 3]))
            ax.plot(ks, y, ms=3.5, label=name, **style)
            sd = _get(M.get("sd") or {}, p)
            if sd:
                e = np.array([sd.get(str(k), 0.0) for k in ks])
                ax.fill_between(ks, y - e, y + e, color=style["color"], alpha=0.15, lw=0)
        _k_axis(ax, plt, kmax)
        ax.set_xlabel("k (samples)")
        ax.set_ylabel("pass@k (unbiased)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(_wrapped(f"{metrics.get('task', '')}: pass@k per method (mean over seeds, band = ±1 sd)", width))
    return fig


def plot_passk(metrics: Mapping[str, Any], path: str) -> str:
    """pass@k curves per model (k = 1..n), one panel for all problems and one per split; the k
    axis ends at the largest k evaluated, the title is wrapped to the figure's width."""
    plt = _plt()
    fig = passk_figure(metrics)
    fig.savefig(path + ".tmp.png", dpi=120)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)
    return path


def plot_styles(metrics: Mapping[str, Any], path: str, split: Optional[str] = None) -> str:
    """Style distribution per model (DPH Figure 5): (a) samples by style prefix, correct
    (solid) and wrong (light, hatched); (b) problems by number of distinct correct styles."""
    plt = _plt()
    rows = [("base", metrics["base"])] + list(metrics["methods"].items())
    pref = f"splits::{split}::" if split else ""
    styles = list(_get(rows[0][1], pref + "style_mix") or {})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for s in styles + ["other"]:
        tot = np.array([(_get(M, f"{pref}sample_style_mix::{s}") or 0.0) for _, M in rows])
        if s == "other":
            cor = np.zeros(len(rows))
        else:
            mix = np.array([(_get(M, f"{pref}style_mix::{s}") or 0.0) for _, M in rows])
            acc1 = np.array([(_get(M, f"{pref}pass@1") or 0.0) for _, M in rows])
            cor = mix * acc1  # share of all samples that are correct and in style s
        wrong = np.clip(tot - cor, 0, None)
        c = STYLE_COLORS.get(s, "#999999")
        ax1.bar(x, cor, bottom=bottom, color=c, label=f"{s} correct" if s != "other" else None)
        bottom += cor
        ax1.bar(x, wrong, bottom=bottom, color=c, alpha=0.3, hatch="//", edgecolor="white", lw=0,
                label=f"{s} wrong" if s != "other" else "other prefix")
        bottom += wrong
    ax1.set_xticks(x, [n for n, _ in rows], rotation=30, ha="right")
    ax1.set_ylabel("share of samples")
    ax1.set_ylim(0, 1)
    ax1.set_title("(a) samples by style (solid: correct, hatched: wrong)")
    ax1.legend(fontsize=7, ncol=2, bbox_to_anchor=(1.0, 1.0), loc="upper left")
    hist_keys = list(_get(rows[0][1], pref + "styles_hist") or {})
    cmap = plt.get_cmap("viridis", max(len(hist_keys), 2))
    bottom = np.zeros(len(rows))
    for j, key in enumerate(hist_keys):
        v = np.array([(_get(M, f"{pref}styles_hist::{key}") or 0.0) for _, M in rows])
        ax2.bar(x, v, bottom=bottom, color=cmap(j), label=f"{key} style{'s' if key != '1' else ''}")
        bottom += v
    ax2.set_xticks(x, [n for n, _ in rows], rotation=30, ha="right")
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("share of problems")
    ax2.set_title("(b) problems by # distinct correct styles")
    ax2.legend(fontsize=7, bbox_to_anchor=(1.0, 1.0), loc="upper left")
    where = f" (split {split})" if split else ""
    fig.suptitle(_wrapped(f"{metrics.get('task', '')}: style distribution per method{where}, mean over seeds", 12))
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=120)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)
    return path


# ------------------------------------------------------------------ the report
def write_report(out_dir: str, metrics: Mapping[str, Any], *, settings: Optional[Mapping[str, Any]] = None,
                 notes: Sequence[str] = (), style_split: Optional[str] = "auto",
                 title: Optional[str] = None, intro: str = "", keep_k: int = 8) -> Dict[str, str]:
    """Write ``metrics.json``, ``report.md``, ``passk.png`` and ``styles.png`` into ``out_dir``.

    ``settings``: ``{model name: {setting: value}}`` printed per method; ``notes``: markdown
    paragraphs appended verbatim; ``style_split``: which split the style plot/table use
    (``"auto"``: a split named ``*regular`` if there is one, else all problems).
    """
    os.makedirs(out_dir, exist_ok=True)
    if style_split == "auto":
        style_split = _split_key(metrics["base"], None, "regular")
    paths = {"metrics": os.path.join(out_dir, "metrics.json"), "report": os.path.join(out_dir, "report.md"),
             "passk_plot": os.path.join(out_dir, "passk.png"), "styles_plot": os.path.join(out_dir, "styles.png")}
    atomic_write_json(paths["metrics"], metrics)
    plot_passk(metrics, paths["passk_plot"])
    has_styles = "style_mix" in metrics["base"]
    if has_styles:
        plot_styles(metrics, paths["styles_plot"], style_split)
    else:
        paths.pop("styles_plot")
    rows = [("base", metrics["base"])] + list(metrics["methods"].items())
    seeds = sorted({int(M.get("n_seeds", 1)) for _, M in rows[1:]}) or [1]
    md = [f"# {title or 'Comparison report: ' + str(metrics.get('task', ''))}", ""]
    if intro:
        md += [intro.strip(), ""]
    base = metrics["base"]
    md += [f"{base.get('n_problems', '?')} evaluation problems x {base.get('n_samples', '?')} samples each; "
           f"methods: mean ± sd over {'/'.join(map(str, seeds))} seed(s). pass@k is the unbiased estimator; "
           f"keep / explore use the first {keep_k} samples of each problem (one pass@{keep_k} draw) against the base.",
           ""]
    md += ["## Comparison", "", _table(rows, _columns(metrics, style_split)), ""]
    if has_styles:
        md += [f"## Style mix{f' (split {style_split})' if style_split else ''}", "",
               "Share of *correct* samples in each style (in brackets: the share of that style's samples "
               "that are correct); last column: share of samples with no known style prefix.", "",
               _style_table(rows, style_split), ""]
    checks = prediction_checks(metrics, style_split)
    if checks:
        md += ["## The papers' predictions, as measured", "",
               "'yes' when the difference has the predicted sign and exceeds the larger seed sd; "
               "'within noise' when the sign is right but the gap is smaller than that; 'NO' when the "
               "sign is wrong.", ""] + checks + [""]
    md += ["## Plots", "", "![pass@k](passk.png)", ""]
    if has_styles:
        md += ["![styles](styles.png)", ""]
    if settings:
        md += ["## Settings used", ""]
        for name, s in settings.items():
            md.append(f"- **{name}**: " + ", ".join(f"`{k}={v}`" for k, v in s.items()))
        md.append("")
    if notes:
        md += ["## Notes", ""] + [n.rstrip() + "\n" for n in notes]
    atomic_write_text(paths["report"], "\n".join(md).rstrip() + "\n")
    return paths


# ------------------------------------------------------------------ compare
#: the initial policy's evaluation a run folder keeps (local engine: eval.at_start; Ray: --eval.dataset)
STEP0_FILE = "eval_step0.json"


def step0_base(evals: Sequence[Mapping[str, Any]]) -> Tuple[Dict[str, Any], str]:
    """The base of a comparison without a base run: the step-0 evaluation (the initial model,
    before any training step) that the first of the runs holds (``eval_step0.json`` next to
    its ``eval.json``, written by both engines). Raises when none of them holds one."""
    for e in evals:
        path = os.path.join(os.path.dirname(e["_path"]), STEP0_FILE)
        if os.path.isfile(path):
            d = read_eval_json(path)
            d["_path"], d["role"], d["name"] = os.path.abspath(path), "base", "base"
            d["metrics"] = {**d["metrics"], "keep_rate": 1.0, "explore_rate": 0.0}  # the base against itself
            return d, (f"base: the step-0 evaluation (the initial model, before training) held by run "
                       f"{e['name']} ({path}); no separate base run")
    raise ValueError("compare: no base run and none of the runs holds a step-0 evaluation (eval_step0.json); "
                     "pass a base run with --base DIR, or train with the initial evaluation on "
                     "(local: eval.at_start=true; Ray: --eval.dataset FILE)")


def compare_runs(run_dirs: Iterable[str], out_dir: str, *, base_dir: Optional[str] = None,
                 style_split: Optional[str] = "auto", allow_mismatch: bool = False,
                 evaluate_missing: Optional[Callable[[str], Any]] = None) -> Dict[str, str]:
    """The report from eval outputs and ``train`` run directories (``openrlhf-div compare``;
    see :func:`~.results.load_run` for what a ``RUN_DIR`` may be, ``NAME=DIR`` and
    ``evaluate_missing``).

    The base is ``base_dir``, the one run with ``role == "base"``, or else the step-0
    evaluation a run holds (:func:`step0_base`); the report and stderr say which. Methods are grouped by
    ``name``; runs of one name with different seeds are aggregated. Keep / explore rates are
    recomputed against this base (at the runs' ``keep_k``). Runs evaluated with different
    settings (:func:`~.results.settings_differences`) are an error listing the differences,
    unless ``allow_mismatch``: then the report says so at the top.
    """
    evals = [load_run(d, evaluate_missing=evaluate_missing) for d in run_dirs]
    base_note = ""
    if base_dir is not None:
        base_eval = load_run(base_dir, role="base", evaluate_missing=evaluate_missing)
        base_note = f"base: the run {base_dir} (--base)"
    else:
        bases = [e for e in evals if e["role"] == "base"]
        if len(bases) > 1:
            raise ValueError(f"compare: found {len(bases)} runs with role 'base' among the given "
                             f"directories; pass exactly one base run, or name it with --base DIR")
        if bases:
            base_eval = bases[0]
            base_note = f"base: the run with role 'base' ({os.path.dirname(base_eval['_path'])})"
        else:
            base_eval, base_note = step0_base(evals)
    print(f"compare: {base_note}", file=sys.stderr)
    tasks = {e["task"] for e in evals} | {base_eval["task"]}
    if len(tasks) != 1:
        raise ValueError(f"compare: runs are from different tasks {sorted(tasks)}; compare one task at a time")
    everyone = [base_eval] + [e for e in evals if e["_path"] != base_eval["_path"]]
    labels = [f"{e['name']}" + (f"/seed{e['seed']}" if e.get("seed") is not None and e is not base_eval else "")
              for e in everyone]
    mismatch = check_settings(list(zip(labels, [e["settings"] for e in everyone])), allow_mismatch)
    keep_k = int(base_eval["settings"].get("keep_k") or 8)
    base_M = dict(base_eval["metrics"])
    methods: Dict[str, Dict[Any, Dict[str, Any]]] = OrderedDict()
    settings: Dict[str, Any] = {}
    base_problems = base_eval.get("problems")
    for e in evals:
        if e["_path"] == base_eval["_path"] or e["role"] == "base":
            continue
        M = dict(e["metrics"])
        if base_problems and e.get("problems"):
            ids = {p["id"] for p in base_problems}
            if ids != {p["id"] for p in e["problems"]}:
                raise ValueError(f"compare: run {e['name']!r} (seed {e.get('seed')}) was evaluated on other "
                                 f"problems than the base; evaluate both on the same set")
            redo = model_metrics(e["problems"], base=base_problems, keep_k=keep_k)
            M["keep_rate"], M["explore_rate"] = redo["keep_rate"], redo["explore_rate"]
        per_seed = methods.setdefault(e["name"], OrderedDict())
        seed = e.get("seed")
        key = seed if seed is not None and seed not in per_seed else len(per_seed)
        per_seed[key] = M
        settings[e["name"]] = {k: v for k, v in e["settings"].items() if not isinstance(v, (dict, list))}
    metrics = build_metrics(next(iter(tasks)), base_M, methods, settings_mismatch=mismatch)
    intro = f"**Base.** {base_note[len('base: '):]}." if base_note else ""
    if mismatch:
        intro += ("\n\n" if intro else "") + ("**Warning: these runs were evaluated with different settings (compared with --allow-mismatch); "
                 "their numbers are not directly comparable:**\n\n" + "\n".join(f"- {d}" for d in mismatch))
    return write_report(out_dir, metrics, settings=settings, style_split=style_split, intro=intro, keep_k=keep_k)
