"""Evaluate a checkpoint at scale: vLLM samples ``n`` responses per problem, the task scores
them, and ``RUN_DIR/eval.json`` is written for ``openrlhf-div compare``.

    python -m openrlhf_div.engines.openrlhf.evaluate --model RUN_DIR/model --task sql \\
        --data data/bird/dev.jsonl --n 16 --temperature 1.0 --top-p 0.95 --max-new-tokens 4096 \\
        --tp 1 --name dph_js --role method --seed 1 --out RUN_DIR

The per-problem records (``id``, ``source``, ``correct``, ``responses``) and the metric dict
come from :mod:`openrlhf_div.eval.results` (``model_metrics`` / ``write_eval_json``), the same
format the demo writes, so one report covers both engines. Scoring (:func:`score_problems`)
is a pure function of the texts; only :func:`sample` needs vLLM and a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence


def load_examples(path: str, input_key: str = "prompt", label_key: str = "label") -> List[Dict[str, Any]]:
    rows = []
    with open(path) as fh:
        for i, line in enumerate(fh, 1):
            if line.strip():
                d = json.loads(line)
                if input_key not in d:
                    raise ValueError(f"{path}:{i}: no {input_key!r} field (set --input-key)")
                rows.append(d)
    if not rows:
        raise ValueError(f"{path}: no evaluation examples")
    return rows


def score_problems(task, examples: Sequence[Dict[str, Any]], responses: Sequence[Sequence[str]],
                   label_key: str = "label", keep_texts: bool = True) -> List[Dict[str, Any]]:
    """Per-problem records for :func:`openrlhf_div.eval.results.model_metrics`."""
    out = []
    for i, (ex, texts) in enumerate(zip(examples, responses)):
        results = [task.reward_result(t, ex.get(label_key)) for t in texts]
        rec = {"id": str(ex.get("id", i)), "source": ex.get("source", ex.get("datasource", "default")),
               "correct": [int(bool(r.correct)) for r in results]}
        styles = [r.info.get("style") for r in results]
        if any(s is not None for s in styles):
            rec["styles"] = styles
        if keep_texts:
            rec["responses"] = list(texts)
        out.append(rec)
    return out


def sample(model: str, prompts: Sequence[str], n: int, temperature: float, top_p: float, max_new_tokens: int,
           tp: int, seed: int) -> List[List[str]]:  # pragma: no cover - needs vLLM and a GPU
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, tensor_parallel_size=tp, seed=seed, trust_remote_code=True)
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=seed)
    outs = llm.generate(list(prompts), params)
    return [[c.text for c in o.outputs] for o in outs]


def render_prompts(model: str, examples, input_key: str, chat: bool) -> List[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
    out = []
    for ex in examples:
        p = ex[input_key]
        if chat:
            msgs = p if isinstance(p, list) else [{"role": "user", "content": p}]
            p = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        out.append(p)
    return out


def defaults_from_config(path: str) -> Dict[str, Any]:
    """Evaluation settings implied by an experiment config (its eval.* and rollout.* flags)."""
    from .launch import expand_env, load_config

    cfg = load_config(path)
    o, d = cfg.get("openrlhf") or {}, cfg.get("div") or {}
    val = lambda k, default=None: expand_env(str(o[k])) if o.get(k) is not None else default  # noqa: E731
    out = {"task": d.get("task"), "data": val("eval.dataset"), "model": val("actor.model_name_or_path"),
           "n": int(val("eval.n_samples_per_prompt", 16)), "temperature": float(val("eval.temperature", 1.0)),
           "top_p": float(val("rollout.top_p", 1.0)), "max_new_tokens": int(val("rollout.max_new_tokens", 2048)),
           "tp": int(val("vllm.tensor_parallel_size", 1)), "input_key": val("data.input_key", "prompt"),
           "label_key": val("data.label_key", "label"),
           "no_chat_template": not bool(o.get("data.apply_chat_template", False))}
    return {k: v for k, v in out.items() if v is not None}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m openrlhf_div.engines.openrlhf.evaluate",
                                 description="vLLM evaluation of a checkpoint into RUN_DIR/eval.json")
    ap.add_argument("--config", default=None, help="experiment config supplying the defaults below")
    ap.add_argument("--model", default=None, help="HF checkpoint directory or hub name")
    ap.add_argument("--task", default=None, help="task name (openrlhf_div.tasks)")
    ap.add_argument("--data", default=None, help="evaluation JSONL")
    ap.add_argument("--out", required=True, help="run directory to write eval.json into")
    ap.add_argument("--name", required=True, help="method name shown in the report")
    ap.add_argument("--role", default="method", choices=["base", "method"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=16, help="samples per problem")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--tp", type=int, default=1, help="vLLM tensor parallel size")
    ap.add_argument("--input-key", default="prompt")
    ap.add_argument("--label-key", default="label")
    ap.add_argument("--no-chat-template", action="store_true")
    ap.add_argument("--base-eval", default=None, help="the base model's eval.json (keep/explore rates)")
    ap.add_argument("--dry-run", action="store_true", help="print the resolved settings and exit")
    argv = list(sys.argv[1:] if argv is None else argv)
    pre, _ = ap.parse_known_args(argv)
    if pre.config:
        ap.set_defaults(**defaults_from_config(pre.config))
    a = ap.parse_args(argv)
    missing = [k for k in ("model", "task", "data") if getattr(a, k) is None]
    if missing:
        ap.error("missing " + ", ".join(f"--{k}" for k in missing) + " (or a --config that sets them)")
    if a.dry_run:
        print(json.dumps(vars(a), indent=2))
        return 0
    try:
        from openrlhf_div.eval import results as R
        from openrlhf_div.tasks import get_task
    except ImportError as exc:  # pragma: no cover
        print(f"error: {exc}", file=sys.stderr)
        return 2
    task = get_task(a.task)
    examples = load_examples(a.data, a.input_key, a.label_key)
    prompts = render_prompts(a.model, examples, a.input_key, not a.no_chat_template)
    texts = sample(a.model, prompts, a.n, a.temperature, a.top_p, a.max_new_tokens, a.tp, a.seed)
    problems = score_problems(task, examples, texts, a.label_key)
    base = None
    if a.base_eval:
        with open(a.base_eval) as fh:
            base = json.load(fh)["problems"]
    metrics = R.model_metrics(problems, base=base, is_base=a.role == "base")
    os.makedirs(a.out, exist_ok=True)
    path = R.write_eval_json(a.out, task=a.task, name=a.name, role=a.role, metrics=metrics, problems=problems,
                             seed=a.seed, settings={k: v for k, v in vars(a).items() if k != "out"})
    print(f"wrote {path}: pass@1 {metrics.get('pass@1')}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
