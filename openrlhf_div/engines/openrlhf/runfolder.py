"""The Ray path's run folder holds what a local run's holds (issue 30), so that ``compare`` and
``report`` read both:

* ``config.yaml`` -- the experiment config as resolved (``extends`` followed, variables expanded)
  and the final command (:func:`write_driver_files`, by the driver before ``train()``);
* ``run_info.json`` -- engine, experiment, seed, ``settings`` (what reaches training,
  :func:`openrlhf_div.engines.provenance.settings_of`), method, versions, machine, GPUs the plan needs, time
  (``run_info.resume_<time>.json`` when a run folder is reused);
* ``metrics.jsonl`` -- one row per step: ``step`` and every figure OpenRLHF logs (the trainer,
  :meth:`RunFolder.log_step`); cut back to the restored step on resume;
* ``eval.jsonl`` / ``eval.json`` / ``results.md`` / ``samples.jsonl`` -- the project's one
  evaluation (:func:`openrlhf_div.eval.evaluate.evaluate`) on ``--eval.dataset`` with the trainer's
  own vLLM engines, before the first step (also kept as ``eval_step0.json``, what ``compare``
  uses as the base) and after the last; the same files and format as the local engine;
* ``model/`` (``--ckpt.output_dir``), ``ckpt/``, ``tb/`` -- OpenRLHF's own.

The folder is ``RUN_DIR`` (the launcher gives every run a new one) or, without it, the parent of
``--ckpt.output_dir``.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Dict, List, Mapping, Optional

CONFIG_FILE = "config.yaml"
RUN_INFO = "run_info.json"
METRICS = "metrics.jsonl"
#: the named cause of a failed run, one line (the driver's last line); the launcher repeats it last
ERROR_FILE = "error.txt"
EVAL_LOG = "eval.jsonl"
EVAL_STEP0 = "eval_step0.json"


def run_dir_of(args, environ: Optional[Mapping[str, str]] = None) -> str:
    environ = os.environ if environ is None else environ
    if environ.get("RUN_DIR"):
        return os.path.abspath(environ["RUN_DIR"])
    return os.path.dirname(os.path.abspath(args.ckpt.output_dir))


def write_driver_files(p, cfg: Mapping[str, Any]) -> str:
    """``config.yaml`` and ``run_info.json`` of a Ray run (the driver, before ``train()``)."""
    import yaml

    from openrlhf_div.config import expand_tree
    from openrlhf_div.io import atomic_write_json, atomic_write_text

    from ..runinfo import machine, versions
    from ..flags import div_namespace

    run_dir = run_dir_of(p.args)
    os.makedirs(run_dir, exist_ok=True)
    for stale in (ERROR_FILE, "INCOMPLETE"):  # an earlier attempt's cause / stop (this run folder resumed) is not this run's
        try:
            os.remove(os.path.join(run_dir, stale))
        except FileNotFoundError:
            pass
    resolved = {"config": p.config, "experiment": cfg.get("experiment"), "engine": "openrlhf",
                **{k: v for k, v in expand_tree(dict(cfg)).items() if k != "experiment"}, "command": p.command}
    atomic_write_text(os.path.join(run_dir, CONFIG_FILE), yaml.safe_dump(resolved, sort_keys=False))
    info = {"engine": "openrlhf", "method": p.method.describe(), "task": getattr(div_namespace(p.args), "task", None),
            "experiment": cfg.get("experiment"), "config": p.config, "seed": p.args.train.seed,
            "gpus_needed": dict(p.gpus), "cpu_path": os.environ.get("OPENRLHF_DIV_CPU_SEAMS") == "1",
            "versions": versions(), "machine": machine(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "resume": bool(getattr(p.args.ckpt, "load_enable", False)),
            # the engine is OpenRLHF's Ray topology; its policy actor DeepSpeed or Megatron-core
            "actor_backend": getattr(div_namespace(p.args), "actor_backend", None) or "deepspeed"}
    from openrlhf_div.engines.provenance import settings_of

    # what reaches training (OpenRLHF's parsed flags, defaults included), the keys every engine records
    info["settings"] = settings_of(p, cfg)
    from openrlhf_div.engines.local.runlog import git_commit

    info["git_commit"] = git_commit()
    name = RUN_INFO
    if os.path.exists(os.path.join(run_dir, RUN_INFO)):
        name = f"run_info.resume_{time.strftime('%Y%m%d-%H%M%S')}.json"
    atomic_write_json(os.path.join(run_dir, name), info, default=str)
    return run_dir


def record_failure(args, line: str) -> None:
    """``error.txt`` in the run folder: the line that names why the run failed (kept with its
    checkpoints and metrics; ``examples/scripts/run.sh`` ends with it). Never raises."""
    try:
        from openrlhf_div.io import atomic_write_text

        atomic_write_text(os.path.join(run_dir_of(args), ERROR_FILE), line.rstrip("\n") + "\n")
    except Exception:  # noqa: BLE001 - the run is already failing; its line still reaches the log
        pass


def _number(v) -> Optional[float]:
    try:
        import torch

        if isinstance(v, torch.Tensor):
            v = v.float().mean().item() if v.numel() else None
    except ImportError:
        pass
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


class RunFolder:
    """The trainer's side of the run folder (``metrics.jsonl``, the evaluations)."""

    def __init__(self, args):
        self.dir = run_dir_of(args)
        os.makedirs(self.dir, exist_ok=True)

    def _rows(self, fname: str) -> List[Dict[str, Any]]:
        path = os.path.join(self.dir, fname)
        if not os.path.exists(path):
            return []
        out = []
        with open(path) as fh:
            for line in fh:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue  # a torn last line of a crashed run
        return out

    def append(self, fname: str, row: Mapping[str, Any]) -> None:
        with open(os.path.join(self.dir, fname), "a") as fh:
            fh.write(json.dumps(dict(row), default=float) + "\n")

    def truncate(self, step: int) -> None:
        """Drop the rows logged after ``step`` (a resumed run redoes those steps)."""
        from openrlhf_div.io import atomic_write_text

        for fname in (METRICS, EVAL_LOG):
            rows = self._rows(fname)
            keep = [r for r in rows if int(r.get("step", 0)) <= step]
            if len(keep) != len(rows):
                atomic_write_text(os.path.join(self.dir, fname), "".join(json.dumps(r) + "\n" for r in keep))

    def log_step(self, step: int, logs: Mapping[str, Any]) -> None:
        row: Dict[str, Any] = {"step": int(step)}
        for k, v in (logs or {}).items():
            x = _number(v)
            if x is not None:
                row[k] = x
        row["time"] = time.time()
        self.append(METRICS, row)


def vllm_generate_fn(engines, tokenizer, seed: int):
    """``generate_fn`` of :func:`openrlhf_div.eval.evaluate.evaluate` on OpenRLHF's vLLM engine
    actors (the trainer's own, holding the policy's current weights): prompts spread over the
    engines, one seeded request per prompt."""
    import ray
    from vllm import SamplingParams

    def fn(prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=512, greedy=False):
        # one request per sample (n=1 each, its own seed), as OpenRLHF's rollouts do: AsyncLLM's
        # streamed outputs of an n>1 request need not carry all n completions in its last one
        refs = []
        for i, prompt in enumerate(prompts):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            for j in range(n):
                sp = SamplingParams(n=1, temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p,
                                    max_tokens=max_new_tokens, seed=seed + i * n + j)
                refs.append(engines[(i * n + j) % len(engines)].generate.remote(ids, sp))
        outs = ray.get(refs)
        texts = [out.outputs[0].text for out in outs]
        return [texts[i * n:(i + 1) * n] for i in range(len(prompts))]

    return fn


def task_env_options(task: str) -> Dict[str, Any]:
    """The task options the reward-function file of ``task`` reads from the environment
    (``OPENRLHF_DIV_MATH_EXTRACT`` ...), so that the evaluation grades as the rewards do."""
    import importlib

    from openrlhf_div.tasks.reward_funcs._common import env_options

    try:
        mod = importlib.import_module(f"openrlhf_div.tasks.reward_funcs.{task}")
    except ImportError:
        return {}
    return env_options(getattr(mod, "_ENV", {}))


def evaluate_with_engines(trainer, step: int) -> Optional[Dict[str, Any]]:
    """The project's evaluation of the policy the vLLM engines hold (``--eval.dataset``, ``n =
    --eval.n_samples_per_prompt``, ``--eval.temperature``, ``--div.eval_top_p`` or the rollout's
    top-p, the rollout's ``max_new_tokens``): ``eval.json`` (+ samples, table), a row of
    ``eval.jsonl``; at step 0 also ``eval_step0.json``. None without ``--eval.dataset``."""
    import shutil

    from openrlhf_div.engines.local.evaluation import EVAL_SEED_OFFSET, eval_row
    from openrlhf_div.eval.evaluate import evaluate
    from openrlhf_div.eval.results import EVAL_FILE, write_eval
    from openrlhf_div.tasks import get_task
    from openrlhf_div.tasks.datasets import load_examples

    from ..flags import div_namespace, method_from_args
    from .evaluate import renderer

    args = trainer.args
    if not getattr(args.eval, "dataset", None) or not trainer.vllm_engines:
        return None
    folder = RunFolder(args)
    div = div_namespace(args)
    key_in, key_label = args.data.input_key, args.data.label_key
    # the project's one data loader (the local engine's): same ids, sources and data hash, so
    # `compare` puts a Ray run and a local run on the same problems side by side
    examples, _ = load_examples(args.eval.dataset, div.task, prompt_field=key_in, label_field=key_label)
    task = get_task(div.task, **task_env_options(div.task))  # graded as the rewards are (reward_funcs)
    render = renderer(trainer.tokenizer, bool(getattr(args.data, "apply_chat_template", False)))

    n = int(args.eval.n_samples_per_prompt)
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n]
    if n not in ks:
        ks.append(n)
    top_p = div.eval_top_p if getattr(div, "eval_top_p", None) is not None else args.rollout.top_p
    gen = vllm_generate_fn(trainer.vllm_engines, trainer.tokenizer, int(args.train.seed) + EVAL_SEED_OFFSET)
    sleep = bool(getattr(args.vllm, "enable_sleep", False))  # engines asleep between rollouts: wake them
    if sleep:
        from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call

        batch_vllm_engine_call(trainer.vllm_engines, "wake_up")
    try:
        res = evaluate(task, examples, gen, n=n, ks=ks, temperature=float(args.eval.temperature), top_p=float(top_p),
                       max_new_tokens=int(args.rollout.max_new_tokens), keep_k=min(8, n), render=render,
                       batch_size=max(1, len(examples)), progress=False)
    finally:
        if sleep:
            batch_vllm_engine_call(trainer.vllm_engines, "sleep")
    method = method_from_args(args)
    write_eval(folder.dir, res, name=method.name, role="method", seed=int(args.train.seed),
               info={"source": "train", "step": int(step), "engine": "openrlhf"},
               model=args.actor.model_name_or_path if step == 0 else os.path.abspath(args.ckpt.output_dir),
               engine="openrlhf", data_paths=[args.eval.dataset])
    if step == 0:
        shutil.copyfile(os.path.join(folder.dir, EVAL_FILE), os.path.join(folder.dir, EVAL_STEP0))
    row = eval_row(step, res)
    folder.append(EVAL_LOG, row)
    return row
