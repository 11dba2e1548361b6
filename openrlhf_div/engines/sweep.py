"""Methods x seeds on one experiment family, on any engine, then one comparison report
(``examples/scripts/sweep_methods.sh`` runs this module).

    python -m openrlhf_div.engines.sweep FAMILY [--engine local|openrlhf|megatron]
        [--methods "grpo dph_js"] [--seeds "1 2 3"] [--out DIR] [--sampler auto|hf|vllm]
        [--submit] [section.key=value ...] [-- OpenRLHF flags]

* **Runs.** The run of (METHOD, SEED) is ``openrlhf-div run FAMILY_METHOD --engine ENGINE --run-dir
  OUT/runs/METHOD/seedSEED`` with ``SEED`` exported and ``seed=SEED`` (the schema's seed; the seed reaches
  training on every engine, whatever the family file fixes); its ``run_info.json`` must record that
  seed, else the sweep stops. Each run evaluates its initial and final policy on the experiment's
  evaluation data (``eval_step0.json``, ``eval.json``) with the engine's own sampler.
* **Resume.** A finished run has ``sweep_done.json`` and is kept. A run folder without it was
  interrupted: it resumes from its latest checkpoint (``run --resume``), or, with no checkpoint
  yet, its folder is moved to ``OUT/attempts/`` and the run starts again. Killing a sweep and
  starting it again with the same arguments therefore continues it.
* **Progress.** One line before each run: its place in the sweep, the runs done and kept, the time
  so far and the overall ETA (the mean time of the whole runs finished, by this invocation or kept
  from an earlier one, x the runs left; a resumed run's time, only its remainder, is not counted:
  ``sweep_done.json`` says ``resumed`` and its ``seconds`` are this invocation's); the engine prints its own per-step line with the run's ETA.
* **Report.** The base model's evaluation (``OUT/runs/base/eval.json``, ``role: base``) is the first
  run's step-0 evaluation (the same settings, prompts and sampler as every run's; no second engine
  start), and ``openrlhf-div compare OUT/runs/*/seed* --base OUT/runs/base --out
  OUT/report`` writes the report.
* **On a CPU.** Local engine: the vLLM sampler's KV cache is ``rollout.vllm_kv_cache_gb`` (1 GiB), not
  vLLM's 92% of memory; ``--sampler hf`` uses the in-process sampler (no engine start: faster for tiny
  models). Ray engines: OpenRLHF's vLLM engines run on the CPU layer (``compat.cpu_seams``).
  One line says which.

``DRY_RUN=1`` (or ``--dry-run``) prints every command and runs nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

DONE = "sweep_done.json"
BASE = "base"


def say(msg: str) -> None:
    print(f"[sweep] {msg}", file=sys.stderr, flush=True)


def duration(s: float) -> str:
    """``42 s``, ``3 min 05 s``, ``2 h 07 min`` (the progress lines' format)."""
    from openrlhf_div.progress import _duration

    return _duration(s)


def has_checkpoint(run_dir: str) -> bool:
    """A checkpoint to resume from: the local engine's ``checkpoints/step_*``, or OpenRLHF's
    ``ckpt/_actor/latest``."""
    ck = os.path.join(run_dir, "checkpoints")
    if os.path.isdir(ck) and any(n.startswith("step_") for n in os.listdir(ck)):
        return True
    return os.path.isfile(os.path.join(run_dir, "ckpt", "_actor", "latest"))


def status(run_dir: str) -> str:
    """``done`` (kept), ``resume`` (interrupted, with a checkpoint), ``restart`` (interrupted
    before its first checkpoint) or ``new``."""
    if os.path.isfile(os.path.join(run_dir, DONE)):
        return "done"
    if not os.path.isdir(run_dir) or not os.listdir(run_dir):
        return "new"
    return "resume" if has_checkpoint(run_dir) else "restart"


def write_base(run_dir: str, out: str) -> str:
    """``out/eval.json``: the base model's evaluation, from ``run_dir``'s step-0 evaluation (the
    policy before its first step), written with ``role: base`` and no training seed; where it
    came from is kept in ``info``."""
    from openrlhf_div.io import atomic_write_json

    src = os.path.join(run_dir, "eval_step0.json")
    if not os.path.isfile(src):
        raise FileNotFoundError(f"{src}: the run has no step-0 evaluation (its experiment has no evaluation data?); "
                                "the sweep's report needs one")
    with open(src) as fh:
        d = json.load(fh)
    d.update(name=BASE, role="base", seed=None)
    d["info"] = {**(d.get("info") or {}), "source": "sweep: step-0 evaluation of a run (the base model)",
                 "from": os.path.abspath(src)}
    os.makedirs(out, exist_ok=True)
    atomic_write_json(os.path.join(out, "eval.json"), d)
    return out


def _options(argv: Sequence[str]):
    ap = argparse.ArgumentParser(prog="examples/scripts/sweep_methods.sh FAMILY",
                                 description="Methods x seeds on one experiment family, then one comparison report.")
    ap.add_argument("family", help="experiment family: FAMILY_METHOD names an experiment (tiny_cpu, llama8b_bird, ...)")
    ap.add_argument("--engine", choices=("local", "openrlhf", "megatron"), default="openrlhf")
    ap.add_argument("--methods", default="grpo dapo dph_f dph_js", help="space-separated methods")
    ap.add_argument("--seeds", default="1 2 3", help="space-separated seeds")
    ap.add_argument("--out", default=None, help="the sweep's folder (default runs/sweep_FAMILY, runs/sweep_FAMILY_ENGINE "
                                                "for the local and megatron engines)")
    ap.add_argument("--sampler", choices=("auto", "hf", "vllm"), default="auto",
                    help="local engine: rollout.backend (auto: vLLM where it starts, else hf)")
    ap.add_argument("--submit", action="store_true", help="Ray engines: each run as a `ray job submit` job")
    ap.add_argument("--dry-run", action="store_true", help="print every command, run nothing (also DRY_RUN=1)")
    argv = list(argv)
    through: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, through = argv[:cut], argv[cut + 1:]
    a, rest = ap.parse_known_args(argv)
    bad = [x for x in rest if "=" not in x or x.startswith("-")]
    if bad:
        ap.error(f"{bad[0]}: not an option of the sweep (section.key=value overrides reach every run; "
                 "OpenRLHF flags go after `--`)")
    a.overrides, a.through = rest, through
    a.dry_run = a.dry_run or os.environ.get("DRY_RUN") == "1"
    return a


def plan_runs(a) -> Tuple[List[Tuple[str, str, int, str]], str]:
    """``([(method, experiment, seed, run_dir)], out)``; an unknown method names the family's."""
    import glob

    from openrlhf_div.engines import experiment as E

    out = os.path.abspath(a.out or os.path.join("runs", f"sweep_{a.family}" + ("" if a.engine == "openrlhf"
                                                                                 else f"_{a.engine}")))
    runs = []
    methods, seeds = a.methods.split(), [int(s) for s in a.seeds.split()]
    if not methods or not seeds:
        raise ValueError("--methods and --seeds need at least one value each")
    for m in methods:
        name = f"{a.family}_{m}"
        try:
            E.find_experiment(name)
        except Exception:  # noqa: BLE001 - name the family's experiments instead
            have = sorted(os.path.basename(p)[len(a.family) + 1:-5] for sub in ("openrlhf", "megatron")
                          for p in glob.glob(os.path.join(E.ROOT, "configs", sub, f"{a.family}_*.yaml")))
            raise ValueError(f"no experiment {name} (family {a.family} has the methods: {' '.join(have) or 'none'})")
        for s in seeds:
            runs.append((m, name, s, os.path.join(out, "runs", m, f"seed{s}")))
    return runs, out


def run_command(a, experiment: str, seed: int, run_dir: str, resume: bool) -> List[str]:
    cmd = [sys.executable, "-m", "openrlhf_div.cli.main", "run", experiment, "--engine", a.engine,
           "--run-dir", run_dir]
    if resume:
        cmd.append("--resume")
    if a.submit:
        cmd.append("--submit")
    over = [f"seed={seed}"] + list(a.overrides)
    if a.engine == "local" and a.sampler != "auto":
        over.append(f"local.rollout.backend={a.sampler}")
    if not resume or a.engine != "local":  # a local resume reads the run's saved config.yaml
        cmd += over
    if a.through:
        cmd += ["--"] + list(a.through)
    return cmd


def cpu_line(a) -> Optional[str]:
    try:
        import torch

        if torch.cuda.is_available():
            return None
    except ImportError:  # pragma: no cover
        pass
    if a.engine == "local":
        if a.sampler == "hf":
            return "no GPU: the local engine samples with its in-process hf sampler (--sampler hf; no vLLM engine start)"
        return ("no GPU: the local engine's vLLM sampler keeps its KV cache at rollout.vllm_kv_cache_gb (1 GiB of RAM), "
                "not vLLM's default 92% of memory; --sampler hf skips the engine start (faster for tiny models)")
    return ("no GPU: OpenRLHF's vLLM engines and actors run on the CPU layer (logical GPUs; compat.cpu_seams); "
            "the base model's evaluation is each run's step-0 evaluation (no separate vLLM engine)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _options(sys.argv[1:] if argv is None else argv)
    try:
        runs, out = plan_runs(a)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    say(f"{a.family} on the {a.engine} engine: methods {a.methods}, seeds {a.seeds} ({len(runs)} runs) -> {out}")
    line = cpu_line(a)
    if line:
        say(line)
    t0 = time.time()
    took: List[float] = []
    kept = 0
    for i, (method, experiment, seed, run_dir) in enumerate(runs, 1):
        st = status(run_dir)
        if st == "done":
            with open(os.path.join(run_dir, DONE)) as fh:
                done = json.load(fh)
            was = done.get("engine")
            if was != a.engine:
                say(f"error: {run_dir} is a finished run of the {was} engine; give this sweep its own --out")
                return 2
            if not done.get("resumed") and isinstance(done.get("seconds"), (int, float)):
                took.append(float(done["seconds"]))  # a whole run's time: the ETA's measure from the start
            kept += 1
            say(f"run {i}/{len(runs)}: {method} seed {seed} done earlier, kept ({run_dir})")
            continue
        left = len(runs) - i + 1
        eta = f", ETA {duration(sum(took) / len(took) * left)}" if took else ""
        what = {"new": "", "resume": " (interrupted: resuming from its latest checkpoint)",
                "restart": " (interrupted before its first checkpoint: starting again)"}[st]
        say(f"run {i}/{len(runs)}: {method} seed {seed}{what} -> {run_dir} ({i - 1 - kept} done, {kept} kept, "
            f"{duration(time.time() - t0)} so far{eta})")
        if st == "restart" and not a.dry_run:
            dest = os.path.join(out, "attempts", f"{method}_seed{seed}_{time.strftime('%Y%m%d-%H%M%S')}")
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.move(run_dir, dest)
            say(f"the interrupted attempt's files: {dest}")
        cmd = run_command(a, experiment, seed, run_dir, resume=st == "resume")
        env = dict(os.environ, SEED=str(seed), RUN_DIR=run_dir)
        if a.dry_run:
            print(f"SEED={seed} " + " ".join(shlex.quote(c) for c in cmd))
            continue
        start = time.time()
        proc = subprocess.Popen(cmd, env=env)
        try:
            rc = proc.wait()
        except KeyboardInterrupt:  # Ctrl-C reached the run too: it checkpoints and stops; wait for it
            say("interrupted: waiting for the run to stop (the local engine checkpoints its current step)")
            try:
                proc.wait()
            except KeyboardInterrupt:
                proc.kill()
                raise
            say(f"interrupted during {method} seed {seed}; run the same sweep again to continue (finished runs "
                "are kept, this one resumes from its latest checkpoint)")
            return 130
        if rc in (130, -2):  # the run got the Ctrl-C (SIGINT) and stopped after checkpointing
            say(f"interrupted during {method} seed {seed} ({run_dir}); run the same sweep again to continue "
                "(finished runs are kept, this one resumes from its latest checkpoint)")
            return 130
        if rc != 0:
            say(f"error: run {method} seed {seed} failed (exit status {rc}); its folder: {run_dir}. Run the same "
                "sweep again to continue (finished runs are kept, this one resumes)")
            return rc
        info_path = os.path.join(run_dir, "run_info.json")
        recorded = json.load(open(info_path)).get("seed") if os.path.isfile(info_path) else None
        if recorded != seed:
            say(f"error: run {method} seed {seed} trained with seed {recorded} ({info_path}): the experiment does not "
                "take the sweep's seed")
            return 3
        seconds = time.time() - start
        if st != "resume":  # a resumed run's time is only its remainder: not a whole run's, so not the ETA's
            took.append(seconds)
        from openrlhf_div.io import atomic_write_json

        atomic_write_json(os.path.join(run_dir, DONE), {"method": method, "experiment": experiment, "seed": seed,
                                                        "engine": a.engine, "seconds": round(seconds, 1),
                                                        "resumed": st == "resume"})
    dirs = [r[3] for r in runs]
    base = os.path.join(out, "runs", BASE)
    report = os.path.join(out, "report")
    cmp_cmd = [sys.executable, "-m", "openrlhf_div.cli.main", "compare", *dirs, "--base", base, "--out", report]
    if a.dry_run:
        print(f"# the base model's evaluation: {dirs[0]}/eval_step0.json -> {base}/eval.json (role base)")
        print(" ".join(shlex.quote(c) for c in cmp_cmd))
        return 0
    write_base(dirs[0], base)
    say(f"all {len(runs)} runs done in {duration(time.time() - t0)} ({kept} kept); comparison report -> {report}")
    return subprocess.call(cmp_cmd)


if __name__ == "__main__":
    raise SystemExit(main())
