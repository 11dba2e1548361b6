"""Evaluate a checkpoint at scale: vLLM samples ``n`` responses per problem, the task scores
them, and ``RUN_DIR/eval.json`` is written for ``openrlhf-div compare``.

    python -m openrlhf_div.engines.openrlhf.evaluate --model RUN_DIR/model --task sql \\
        --data data/bird/dev.jsonl --n 16 --temperature 1.0 --top-p 0.95 --max-new-tokens 4096 \\
        --tp 1 --name dph_js --role trained --seed 1 --out RUN_DIR

This is the project's one evaluation (:func:`openrlhf_div.eval.evaluate.evaluate`) with vLLM as
the generate function (:func:`openrlhf_div.engines.local.samplers.generate_vllm`) and OpenRLHF's prompt
convention (``input_key``, the tokenizer's chat template) as the renderer; the result is written
by :func:`openrlhf_div.eval.results.write_eval`, the same ``eval.json`` every engine and the demo
write, so one report covers them all. Only :func:`make_vllm_generate_fn` needs vLLM and a GPU.
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


def normalize_examples(examples: Sequence[Dict[str, Any]], input_key: str = "prompt",
                       label_key: str = "label") -> List[Dict[str, Any]]:
    """Rows of the evaluation JSONL as ``{id, source, prompt, label}`` (``id``: the row's, else
    its index; ``source``: ``source`` or ``datasource``, else ``"default"``)."""
    return [{"id": str(ex.get("id", i)), "source": str(ex.get("source", ex.get("datasource", "default"))),
             "prompt": ex[input_key], "label": ex.get(label_key)} for i, ex in enumerate(examples)]


def make_vllm_generate_fn(model: str, tp: int, seed: int):  # pragma: no cover - needs vLLM and a GPU
    from vllm import LLM

    from openrlhf_div.engines.local.samplers import generate_vllm

    kw = {}
    if not _cuda():  # vLLM's CPU engine would take 92% of RAM for its KV cache (gpu_memory_utilization)
        gb = float(os.environ.get("OPENRLHF_DIV_VLLM_CPU_KV_CACHE_GB", "1"))
        kw["kv_cache_memory_bytes"] = int(gb * 2**30)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        print(f"[openrlhf-div] vLLM on a CPU: KV cache {gb:g} GiB of RAM (OPENRLHF_DIV_VLLM_CPU_KV_CACHE_GB), not vLLM's "
              "default 92% of memory", file=sys.stderr, flush=True)
    llm = LLM(model=model, tensor_parallel_size=tp, seed=seed, trust_remote_code=True, **kw)

    def fn(prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=512, greedy=False):
        return generate_vllm(llm, prompts, n, temperature, top_p, max_new_tokens, greedy, seed=seed)

    return fn


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:  # pragma: no cover
        return False


def make_renderer(model: str, chat: bool):
    """``render(example) -> str``: the prompt as is, or through the model's chat template."""
    from transformers import AutoTokenizer

    return renderer(AutoTokenizer.from_pretrained(model, trust_remote_code=True) if chat else None, chat)


def renderer(tok, chat: bool):
    """:func:`make_renderer` for a tokenizer at hand (``tok`` may be None when ``chat`` is off)."""

    def render(ex):
        p = ex["prompt"]
        if chat:
            msgs = p if isinstance(p, list) else [{"role": "user", "content": p}]
            return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return p if isinstance(p, str) else "\n\n".join(m["content"] for m in p) + "\n"

    return render


def run_evaluation(task, examples: Sequence[Dict[str, Any]], generate_fn, render, *, out: str, name: str,
                   role: str = "method", seed: int = 0, n: int = 16, temperature: float = 1.0, top_p: float = 1.0,
                   max_new_tokens: int = 2048, base_eval: Optional[str] = None, allow_mismatch: bool = False,
                   model: Optional[str] = None, data: Optional[str] = None, greedy: bool = False) -> Dict[str, str]:
    """Evaluate and write ``out/eval.json`` (+ samples, table); ``base_eval``: the base's
    eval.json for keep / explore (its settings must match unless ``allow_mismatch``)."""
    from openrlhf_div.eval.evaluate import evaluate
    from openrlhf_div.eval.results import check_settings, read_eval_json, write_eval

    base = read_eval_json(base_eval) if base_eval else None
    res = evaluate(task, examples, generate_fn, n=n, ks=[k for k in (1, 8, 16) if k <= n], greedy=greedy,
                   temperature=temperature,
                   top_p=top_p, max_new_tokens=max_new_tokens, keep_k=min(8, n), base_results=base,
                   is_base=role == "base", render=render, batch_size=max(1, len(examples)))
    mismatch = check_settings([("base", base["settings"]), (name, res["settings"])], allow_mismatch,
                              what="--base-eval") if base else []
    return write_eval(out, res, name=name, role=role, seed=seed, model=model, engine="vllm", data_paths=[data],
                      info={"source": "openrlhf.evaluate", "base_eval": base_eval, "settings_mismatch": mismatch})


def defaults_from_config(path: str) -> Dict[str, Any]:
    """Evaluation settings implied by an experiment config (its eval.* and rollout.* flags)."""
    from openrlhf_div.config import expand_env, load_experiment as load_config

    cfg = load_config(path)
    o, d = cfg.get("openrlhf") or {}, cfg.get("div") or {}
    val = lambda k, default=None: expand_env(str(o[k])) if o.get(k) is not None else default  # noqa: E731
    out = {"task": cfg.get("task") or d.get("task"), "data": val("eval.dataset"), "model": val("actor.model_name_or_path"),
           "n": int(val("eval.n_samples_per_prompt", 16)), "temperature": float(val("eval.temperature", 1.0)),
           "top_p": float(d["eval_top_p"] if d.get("eval_top_p") is not None else val("rollout.top_p", 1.0)), "max_new_tokens": int(val("rollout.max_new_tokens", 2048)),
           "tp": int(val("vllm.tensor_parallel_size", 1)), "input_key": val("data.input_key", "prompt"),
           "label_key": val("data.label_key", "label"),
           "no_chat_template": not bool(o.get("data.apply_chat_template", False)),
           "greedy": None if d.get("eval_greedy") is None else bool(d["eval_greedy"])}
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
    ap.add_argument("--role", default="trained", choices=["base", "trained", "method"],
                    help="base (the model before RL) or trained (method: the older spelling)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=16, help="samples per problem")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--tp", type=int, default=1, help="vLLM tensor parallel size")
    ap.add_argument("--input-key", default="prompt")
    ap.add_argument("--label-key", default="label")
    ap.add_argument("--no-chat-template", action="store_true")
    ap.add_argument("--greedy", action=argparse.BooleanOptionalAction, default=False,
                    help="also score one greedy (temperature 0) response per problem: the report's greedy column "
                         "(default: the config's div.eval_greedy)")
    ap.add_argument("--base-eval", default=None, help="the base model's eval.json (keep/explore rates)")
    ap.add_argument("--allow-mismatch", action="store_true",
                    help="use --base-eval even when its evaluation settings differ (recorded in eval.json)")
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
    from openrlhf_div.tasks import get_task
    task = get_task(a.task)
    examples = normalize_examples(load_examples(a.data, a.input_key, a.label_key))
    paths = run_evaluation(task, examples, make_vllm_generate_fn(a.model, a.tp, a.seed),
                           make_renderer(a.model, not a.no_chat_template), out=a.out, name=a.name, role=a.role,
                           seed=a.seed, n=a.n, temperature=a.temperature, top_p=a.top_p,
                           max_new_tokens=a.max_new_tokens, base_eval=a.base_eval, allow_mismatch=a.allow_mismatch,
                           model=a.model, data=a.data, greedy=a.greedy)
    print(f"wrote {paths['json']}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
