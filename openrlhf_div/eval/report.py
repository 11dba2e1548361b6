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
(``openrlhf-div compare``), one row per group of runs that ran the same thing
(:func:`group_runs`); its ``metrics.json`` adds, per row, ``provenance`` (``method``, ``engine``,
``experiment``, ``seeds``, ``settings``, ``settings_known``, ``runs``), and at the top ``flags``
(:func:`comparability_flags`), ``evaluation`` (the shared evaluation settings) and
``base_provenance``; ``seeds`` lists each run's own seed, ``"unknown"`` where no file records it.
"""
from __future__ import annotations

import json
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
    # rows built by `compare` carry what produced them: their engine and seeds go in the table
    prov = any(isinstance(M.get("provenance"), Mapping) for _, M in rows)
    head = "| model | " + ("engine | seeds | " if prov else "") + " | ".join(h for h, _ in cols) + " |"
    sep = "|---|" + ("---|---|" if prov else "") + "---|" * len(cols)
    lines = [head, sep]
    for name, M in rows:
        extra = ""
        if prov:
            p = M.get("provenance") or {}
            extra = (f"{p.get('engine', '-')} | {', '.join(str(s) for s in p.get('seeds', [])) or '-'} | "
                     if p else "- | - | ")
        lines.append(f"| {name} | " + extra + " | ".join(_fmt(M, p) for _, p in cols) + " |")
    return "\n".join(lines)


def passk_markdown(metrics: Mapping[str, Any], rows: Sequence[Tuple[str, Mapping[str, Any]]]) -> List[str]:
    """Where the evaluation went past k = 16 (``eval --k ...,64``): pass@k at every k it evaluated, mean ±
    sd over the seeds (the comparison table stops at pass@16; the plot alone would leave pass@64 unread)."""
    ks = sorted(int(k) for k in ((metrics.get("evaluation") or {}).get("ks") or []))
    if not ks or max(ks) <= 16:
        return []
    ks = [k for k in ks if _get(metrics["base"], f"pass_at_k::{k}") is not None]
    if not ks:
        return []
    head = "| model | " + " | ".join(f"pass@{k}" for k in ks) + " |"
    lines = [head, "|---|" + "---:|" * len(ks)]
    for name, M in rows:
        lines.append(f"| {name} | " + " | ".join(_fmt(M, f"pass_at_k::{k}") for k in ks) + " |")
    return ["## pass@k against k", "", f"Every k the evaluation computed (up to its {metrics['base'].get('n_samples', '?')} "
            "samples per problem), mean ± sd over the row's seeds.", ""] + lines + [""]


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
    # the rare split's pass@16 where the evaluation has one (the demo); else no "rare" line (it would
    # repeat the all-problems pass@16 under another label)
    rare = next((f"splits::{s}::pass@16" for s in (base.get("splits") or {}) if s.endswith("rare")), None)

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
                d = cmp(a, b, path) if path else None
                if d:
                    out.append(f"- {a} keeps more {label} than {b}: {_get(methods[a], path):.3f} vs "
                               f"{_get(methods[b], path):.3f}: {verdict(d[0], d[1], d[2], True)}")
    p1 = f"splits::{style_split}::pass@1" if style_split else "pass@1"
    p1_label = f"pass@1 ({style_split.split('/')[-1]} split)" if style_split else "pass@1"
    for a in ("dph_f", "dph_js", "ds_grpo", "lad_js"):
        d = cmp(a, "grpo", p1)
        if d:
            out.append(f"- (the price) {a} vs grpo, {p1_label}: {_get(methods[a], p1):.3f} vs "
                       f"{_get(methods['grpo'], p1):.3f} (difference {d[0]:+.3f}, "
                       + (f"larger seed sd {d[1]:.3f})" if d[2] > 1 else "single seed, spread unknown)"))
    for a in ("ds_grpo", "lad_js"):
        for path, label in ((sty, sty_label), (rare, "pass@16 (rare)"), ("pass@16", "pass@16"), ("dist-2", "dist-2")):
            d = cmp(a, "grpo", path) if path else None
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
            j = i - 1  # the methods' own index: the same colour and marker as in curves.png
            style = (dict(color="black", lw=2.2, ls="--", marker="o") if name == "base" else
                     dict(color=cmap(j % 10), lw=1.6, marker=MARKERS[j % len(MARKERS)],
                          ls=("-", "-.", ":")[(j // 10) % 3]))
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
    ns = sorted({M.get("n_samples") for _, M in rows[1:] if M.get("n_samples") is not None} - {base.get("n_samples")})
    per = (f"{base.get('n_samples', '?')} samples each" if not ns else  # --allow-mismatch: say both
           f"{base.get('n_samples', '?')} samples (base) / {', '.join(f'{n:g}' for n in ns)} (methods) each")
    md += [f"{base.get('n_problems', '?')} evaluation problems x {per}; "
           f"methods: mean ± sd over {'/'.join(map(str, seeds))} seed(s). pass@k is the unbiased estimator; "
           f"keep / explore use the first {keep_k} samples of each problem (one pass@{keep_k} draw) against the base.",
           ""]
    md += ["## Comparison", "", _table(rows, _columns(metrics, style_split)), ""]
    md += passk_markdown(metrics, rows)
    md += provenance_markdown(metrics)
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
    curves = metrics.get("curves")
    if curves:
        paths["curves_plot"] = plot_curves(curves, os.path.join(out_dir, "curves.png"), str(metrics.get("task", "")),
                                           order=list(metrics["methods"]))
        md += curves_markdown(curves)
    md += ["## Plots", "", "![pass@k](passk.png)", ""]
    if curves:
        md += ["![held-out pass@k against training steps](curves.png)", ""]
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


# ------------------------------------------------------------------ learning curves
#: the trainer's periodic held-out evaluations a run folder keeps (one JSON line per evaluation, with ``step``)
CURVE_FILE = "eval.jsonl"


def _curve_rows(run_dir: str) -> Dict[int, Dict[str, float]]:
    """``{step: {"pass@k": value}}`` of a run folder's periodic evaluations (empty when it has none)."""
    path = os.path.join(run_dir, CURVE_FILE)
    out: Dict[int, Dict[str, float]] = {}
    if not os.path.isfile(path):
        return out
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash: the rest still reads
            if not isinstance(row, dict) or "step" not in row:
                continue
            out[int(row["step"])] = {k: float(v) for k, v in row.items()
                                     if k.startswith("pass@") and isinstance(v, (int, float))}
    return out


def learning_curves(groups: Mapping[str, Mapping[str, Any]]) -> Dict[str, Any]:
    """Held-out pass@k against training steps per row (the runs' ``eval.jsonl``): at each step that
    every seed of the row evaluated, the mean and sd over seeds. ``{label: {"steps": [...],
    "n_seeds": n, "mean": {"pass@k": [...]}, "sd": {...}}}``; rows whose runs kept no periodic
    evaluation are left out."""
    out: Dict[str, Any] = {}
    for label, g in groups.items():
        per_run = [_curve_rows(os.path.dirname(e["_path"])) for e in g["runs"]]
        if not per_run or not all(per_run):
            continue
        steps = sorted(set.intersection(*(set(r) for r in per_run)))
        keys = sorted(set.intersection(*(set(r[st]) for r in per_run for st in steps)),
                      key=lambda k: int(k.split("@")[1])) if steps else []
        if not steps or not keys:
            continue
        mean = {k: [float(np.mean([r[st][k] for r in per_run])) for st in steps] for k in keys}
        sd = {k: [float(np.std([r[st][k] for r in per_run], ddof=1)) if len(per_run) > 1 else 0.0 for st in steps]
              for k in keys}
        out[label] = {"steps": steps, "n_seeds": len(per_run), "mean": mean, "sd": sd}
    return out


def plot_curves(curves: Mapping[str, Any], path: str, task: str = "", order: Sequence[str] = ()) -> str:
    """pass@1 and pass@kmax (the largest k every row evaluated) against training steps, one line per
    row (mean over seeds, band = ±1 sd); a method has the colour and marker it has in passk.png."""
    plt = _plt()
    fig = curves_figure(curves, task, order)
    fig.savefig(path + ".tmp.png", dpi=120)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)
    return path


def curves_figure(curves: Mapping[str, Any], task: str = "", order: Sequence[str] = ()):
    """The figure of :func:`plot_curves`, not yet saved; ``order``: the report's rows (metrics' methods), so
    a row has its passk.png colour even where a row before it has no curve."""
    plt = _plt()
    common = set.intersection(*(set(c["mean"]) for c in curves.values()))
    kmax = max((k for k in common), key=lambda k: int(k.split("@")[1]))
    panels = ["pass@1", kmax] if kmax != "pass@1" else ["pass@1"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.4 * len(panels), 4.2), squeeze=False, layout="constrained")
    cmap = plt.get_cmap("tab10")
    for ax, key in zip(axes[0], panels):
        for n, (label, c) in enumerate(curves.items()):
            i = list(order).index(label) if label in order else n
            x = np.array(c["steps"])
            y, e = np.array(c["mean"][key]), np.array(c["sd"][key])
            ax.plot(x, y, marker=MARKERS[i % len(MARKERS)], ms=3.5, lw=1.6, color=cmap(i % 10),
                    label=f"{label} ({c['n_seeds']} seed{'s' if c['n_seeds'] != 1 else ''})")
            ax.fill_between(x, y - e, y + e, color=cmap(i % 10), alpha=0.15, lw=0)
        ax.set_xlabel("training step")
        ax.set_ylabel(f"held-out {key}")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(_wrapped(f"{task}: held-out pass@k during training (the runs' periodic evaluations; mean over "
                          f"seeds, band = ±1 sd)", 5.4 * len(panels)))
    return fig


def curves_markdown(curves: Mapping[str, Any]) -> List[str]:
    """One table per row: pass@k (mean ± sd over seeds) at every evaluated step."""
    md = ["## Held-out pass@k against training steps", "",
          "The runs' own periodic evaluations (`eval.jsonl`; step 0 is the initial policy), mean ± sd over "
          "the row's seeds at the steps every seed evaluated.", ""]
    for label, c in curves.items():
        keys = list(c["mean"])
        md += [f"**{label}** ({c['n_seeds']} seed{'s' if c['n_seeds'] != 1 else ''})", "",
               "| step | " + " | ".join(keys) + " |", "|---:|" + "---:|" * len(keys)]
        for i, st in enumerate(c["steps"]):
            cells = [f"{c['mean'][k][i]:.3f}" + (f" ± {c['sd'][k][i]:.3f}" if c["n_seeds"] > 1 else "") for k in keys]
            md.append(f"| {st} | " + " | ".join(cells) + " |")
        md.append("")
    return md


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


def _val(v: Any) -> str:
    """A setting's value as the report prints it (JSON for dicts and lists)."""
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True, default=str)
    return "unset" if v is _UNSET else str(v)


_UNSET = object()


def _same(a: Any, b: Any) -> bool:
    if a is _UNSET or b is _UNSET:
        return a is b
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _differing(dicts: Sequence[Optional[Mapping[str, Any]]], keys: Optional[Iterable[str]] = None) -> List[str]:
    """The keys on which the known (non-None) ``dicts`` disagree (a key one of them lacks counts)."""
    known = [d for d in dicts if d is not None]
    if len(known) < 2:
        return []
    allk = list(dict.fromkeys(k for d in known for k in d)) if keys is None else list(keys)
    return [k for k in allk if any(not _same(known[0].get(k, _UNSET), d.get(k, _UNSET)) for d in known[1:])]


def _eval_key(settings: Mapping[str, Any]) -> Dict[str, Any]:
    from .results import COMPARED_SETTINGS, _setting

    return {f"eval {k}": _setting(settings, k) for k in COMPARED_SETTINGS}


def group_runs(evals: Sequence[Mapping[str, Any]]) -> "OrderedDict[str, Dict[str, Any]]":
    """Runs grouped by what they ran: (method name, engine, training settings except the seed,
    evaluation settings). Returns ``{row label: {"method", "engine", "settings", "eval",
    "runs": [eval dicts]}}`` in first-seen order. A method whose runs fall into several groups gets
    one row per group, labelled by the keys that differ, e.g. ``dph_js [method.anchor_eta=0.3]``
    (``[settings unknown]`` for runs whose run folder does not record them). Raises
    ``ValueError`` for a repeated (method, settings, seed): a repeat is not a second seed."""
    groups: "OrderedDict[str, Dict[str, Any]]" = OrderedDict()
    for e in evals:
        prov = e["_provenance"]
        ev = _eval_key(e["settings"])
        key = json.dumps([e["name"], prov["engine"], prov["settings"], ev], sort_keys=True, default=str)
        g = groups.setdefault(key, {"method": e["name"], "engine": prov["engine"], "settings": prov["settings"],
                                    "eval": ev, "runs": []})
        g["runs"].append(e)
    for g in groups.values():
        seen: Dict[int, str] = {}
        for e in g["runs"]:
            seed, where = e["_provenance"]["seed"], os.path.dirname(e["_path"])
            if seed is None:
                continue
            if seed in seen:
                what = "the same settings" if g["settings"] is not None else "unknown settings"
                raise ValueError(f"compare: {seen[seed]} and {where} are both {g['method']} seed {seed} with {what} "
                                 f"on engine {g['engine']}: a repeat is not a second seed; pass one of them"
                                 + ("" if g["settings"] is not None else
                                    ", or name them apart (NAME=DIR) if they ran different settings"))
            seen[seed] = where
    by_method: "OrderedDict[str, List[Dict[str, Any]]]" = OrderedDict()
    for g in groups.values():
        by_method.setdefault(g["method"], []).append(g)
    out: "OrderedDict[str, Dict[str, Any]]" = OrderedDict()
    for name, gs in by_method.items():
        skeys = _differing([g["settings"] for g in gs])
        ekeys = _differing([g["eval"] for g in gs])
        engines = len({g["engine"] for g in gs}) > 1
        for g in gs:
            parts = [f"engine={g['engine']}"] if engines else []
            if g["settings"] is None:
                parts.append("settings unknown")
            else:
                parts += [f"{k}={_val(g['settings'].get(k, _UNSET))}" for k in skeys]
            parts += [f"{k}={_val(g['eval'].get(k))}" for k in ekeys]
            label = f"{name} [{', '.join(parts)}]" if parts and len(gs) > 1 else name
            base_label, i = label, 2
            while label in out:
                label, i = f"{base_label} #{i}", i + 1
            out[label] = g
    return out


def comparability_flags(groups: Mapping[str, Mapping[str, Any]]) -> List[str]:
    """One line per thing that makes the rows not comparable: a training setting every row has,
    other than the method's own (``method.*``), that differs between rows (prompts, grading, data,
    evaluation, budget, model), runs whose settings are unknown, runs of unknown seed."""
    flags: List[str] = []
    known = [(label, g) for label, g in groups.items() if g["settings"] is not None]
    # a key only some rows have belongs to their method (DPH's anchor.* / presample.*): not a flag
    shared = [k for k in (known[0][1]["settings"] if known else {}) if all(k in g["settings"] for _, g in known)]
    for k in _differing([g["settings"] for _, g in known], shared):
        if k.startswith("method."):
            continue
        flags.append(f"`{k}` differs between rows: " + ", ".join(
            f"{label}={_val(g['settings'].get(k, _UNSET))}" for label, g in known))
    unknown = [label for label, g in groups.items() if g["settings"] is None]
    if unknown:
        flags.append("settings unknown for " + ", ".join(unknown) + ": their run folders record no resolved "
                     "settings (run_info.json without \"settings\": written before it was recorded, or not a run "
                     "folder), so compare cannot tell whether they ran the same setup; their runs are grouped by "
                     "method and engine only")
    for label, g in groups.items():
        n_unknown = sum(e["_provenance"]["seed"] is None for e in g["runs"])
        if n_unknown:
            flags.append(f"{label}: {n_unknown} run(s) of unknown seed (no seed in run_info.json or eval.json)"
                         + (": they may repeat one seed" if len(g["runs"]) > 1 else ""))
        for e in g["runs"]:
            for note in e["_provenance"]["notes"]:
                flags.append(f"{label} ({os.path.dirname(e['_path'])}): {note}")
    return flags


def _provenance_of(g: Mapping[str, Any], seeds: Sequence[Any]) -> Dict[str, Any]:
    return {"method": g["method"], "engine": g["engine"],
            "experiment": sorted({str(e["_provenance"]["experiment"]) for e in g["runs"]
                                  if e["_provenance"]["experiment"] is not None}) or None,
            "seeds": list(seeds), "settings": g["settings"],
            "settings_known": g["settings"] is not None,
            "runs": [{"path": os.path.dirname(e["_path"]), "seed": e["_provenance"]["seed"],
                      "run_dir": e["_provenance"]["run_dir"]} for e in g["runs"]]}


def provenance_markdown(metrics: Mapping[str, Any]) -> List[str]:
    """The report's "What produced each row" section: per row its engine, experiment, seeds and run
    folders; the training settings every row shares once, then each row's own."""
    rows = [(label, M["provenance"]) for label, M in (metrics.get("methods") or {}).items()
            if isinstance(M, Mapping) and M.get("provenance")]
    if not rows:
        return []
    md = ["## What produced each row", "",
          "| row | engine | experiment | seeds | run folders |", "|---|---|---|---|---|"]
    for label, p in rows:
        seeds = ", ".join(str(s) for s in p["seeds"])
        md.append(f"| {label} | {p['engine']} | {', '.join(p['experiment'] or ['-'])} | {seeds} | "
                  + "<br>".join(f"`{r['path']}`" for r in p["runs"]) + " |")
    ev = metrics.get("evaluation") or {}
    if ev:
        md += ["", "Evaluation (the base's; every row's agrees unless --allow-mismatch says otherwise above): "
               + ", ".join(f"`{k}={_val(v)}`" for k, v in ev.items())]
    known = [p["settings"] for _, p in rows if p["settings"] is not None]
    differ = set(_differing(known))
    common = {k: v for k, v in (known[0] if known else {}).items() if k not in differ}
    md.append("")
    if common:
        md += ["Training settings of every row (seed aside)" + (" with known settings" if len(known) < len(rows)
                                                                 else "") + ": "
               + ", ".join(f"`{k}={_val(v)}`" for k, v in sorted(common.items())), ""]
    for label, p in rows:
        if p["settings"] is None:
            md.append(f"- **{label}**: settings unknown")
        elif differ:
            md.append(f"- **{label}**: " + ", ".join(f"`{k}={_val(p['settings'].get(k, _UNSET))}`"
                                                    for k in sorted(differ)))
    return md + [""]


def compare_runs(run_dirs: Iterable[str], out_dir: str, *, base_dir: Optional[str] = None,
                 style_split: Optional[str] = "auto", allow_mismatch: bool = False,
                 evaluate_missing: Optional[Callable[[str], Any]] = None) -> Dict[str, str]:
    """The report from eval outputs and ``train`` run directories (``openrlhf-div compare``;
    see :func:`~.results.load_run` for what a ``RUN_DIR`` may be, ``NAME=DIR`` and
    ``evaluate_missing``).

    The base is ``base_dir``, the one run with ``role == "base"``, or else the step-0
    evaluation a run holds (:func:`step0_base`); the report and stderr say which. Runs are grouped
    by what they ran (:func:`group_runs`: method, engine, training settings except the seed,
    evaluation settings); a group's runs are its seeds (mean +- sd), a repeated seed is an error,
    a method whose runs differ in a setting gets one row per setting. What makes rows not
    comparable is flagged at the top of the report (:func:`comparability_flags`), and every row
    carries its engine, seeds, settings and run folders (``metrics.json``: ``provenance``).
    Keep / explore rates are recomputed against this base (at the runs' ``keep_k``). Runs
    evaluated with different settings (:func:`~.results.settings_differences`) are an error
    listing the differences, unless ``allow_mismatch``: then the report says so at the top.
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
    base_problems = base_eval.get("problems")
    trained = [e for e in evals if not (e["_path"] == base_eval["_path"] or e["role"] == "base")]
    groups = group_runs(trained)
    methods: Dict[str, Dict[Any, Dict[str, Any]]] = OrderedDict()
    seeds_of: Dict[str, List[Any]] = {}
    for label, g in groups.items():
        per_seed = methods.setdefault(label, OrderedDict())
        for e in g["runs"]:
            M = dict(e["metrics"])
            if base_problems and e.get("problems"):
                ids = {p["id"] for p in base_problems}
                if ids != {p["id"] for p in e["problems"]}:
                    raise ValueError(f"compare: run {e['name']!r} ({os.path.dirname(e['_path'])}) was evaluated on "
                                     f"other problems than the base; evaluate both on the same set")
                redo = model_metrics(e["problems"], base=base_problems, keep_k=keep_k)
                M["keep_rate"], M["explore_rate"] = redo["keep_rate"], redo["explore_rate"]
            seed = e["_provenance"]["seed"]
            key: Any = seed
            if seed is None:
                key, i = "unknown", 2
                while key in per_seed:
                    key, i = f"unknown#{i}", i + 1
            per_seed[key] = M
        seeds_of[label] = ["unknown" if s is None else s for s in (e["_provenance"]["seed"] for e in g["runs"])]
    flags = comparability_flags(groups)
    metrics = build_metrics(next(iter(tasks)), base_M, methods, settings_mismatch=mismatch, flags=flags)
    for label, g in groups.items():
        metrics["methods"][label]["seeds"] = seeds_of[label]
        metrics["methods"][label]["provenance"] = _provenance_of(g, seeds_of[label])
    curves = learning_curves(groups)
    if curves:
        metrics["curves"] = curves
    metrics["base_provenance"] = {"path": os.path.dirname(base_eval["_path"]), "note": base_note}
    metrics["evaluation"] = {**{k: v for k, v in base_eval["settings"].items()
                                if not isinstance(v, (dict, list)) or k == "ks"},
                             "data_hash": (base_eval["settings"].get("data") or {}).get("hash")}
    intro = f"**Base.** {base_note[len('base: '):]}." if base_note else ""
    if mismatch:
        intro += ("\n\n" if intro else "") + ("**Warning: these runs were evaluated with different settings (compared with --allow-mismatch); "
                 "their numbers are not directly comparable:**\n\n" + "\n".join(f"- {d}" for d in mismatch))
    if flags:
        intro += ("\n\n" if intro else "") + ("**Warning: the rows did not all run the same setup** (rows are never "
                                              "averaged across settings; read these before comparing):\n\n"
                                              + "\n".join(f"- {f}" for f in flags))
    for f in flags:
        print(f"compare: warning: {f}", file=sys.stderr)
    return write_report(out_dir, metrics, style_split=style_split, intro=intro, keep_k=keep_k)
