"""Beyond accuracy (ALGORITHMS.md section 6): keep / exploration rates, lexical and solution
diversity. Inputs are plain Python / numpy so any engine's outputs can be scored."""
from __future__ import annotations

from typing import Dict, Hashable, Iterable, List, Mapping, Sequence, Tuple


def keep_explore_rates(base_solved: Mapping[Hashable, bool],
                       model_solved: Mapping[Hashable, bool]) -> Tuple[float, float]:
    """Keep and exploration rate of a trained model against its base (DPH 6.2).

    ``base_solved[id]``: the base model solved problem ``id`` at pass@8 (any of 8 samples
    correct); ``model_solved[id]`` likewise for the trained model. ``keep`` is the share of
    base-solved problems the model still solves, ``explore`` the share of base-unsolved ones it
    now solves (NaN when that split is empty). Problems missing from ``model_solved`` raise.
    """
    missing = [k for k in base_solved if k not in model_solved]
    if missing:
        raise ValueError(f"keep_explore_rates: {len(missing)} problem(s) missing from the model's "
                         f"results, e.g. {missing[:3]!r}")
    solved = [k for k, v in base_solved.items() if v]
    unsolved = [k for k, v in base_solved.items() if not v]
    keep = sum(bool(model_solved[k]) for k in solved) / len(solved) if solved else float("nan")
    explore = sum(bool(model_solved[k]) for k in unsolved) / len(unsolved) if unsolved else float("nan")
    return keep, explore


def distinct_n(texts: Sequence[str], n: int = 2) -> float:
    """dist-n (LAD Table 4): distinct n-grams / total n-grams over the samples of one problem.

    The project's one definition, used by every report (``eval.json``'s ``metrics`` and its
    ``by_source``, ``results.md``, ``compare``): the n-grams are **character** n-grams of each
    response (independent of any tokenizer, and defined for one-word answers such as ``"7"``,
    where word bigrams would not exist). A response shorter than ``n`` contributes none; no
    n-gram at all gives 0.0. Example: ``["ab a", "ab"]``, n=2: ``ab``, ``b ``, `` a``, ``ab`` ->
    3 distinct / 4 = 0.75."""
    if n < 1:
        raise ValueError(f"distinct_n needs n >= 1, got {n}")
    grams: List[str] = []
    for t in texts:
        grams.extend(t[i:i + n] for i in range(len(t) - n + 1))
    return len(set(grams)) / len(grams) if grams else 0.0


def mean_distinct_n(samples_per_problem: Iterable[Sequence[str]], n: int = 2) -> float:
    """dist-n (:func:`distinct_n`) averaged over problems."""
    vals = [distinct_n(s, n) for s in samples_per_problem]
    return sum(vals) / len(vals) if vals else 0.0


def distinct_correct(keys: Sequence[Hashable], correct: Sequence[bool]) -> int:
    """Number of distinct solutions (or styles) among the correct samples of one problem.

    ``keys[i]`` identifies sample ``i``'s solution (a normalised program, a style label, ...).
    """
    if len(keys) != len(correct):
        raise ValueError(f"distinct_correct: {len(keys)} keys but {len(correct)} correctness flags")
    return len({k for k, c in zip(keys, correct) if c})


def solution_diversity(per_problem: Iterable[Tuple[Sequence[Hashable], Sequence[bool]]],
                       at_least: int = 3) -> Dict[str, float]:
    """Style / solution diversity (DPH App. A, DS Table 7) over problems: the mean number of
    distinct correct solutions per problem and the share of problems with ``>= at_least``."""
    counts = [distinct_correct(k, c) for k, c in per_problem]
    if not counts:
        return {"mean_distinct_correct": 0.0, f"share_ge_{at_least}": 0.0}
    return {
        "mean_distinct_correct": sum(counts) / len(counts),
        f"share_ge_{at_least}": sum(c >= at_least for c in counts) / len(counts),
    }
