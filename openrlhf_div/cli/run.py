"""``openrlhf-div run EXPERIMENT``: one experiment file on any engine.

    openrlhf-div run tiny_cpu_dph_js --engine local --toy                 # seconds, on a CPU
    openrlhf-div run tiny_cpu_dph_js --engine local                       # the file itself, on the local engine
    openrlhf-div run tiny_cpu_dph_js --engine local --run-dir DIR --resume   # continue from its checkpoint
    openrlhf-div run llama8b_bird_dph_js --engine local --toy method.anchor_eta=0.1
    openrlhf-div run tiny_cpu_dph_js --engine openrlhf                    # a local Ray head
    openrlhf-div run llama8b_bird_dph_js --submit -- --ckpt.load_enable   # ray job submit

``section.key=value`` overrides mean the same on every engine (``method.anchor_eta=0.1``,
``layout.step_layout=spread``, ``openrlhf.train.batch_size=64``): the Ray drivers get them as
written and merge them with the one loader, and a method value is converted once
(``coerce_hparam``); OpenRLHF's own flags pass through after ``--`` to the Ray engines. What an engine cannot honour is refused by name before
anything starts (:mod:`openrlhf_div.engines.experiment`). Without ``--toy`` the local engine runs
everything the file says that reaches training on Ray (grading options of its ``env:``, the
rollout steps, the evaluation, the prompt rendering, the seed; :func:`~openrlhf_div.engines.experiment.to_local`)
in a new ``runs/<experiment>/<timestamp>``, as the Ray launcher does, and every engine records
the run's seed and ``settings`` in ``run_info.json`` (:mod:`openrlhf_div.engines.provenance`).
"""
from __future__ import annotations

import os
import subprocess
import sys


def _options():
    import argparse

    p = argparse.ArgumentParser(prog="openrlhf-div run EXPERIMENT", add_help=False)
    p.add_argument("--engine", choices=("local", "openrlhf", "megatron"), default=None,
                   help="local (one process), openrlhf (Ray: vLLM + DeepSpeed) or megatron (Ray, Megatron-core "
                        "actor); default: the file's (div.actor_backend megatron: megatron, else openrlhf)")
    p.add_argument("--submit", action="store_true", help="Ray engines: one `ray job submit` job to RAY_ADDRESS")
    p.add_argument("--toy", action="store_true",
                   help="the file's toy: overlay (tiny model, a handful of prompts, a few steps) on the local engine; "
                        "the Ray engines' toys are the tiny_cpu_* experiments (--toy there is refused, naming them)")
    p.add_argument("--run-dir", default=None, help="the run folder (default: RUN_DIR, else a new "
                                                   "runs/<experiment>[_toy]/<timestamp> on every engine)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir (or RUN_DIR) from its latest checkpoint: the local engine's "
                        "checkpoints/ (its saved config.yaml), on Ray --ckpt.load_enable")
    p.add_argument("--dry-run", action="store_true", help="print what would run and exit")
    return p


def _options_help() -> str:
    """The options' help without their usage lines (which wrap to a second line on narrow terminals)."""
    text = _options().format_help()
    return "run options:" + text[text.index("\noptions:") + len("\noptions:"):] if "\noptions:" in text else text


def add_parser(sub):
    import argparse

    p = sub.add_parser("run", help="run one experiment file on any engine (local, openrlhf, megatron)",
                       description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=_options_help()
                       + "\nsection.key=value overrides follow; after `--`, OpenRLHF flags pass through to the Ray engines.")
    p.add_argument("experiment", help="an experiment's name (configs/openrlhf|megatron/NAME.yaml) or a path")
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="[options] [key=value ...] [-- flags]")
    p.set_defaults(func=run)
    return p


def _split(items):
    """``(options, overrides, pass-through flags)`` of what follows the experiment's name."""
    items = list(items)
    through: list = []
    if "--" in items:
        cut = items.index("--")
        items, through = items[:cut], items[cut + 1:]
    opts, rest = _options().parse_known_args(items)
    overrides = []
    for i, a in enumerate(rest):
        if a.startswith("--"):
            raise ValueError(f"{a}: not an option of `run`; OpenRLHF flags go after `--`")
        overrides.append(a)
    passthrough = through
    bad = [a for a in overrides if "=" not in a]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a section.key=value override (OpenRLHF flags go after `--`)")
    return opts, overrides, passthrough


def run(args) -> int:
    from openrlhf_div.engines import experiment as E

    path = E.find_experiment(args.experiment)
    name = os.path.splitext(os.path.basename(path))[0]
    opts, overrides, passthrough = _split(args.rest)
    for k, v in vars(opts).items():
        setattr(args, k, v)
    from openrlhf_div.engines.openrlhf import presample  # noqa: F401 - the Ray drivers' flags judge openrlhf./div. overrides

    cfg = E.load(path, overrides, toy=args.toy)
    backend = str((cfg.get("div") or {}).get("actor_backend") or "deepspeed")
    engine = args.engine or ("megatron" if backend == "megatron" else "openrlhf")
    if engine == "local":
        saved = dict(os.environ)
        try:
            return _run_local(cfg, name, args, passthrough)
        finally:  # the launcher's variables it set (DATA_DIR, ...) are this run's, not the next one's in this process
            os.environ.clear()
            os.environ.update(saved)
    run_dir = os.path.abspath(args.run_dir) if args.run_dir else None  # None: the launcher's new folder
    return _run_ray(path, cfg, engine, backend, run_dir, args, overrides, passthrough)


def local_environment(cfg, name: str, toy: bool, run_dir=None, environ=None):
    """``(run folder, variables)`` of a local run, as the Ray launcher sets them up
    (:func:`openrlhf_div.engines.openrlhf.prepare.exports`): a new ``runs/<experiment>/<timestamp>``
    (``runs/<experiment>_toy/...`` with --toy) unless ``run_dir`` or ``RUN_DIR`` names one, the
    config's path variables' relative defaults under the repository, its ``env:`` section."""
    from openrlhf_div.engines import experiment as E
    from openrlhf_div.engines.openrlhf.prepare import exports, run_dir_default

    environ = dict(os.environ if environ is None else environ)
    experiment = str(cfg.get("experiment") or name)
    if run_dir:
        environ["RUN_DIR"] = os.path.abspath(run_dir)
    elif not environ.get("RUN_DIR"):
        environ["RUN_DIR"] = run_dir_default(E.ROOT, experiment + ("_toy" if toy else ""))
    out = exports(cfg, E.ROOT, experiment, environ)
    out["RUN_DIR"] = os.path.abspath(environ["RUN_DIR"])
    return out["RUN_DIR"], out


def _run_local(cfg, name, args, passthrough) -> int:
    from openrlhf_div.engines import experiment as E
    from openrlhf_div.engines.local.config import config_from_dict, dump_config

    if args.submit:
        raise ValueError("--submit: the local engine runs in this process; submit with --engine openrlhf|megatron")
    if passthrough:
        raise ValueError(f"{passthrough[0]}: an OpenRLHF flag, which the local engine does not read (use "
                         "section.key=value overrides, or --engine openrlhf)")
    if args.resume:
        return _resume_local(args)
    run_dir, env = local_environment(cfg, name, args.toy, args.run_dir)
    for k, v in env.items():  # the launcher's variables: ${DATA_DIR:-...} etc. expand as on Ray
        if k != "RUN_DIR":
            os.environ.setdefault(k, v)
    if cfg.get("tiny") and not args.toy and not args.dry_run:  # the tiny model and data, built on first use
        from openrlhf_div.engines.openrlhf.prepare import ensure_tiny

        ensure_tiny(cfg, dict(os.environ), E.ROOT, say=lambda m: print(f"openrlhf-div run: {m}", file=sys.stderr))
    data, notes = E.to_local(cfg, run_dir=run_dir, toy=args.toy)
    pending = data.pop(E.PENDING_STEPS, None)
    scripts = data.pop("toy_sql_scripts", None)
    if pending:  # steps counted over D_exp after pre-sampling; a placeholder validates the rest
        tc = config_from_dict(E.apply_steps(__import__("copy").deepcopy(data), pending, pending["prompts_per_step"]))
    else:
        tc = config_from_dict(data)
    method = tc.build_method()
    if args.toy and method.needs.anchor_batch and scripts and not (tc.data.presample_dir or tc.data.anchor):
        raise ValueError(f"--toy: method {method.name} trains on D_pef anchors, and the tiny random model of the SQL "
                         "toy writes no correct SQL, so pre-sampling would find none; run the anchor toy on a math "
                         "experiment, or give local.data.presample_dir=DIR (a D_pef of your own)")
    if scripts and not args.dry_run:  # the toy SQL databases: {db_id}/{db_id}.sqlite from the fixtures' scripts
        data.setdefault("task_options", {})["db_root"] = E.build_sql_databases(scripts, os.path.join(run_dir, "dbs"))
        tc = config_from_dict(data) if not pending else tc
    for n in notes:
        print(f"openrlhf-div run: {n}", file=sys.stderr)
    print(f"openrlhf-div run: {name} on the local engine: method {method.name} ({method.estimator} advantages, "
          f"{method.aggregation}), hyperparameters set: "
          + (", ".join(f"{k}={v}" for k, v in sorted(tc.method.items()) if k != "name") or "none"), file=sys.stderr)
    if pending:
        print("openrlhf-div run: the number of rollout steps is counted over D_exp once pre-sampling has cut it "
              f"(train.num_episodes {pending['episodes']} x its prompts / {pending['prompts_per_step']})",
              file=sys.stderr)
    if args.dry_run:
        sys.stdout.write(dump_config(tc))
        return 0
    print(f"openrlhf-div run: run folder {run_dir}", file=sys.stderr)
    from openrlhf_div.engines.local.presample import format_summary, presample
    from openrlhf_div.engines.local.trainer import train

    if method.needs.anchor_batch and not tc.data.anchor:
        # the pre-sampling stage, as on Ray: into the experiment's data.presample_dir (the folder training
        # reads) when it holds no D_pef yet, or into the run folder (--toy, or no folder named)
        pre_dir = tc.data.presample_dir or os.path.join(run_dir, "presample")
        if not os.path.isfile(os.path.join(pre_dir, "d_pef.jsonl")):
            print(f"openrlhf-div run: pre-sampling D_pef / D_exp into {pre_dir}", file=sys.stderr)
            hint = (f"remove {pre_dir}, or give another --run-dir" if not tc.data.presample_dir else
                    f"remove {pre_dir}, or name another folder: data.presample_dir=DIR")
            summary = presample(tc, pre_dir, overwrite=False, progress=False, hint=hint)
            print(format_summary(summary), file=sys.stderr)
        data.setdefault("data", {})["presample_dir"] = pre_dir
        if pending:
            from openrlhf_div.engines.provenance import count_prompts

            n = count_prompts(os.path.join(pre_dir, "d_exp.jsonl")) or 0
            if n == 0:
                raise ValueError(f"pre-sampling left D_exp empty ({pre_dir}/d_exp.jsonl): no prompt to train on")
            E.apply_steps(data, pending, n)
        tc = config_from_dict(data)
    result = train(cfg=tc)
    print(f"done: {result['run_dir']}")
    return 0


def _resume_dir(args) -> str:
    d = args.run_dir or os.environ.get("RUN_DIR")
    if not d:
        raise ValueError("--resume: name the run folder to continue with --run-dir DIR (or RUN_DIR=DIR)")
    return os.path.abspath(d)


def _resume_local(args) -> int:
    """The local run in ``--run-dir`` from its latest checkpoint, with the config it saved."""
    run_dir = _resume_dir(args)
    if not os.path.isfile(os.path.join(run_dir, "config.yaml")):
        raise ValueError(f"--resume: {run_dir} holds no config.yaml (not a local run folder); start it without --resume")
    print(f"openrlhf-div run: resuming {run_dir} from its latest checkpoint", file=sys.stderr)
    if args.dry_run:
        return 0
    from openrlhf_div.engines.local.trainer import train

    result = train(resume=run_dir)
    print(f"done: {result['run_dir']}")
    return 0


def toy_on_ray_refusal(name: str, cfg, engine: str) -> str:
    """Why ``--toy`` is refused on the Ray engines, and what to run instead (one line).

    A toy overlay (``configs/toy/*.yaml``) is the local engine's: a model built in the process,
    the local sampler, and scale keys sized for the local engine's step structure (on Ray the math
    toy's ``train.batch_size: 16`` with its 2 anchors would not even fill whole optimiser steps).
    A toy on Ray needs a tiny model served by vLLM and a DeepSpeed / Megatron actor on the CPU
    layer: that is what the ``tiny_cpu_*`` experiments are (a ``tiny:`` model built on first use,
    8 prompts, 2 steps), one per method the end-to-end tests run."""
    if cfg.get("tiny"):
        return (f"--toy on the {engine} engine: {name} already is the Ray engines' toy (a tiny model served by vLLM, "
                f"a handful of prompts, 2 steps); drop --toy (or use --engine local --toy for the in-process toy)")
    import glob

    from openrlhf_div.engines import experiment as E

    method = (E.method_section(cfg).get("name") or "METHOD")
    toys = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(E.ROOT, "configs", "openrlhf", "tiny_cpu_*.yaml")))
    alt = f"tiny_cpu_{method}" if f"tiny_cpu_{method}" in toys else "tiny_cpu_<method> (" + ", ".join(toys) + ")"
    local = f"`openrlhf-div run {name} --engine local --toy` for {name}'s toy"
    if _sql_anchor_toy(cfg, method):  # refused on the local engine too (_run_local): propose a math experiment's
        math = [os.path.basename(p)[:-5] for p in sorted(glob.glob(os.path.join(E.ROOT, "configs", "openrlhf", f"[!_]*_{method}.yaml")))
                if not _sql_anchor_toy(E.load(p, toy=True), method)]
        local = (f"`openrlhf-div run {math[0]} --engine local --toy` for {method}'s toy on a math task ({name}'s SQL toy "
                 "has no correct samples to anchor on)" if math else f"the local engine's toy of a math experiment")
    return (f"--toy on the {engine} engine: the toy overlay is the local engine's (an in-process tiny model and sampler); "
            f"run {local}, or the Ray engines' toy `openrlhf-div run {alt} --engine {engine}`")


def _sql_anchor_toy(cfg, method: str) -> bool:
    """The local engine refuses this toy: an anchor method on the SQL toy (its tiny model writes no correct SQL)."""
    from openrlhf_div.algorithms import preset

    try:
        anchors = preset(method).needs.anchor_batch
    except ValueError:
        return False
    return bool(anchors and (cfg.get("local") or {}).get("toy_sql_scripts"))


def _run_ray(path, cfg, engine, backend, run_dir, args, overrides, passthrough) -> int:
    from openrlhf_div.engines import experiment as E

    if args.toy:
        raise ValueError(toy_on_ray_refusal(os.path.splitext(os.path.basename(path))[0], cfg, engine))
    # the overrides travel as they were written: the driver merges them into the experiment with
    # the one loader (launch.plan), and the method converts each value once (coerce_hparam)
    flags = list(overrides) + list(passthrough)
    if engine == "megatron" and backend != "megatron":
        flags += ["--div.actor_backend", "megatron"]
    if engine == "openrlhf" and backend == "megatron":
        flags += ["--div.actor_backend", "deepspeed"]
    if args.resume:
        run_dir = _resume_dir(args)
        if "--ckpt.load_enable" not in flags:
            flags.append("--ckpt.load_enable")
    if args.dry_run:
        flags.append("--dry-run")
    script = os.path.join(E.ROOT, "examples", "scripts", "run.sh")
    if not os.path.isfile(script):
        raise FileNotFoundError(f"{script}: the Ray launcher comes with the repository (run from a checkout)")
    cmd = ["bash", script, path] + (["--submit"] if args.submit else []) + flags
    env = dict(os.environ, PYTHON=os.environ.get("PYTHON", sys.executable))
    if run_dir:  # else RUN_DIR as set, or the launcher's new runs/<experiment>/<timestamp>
        env["RUN_DIR"] = run_dir
    print("openrlhf-div run: " + " ".join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # Ctrl-C reached the launcher too: it ends with its own line (no traceback here)
        try:
            return proc.wait()
        except KeyboardInterrupt:  # a second Ctrl-C: stop waiting
            proc.terminate()
            return 130
