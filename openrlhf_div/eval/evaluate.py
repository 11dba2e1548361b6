"""The evaluation runner: sample, score, and summarise per dataset (ALGORITHMS.md section 6).

:func:`evaluate` takes any ``generate_fn(prompts, n=, temperature=, top_p=, max_new_tokens=,
greedy=) -> list[list[str]]`` (Hugging Face, vLLM, the local engine, or a fake in tests), so
the demo and the CLI share it. Per dataset (the examples' ``source``) it reports:

* ``pass@k`` -- unbiased, ``1 - C(n-c, k) / C(n, k)`` averaged over problems, for each ``k``;
* ``mean@n`` -- the mean accuracy of the ``n`` samples (averaged over problems);
* ``greedy`` -- temperature-0 accuracy (when ``greedy=True``);
* ``mean_reward`` -- the mean task reward (differs from accuracy for Countdown's 0.1);
* ``dist-m`` -- distinct character m-grams / total m-grams over a problem's samples, averaged
  (the one definition: :func:`openrlhf_div.eval.diversity.distinct_n`);
* ``distinct_correct`` -- distinct correct solutions per problem (``task.solution_key``) and
  the share of problems with at least 3;
* ``keep_rate`` / ``explore_rate`` against a base model's results (DPH 6.2): among problems
  the base solved at pass@``keep_k`` (any of its first ``keep_k`` samples correct), the share
  this model still solves; among those it did not, the share this model now solves.

It is the one evaluation of the project: ``openrlhf-div eval`` (any model file), the local
trainer's in-training evaluation (:mod:`openrlhf_div.engines.local.evaluation`), the demo and
the OpenRLHF driver's vLLM evaluation all call it with their own ``generate_fn`` and write its
result with :func:`openrlhf_div.eval.results.write_eval` (``eval.json``, ``samples.jsonl``,
``results.md``). The result holds ``settings`` (what makes two evaluations comparable),
``metrics`` (:func:`openrlhf_div.eval.results.model_metrics` over all problems, with per-source
``splits``), ``by_source`` (:func:`summarize`) and the per-problem records.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from collections import Counter, defaultdict
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from .diversity import keep_explore_rates, mean_distinct_n
from .passk import mean_at_k, pass_at_k
from .results import EVAL_FORMAT, data_hash, model_metrics, results_markdown  # noqa: F401 (part of this API)
from openrlhf_div.progress import progress_bar
from openrlhf_div.tasks.datasets import render_example

__all__ = ["evaluate", "summarize", "results_markdown"]


def _check_outputs(outs, prompts, n, where):
    if not isinstance(outs, (list, tuple)) or len(outs) != len(prompts):
        got = len(outs) if isinstance(outs, (list, tuple)) else type(outs).__name__
        raise ValueError(f"generate_fn returned {got} groups for {len(prompts)} prompts ({where})")
    for i, g in enumerate(outs):
        if not isinstance(g, (list, tuple)) or len(g) != n or not all(isinstance(s, str) for s in g):
            raise ValueError(f"generate_fn must return {n} strings per prompt; prompt {i} got "
                             f"{len(g) if isinstance(g, (list, tuple)) else type(g).__name__} ({where})")


def evaluate(task, examples: Sequence[Mapping[str, Any]], generate_fn: Callable[..., List[List[str]]],
             n: int = 16, ks: Sequence[int] = (1, 8, 16), *, greedy: bool = False, temperature: float = 1.0,
             top_p: float = 1.0, max_new_tokens: int = 1024, tokenizer=None,
             base_results: Optional[Mapping[str, Any]] = None, keep_k: int = 8, dist_ns: Sequence[int] = (1, 2),
             batch_size: int = 16, progress: bool = True, keep_responses: bool = True,
             prompt_template: Optional[str] = None, system_prompt: Optional[str] = None,
             styles: Optional[Sequence[str]] = None, is_base: bool = False,
             render: Optional[Callable[[Mapping[str, Any]], str]] = None,
             heartbeat_s: float = 30.0) -> Dict[str, Any]:
    """Generate ``n`` samples per example, score them with ``task``, and summarise.

    With ``progress``: a line per 10% of the samples (or 30 s) with samples done, samples/s,
    generated tokens/s and the ETA, and, while one generate call runs longer than ``heartbeat_s``,
    a line every ``heartbeat_s`` saying which samples are being generated and for how long (a
    CPU run of long responses would otherwise print nothing for minutes; issue 43 item 4).

    ``examples``: normalised ``{"prompt", "label", "source", "id"}`` dicts (see
    :func:`openrlhf_div.tasks.datasets.load_examples`). ``ks`` must lie in ``[1, n]``.
    Prompts are rendered with ``task.render_prompt(example, tokenizer)``, or with
    ``prompt_template`` / ``system_prompt`` as in training
    (:func:`openrlhf_div.tasks.datasets.render_example`), or by ``render(example)`` when given
    (an engine with its own prompt convention, e.g. OpenRLHF's chat template). ``base_results``:
    a previous result of this function (or its ``eval.json``) for keep/exploration rates;
    ``is_base`` marks the base model itself (keep 1, explore 0); ``styles``: the style names
    in order, for tasks whose ``RewardResult.info`` carries a ``style`` (the demo).

    Returns ``{"format", "task", "settings": {n, ks, temperature, top_p, max_new_tokens,
    greedy, keep_k, grading, data: {hash, problems}, ...}, "metrics": M, "by_source":
    {source: {...}, "all": {...}}, "problems": [...]}`` where each problem holds its per-sample
    ``correct``, ``rewards``, ``reasons``, ``styles`` (and ``responses`` when
    ``keep_responses``).
    """
    ks = sorted({int(k) for k in ks})
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    bad = [k for k in ks if k < 1 or k > n]
    if bad:
        raise ValueError(f"every k must be in [1, n={n}]; got {bad}. Lower --k or raise --n")
    if not examples:
        raise ValueError("evaluate: no examples")
    prompts = []
    for ex in examples:
        try:
            prompts.append(render(ex) if render is not None else
                           render_example(task, tokenizer, ex, prompt_template, system_prompt))
        except Exception as exc:
            raise ValueError(f"cannot build the prompt of example {ex.get('id')!r} ({ex.get('source')}): "
                             f"{type(exc).__name__}: {exc}") from exc

    total = len(examples) * (n + (1 if greedy else 0))
    bar = progress_bar(total=total, desc=f"eval {task.name}", unit="sample", disable=not progress)
    pace = _Pace(f"eval {task.name}", total, tokenizer, heartbeat_s if progress else 0.0)
    problems: List[Dict[str, Any]] = []
    try:
        for start in range(0, len(examples), batch_size):
            chunk = examples[start:start + batch_size]
            cprompts = prompts[start:start + batch_size]
            with pace.call(len(chunk), n, max_new_tokens):
                outs = generate_fn(cprompts, n=n, temperature=temperature, top_p=top_p,
                                   max_new_tokens=max_new_tokens, greedy=False)
            _check_outputs(outs, cprompts, n, "sampling")
            pace.done(outs)
            bar.set_postfix_str(pace.postfix())
            flat = [r for g in outs for r in g]
            labels = [ex["label"] for ex in chunk for _ in range(n)]
            results = task.reward_results(flat, labels)
            for j, ex in enumerate(chunk):
                rs = results[j * n:(j + 1) * n]
                resps = outs[j]
                correct = [bool(r.correct) for r in rs]
                keys = [str(task.solution_key(s, r)) for s, r in zip(resps, rs) if r.correct]
                sty = [(r.info or {}).get("style") for r in rs]
                rec = {"id": str(ex["id"]), "source": str(ex.get("source", "data")), "n_correct": sum(correct),
                       "correct": correct, "rewards": [float(r.reward) for r in rs], "reasons": [r.reason for r in rs],
                       "styles": sty if all(x is not None for x in sty) else None,
                       "distinct_correct": len(set(keys)), "greedy_correct": None}
                rec["_responses"] = list(resps)
                if keep_responses:
                    rec["responses"] = [str(x) for x in resps]
                    rec["prompt"] = cprompts[j]
                    rec["label"] = ex.get("label")
                    rec["answers"] = [extracted_answer(r) for r in rs]
                    rec["truncated"] = [getattr(x, "truncated", None) for x in resps]
                problems.append(rec)
            bar.update(len(chunk) * n)
        if greedy:
            for start in range(0, len(examples), batch_size):
                chunk = examples[start:start + batch_size]
                cprompts = prompts[start:start + batch_size]
                with pace.call(len(chunk), 1, max_new_tokens):
                    outs = generate_fn(cprompts, n=1, temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens,
                                       greedy=True)
                _check_outputs(outs, cprompts, 1, "greedy")
                pace.done(outs)
                bar.set_postfix_str(pace.postfix())
                results = task.reward_results([g[0] for g in outs], [ex["label"] for ex in chunk])
                for j, r in enumerate(results):
                    rec = problems[start + j]
                    rec["greedy_correct"] = bool(r.correct)
                    rec["greedy_reason"] = r.reason
                    if keep_responses:
                        rec["greedy_response"] = outs[j][0]
                bar.update(len(chunk))
    finally:
        pace.stop()
        bar.close()

    by_source = summarize(problems, n, ks, base_results=base_results, keep_k=keep_k, dist_ns=dist_ns)
    base_problems = base_results.get("problems") if base_results else None
    metrics = model_metrics([{**p, "responses": p["_responses"]} for p in problems], base=base_problems,
                            is_base=is_base, styles=styles, keep_k=keep_k)
    for rec in problems:
        rec.pop("_responses", None)
    grading = task.grading() if hasattr(task, "grading") else None  # duck-typed tasks may lack it
    settings = {"n": n, "ks": ks, "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
                "greedy": bool(greedy), "keep_k": keep_k, "grading": grading,
                "data": {"hash": data_hash(examples), "problems": len(examples)},
                "prompt_template": prompt_template, "system_prompt": system_prompt}
    return {"format": EVAL_FORMAT, "task": task.name, "settings": settings, "metrics": metrics,
            "by_source": by_source, "problems": problems}


class _Pace:
    """Generated tokens per second of an evaluation, and the heartbeat line while one generate
    call runs (a thread that prints every ``heartbeat_s`` until the call returns; 0: none)."""

    def __init__(self, desc: str, total: int, tokenizer, heartbeat_s: float):
        self.desc, self.total, self.tokenizer, self.heartbeat_s = desc, total, tokenizer, float(heartbeat_s)
        self.samples = self.tokens = 0
        self.t0 = time.monotonic()
        self._stop = None

    def _count(self, text: str) -> int:
        if self.tokenizer is not None:
            try:
                return len(self.tokenizer.encode(str(text), add_special_tokens=False))
            except Exception:  # noqa: BLE001 - a tokenizer without that signature: words instead
                pass
        return len(str(text).split())

    def done(self, outs) -> None:
        for group in outs:
            self.samples += len(group)
            self.tokens += sum(self._count(x) for x in group)

    def rate(self) -> Optional[float]:
        el = time.monotonic() - self.t0
        return self.tokens / el if el > 0 and self.samples else None

    def postfix(self) -> str:
        r = self.rate()
        return f"{r:.1f} tokens/s" if r is not None else ""

    @contextlib.contextmanager
    def call(self, prompts: int, n: int, max_new_tokens: int):
        if self.heartbeat_s <= 0:
            yield
            return
        import threading

        stop, start = threading.Event(), time.monotonic()
        first, last = self.samples + 1, min(self.total, self.samples + prompts * n)

        def beat():
            while not stop.wait(self.heartbeat_s):
                el = time.monotonic() - self.t0
                line = (f"{self.desc}: {self.samples}/{self.total} samples done; generating samples {first}-{last} "
                        f"({prompts} prompt(s) x {n}, up to {max_new_tokens} new tokens each) for "
                        f"{_duration(time.monotonic() - start)}")
                if self.samples and el > 0:
                    eta = (self.total - self.samples) * el / self.samples
                    line += f"; {self.tokens / el:.1f} tokens/s so far, ETA {_duration(eta)}"
                else:
                    line += "; no sample finished yet (a lower --max-new-tokens or --limit shortens a slow run)"
                print(line, file=sys.stderr, flush=True)
        thread = threading.Thread(target=beat, name="eval-heartbeat", daemon=True)
        self._stop = stop
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self._stop = None

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()


def _duration(seconds: float) -> str:
    from openrlhf_div.progress import _duration as d

    return d(seconds)


def extracted_answer(result) -> Optional[str]:
    """What the verifier read from a response (math ``answer``, SQL ``sql``, Countdown
    ``equation``), or None."""
    info = getattr(result, "info", None) or {}
    for key in ("answer", "sql", "equation"):
        if info.get(key) is not None:
            return str(info[key])
    return None


def _nan_to_none(x):
    return None if isinstance(x, float) and math.isnan(x) else x


def _base_solved(base_results: Mapping[str, Any], keep_k: int) -> Dict[tuple, bool]:
    out = {}
    for p in base_results.get("problems", []):
        out[(str(p.get("source")), str(p["id"]))] = any(p["correct"][:keep_k])
    return out


def summarize(problems: Sequence[Mapping[str, Any]], n: int, ks: Sequence[int], *,
              base_results: Optional[Mapping[str, Any]] = None, keep_k: int = 8,
              dist_ns: Sequence[int] = (1, 2)) -> Dict[str, Dict[str, Any]]:
    """Metrics per source (and ``"all"`` when there are several) from per-problem records
    (``correct``, ``rewards``, ``reasons``, ``distinct_correct``, ``greedy_correct`` and the
    responses under ``_responses`` or ``responses`` for dist-n)."""
    groups: Dict[str, List[Mapping[str, Any]]] = defaultdict(list)
    for p in problems:
        groups[p["source"]].append(p)
    if len(groups) > 1:
        groups["all"] = list(problems)
    base = _base_solved(base_results, keep_k) if base_results else None
    out: Dict[str, Dict[str, Any]] = {}
    for src, ps in groups.items():
        m: Dict[str, Any] = {"problems": len(ps)}
        for k in ks:
            m[f"pass@{k}"] = float(sum(pass_at_k(n, p["n_correct"], k) for p in ps) / len(ps))
        m[f"mean@{n}"] = mean_at_k([[float(c) for c in p["correct"]] for p in ps])
        m["mean_reward"] = float(sum(sum(p["rewards"]) for p in ps) / (n * len(ps)))
        g = [p["greedy_correct"] for p in ps if p.get("greedy_correct") is not None]
        m["greedy"] = float(sum(g) / len(g)) if g else None
        texts = [p.get("_responses") or p.get("responses") for p in ps]
        if all(t is not None for t in texts):
            for dn in dist_ns:
                m[f"dist-{dn}"] = mean_distinct_n(texts, dn)
        counts = [p["distinct_correct"] for p in ps]
        m["distinct_correct"] = float(sum(counts) / len(counts))
        m["share_ge_3_distinct_correct"] = float(sum(c >= 3 for c in counts) / len(counts))
        if base is not None:
            keys = [(str(p["source"]), str(p["id"])) for p in ps]
            common = [k for k in keys if k in base]
            mine = {(str(p["source"]), str(p["id"])): any(p["correct"][:keep_k]) for p in ps}
            if common:
                keep, explore = keep_explore_rates({k: base[k] for k in common}, mine)
                m["keep_rate"], m["explore_rate"] = _nan_to_none(keep), _nan_to_none(explore)
            else:
                m["keep_rate"] = m["explore_rate"] = None
            m["keep_explore_problems"] = len(common)
        m["reasons"] = dict(Counter(r for p in ps for r in p["reasons"]).most_common(10))
        out[src] = m
    return out
