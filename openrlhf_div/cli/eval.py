"""``openrlhf-div eval``: pass@k (unbiased), mean@n, greedy accuracy, diversity and keep /
exploration rates of a model on one or more dataset files.

    openrlhf-div eval --model PATH --task math --data aime24.jsonl --data math500.jsonl \\
        --n 16 --k 1,8,16 --temperature 0.6 --top-p 0.95 --greedy --role base --out runs/eval/qwen

``--role`` says what the model is for ``compare``: ``base`` (the model before RL) or ``trained``.
It is inferred only from a train run folder (``--model`` inside one, e.g. ``RUN/final_model``, or
``--out`` being one: ``trained``, and the run's seed is recorded) or from ``--base-results``
(``trained``); otherwise it is required.

The settings the schema owns may also be given as ``key=value`` in the schema's names, the way
``run`` and ``train`` take them (``openrlhf-div config fields``): the same evaluation as above is

    openrlhf-div eval model.path=PATH task=math data.eval=aime24.jsonl eval.n_samples=16 eval.k=1,8,16 \
        eval.temperature=0.6 eval.top_p=0.95 --greedy --role base --out runs/eval/qwen

(:data:`SCHEMA_KEYS` lists them; a setting given both as a flag and as ``key=value`` is refused).

Writes ``eval.json`` (the project's one results format, :mod:`openrlhf_div.eval.results`),
``results.md`` and ``samples.jsonl`` into ``--out``. Generation uses
vLLM when it is installed and a GPU is present (``--sampler auto``), else the training engine's KV-cache sampler on
the Hugging Face model in-process (``--sampler local``; ``--sampler hf``: ``model.generate``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse_ks(text: str):
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k must be comma-separated integers like 1,8,16, got {text!r}") from None
    if not ks or any(k < 1 for k in ks):
        raise argparse.ArgumentTypeError(f"--k needs positive integers, got {text!r}")
    return ks


def _parse_opt(text: str):
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--task-opt takes KEY=VALUE, got {text!r}")
    key, val = text.split("=", 1)
    try:
        val = json.loads(val)  # numbers, true/false, null
    except json.JSONDecodeError:
        pass  # keep as a string (paths, names)
    return key.strip().replace("-", "_"), val


#: the schema's names (an experiment file's, ``run``'s and ``train``'s ``key=value``) this command takes
#: as ``key=value``, and the flag each one is: one name per setting on every command
SCHEMA_KEYS = {
    "model.path": "--model", "task": "--task", "data.eval": "--data", "eval.n_samples": "--n", "eval.k": "--k",
    "eval.temperature": "--temperature", "eval.top_p": "--top-p", "eval.max_new_tokens": "--max-new-tokens",
    "eval.max_prompts": "--limit", "data.prompt_field": "--prompt-field", "data.label_field": "--label-field",
    "data.id_field": "--id-field", "data.duplicate_ids": "--duplicate-ids", "data.eval_split": "--split",
    "data.prompt_template": "--prompt-template", "data.system_prompt": "--system-prompt", "seed": "--seed",
}


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


class _Given(argparse.Action):
    """A flag that records that it was given (``key=value`` and the flag together are refused)."""

    def __init__(self, *a, append: bool = False, **kw):
        self.append = append
        super().__init__(*a, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        given = set(getattr(namespace, "flags_given", None) or ())
        given.add(self.dest)
        namespace.flags_given = given
        if self.append:
            values = list(getattr(namespace, self.dest, None) or []) + [values]
        setattr(namespace, self.dest, values)


def apply_settings(args) -> None:
    """``args.settings`` (``key=value`` in the schema's names) onto the flags' values, each through the
    schema's one coercion; an unknown key, a malformed item or a setting also given as its flag: a
    ``ValueError`` of one line."""
    from openrlhf_div.config import ConfigError, yaml_value

    given = set(getattr(args, "flags_given", None) or ())
    flags = [a for a in getattr(args, "settings", None) or () if a.startswith("-")]
    if flags:
        raise ValueError(f"unrecognized argument {flags[0]!r} (`openrlhf-div eval --help` lists the flags)")
    for item in getattr(args, "settings", None) or ():
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"{item!r}: settings are key=value in the schema's names (e.g. eval.n_samples=64); "
                             f"this command's: {', '.join(SCHEMA_KEYS)}")
        flag = SCHEMA_KEYS.get(key)
        if flag is None:
            import difflib

            close = difflib.get_close_matches(key, list(SCHEMA_KEYS), n=2)
            hint = f" Did you mean {' or '.join(close)}?" if close else ""
            raise ValueError(f"{key}: not a setting of eval.{hint} It takes {', '.join(SCHEMA_KEYS)} "
                             "(`openrlhf-div config fields` explains each)")
        dest = _dest(flag)
        if dest in given:
            raise ValueError(f"{key} and {flag} are one setting given twice; give one")
        try:
            val = yaml_value(raw) if raw.strip() else ""
        except Exception:  # noqa: BLE001 - a YAML error: the text as it is
            val = raw
        if key == "eval.k":
            val = _parse_ks(",".join(str(v) for v in val) if isinstance(val, list) else str(val))
        elif key == "data.eval":
            val = [str(v) for v in val] if isinstance(val, list) else [str(val)]
        elif key in ("model.path", "task"):
            val = str(val)
        else:
            from openrlhf_div.schema import coerce, field_of

            try:
                val = coerce(key, field_of(key).type, val)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
            if isinstance(val, str) and dest in ("n", "limit", "seed", "max_new_tokens"):
                raise ValueError(f"{key}: expected an integer, got {val!r}")
        setattr(args, dest, val)
        given.add(dest)
    missing = [f"{flag} (or {key}=...)" for key, flag in SCHEMA_KEYS.items()
               if flag in ("--model", "--task", "--data") and getattr(args, _dest(flag), None) in (None, [])]
    if missing:
        raise ValueError(f"{', '.join(missing)} required")


#: how this command spells the options a data error points to (openrlhf_div.tasks.datasets.HINTS)
DATA_HINTS = {"on_error": "--on-error skip", "duplicate_ids": "--duplicate-ids rename", "max_prompt": None}


class _OldSamplerFlag(argparse.Action):
    """``eval --engine X``: read as ``--sampler X`` with one line (one word, one meaning: --engine is the trainer)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print("note: eval --engine is spelt --sampler now (--engine names the trainer: run --engine); "
              f"read as --sampler {values}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a model: pass@k, mean@k, greedy, diversity, keep/explore",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("settings", nargs="*", metavar="KEY=VALUE",
                   help="settings in the schema's names instead of their flags, anywhere on the line: " + ", ".join(
                       f"{k} ({f})" for k, f in SCHEMA_KEYS.items()))
    p.set_defaults(takes_settings=True)
    p.add_argument("--model", action=_Given, help="model: a Hugging Face folder, a .gguf file, or a Hub id already in "
                                                  "the local Hugging Face cache (required; model.path=)")
    p.add_argument("--task", action=_Given, help="task name (math, sql, countdown, ...) (required; task=)")
    p.add_argument("--data", action=_Given, append=True,
                   help="dataset file or folder (.jsonl/.json/.parquet/saved HF dataset); repeat for several "
                        "(required; data.eval=)")
    p.add_argument("--n", type=int, default=16, action=_Given, help="samples per problem (default 16)")
    p.add_argument("--k", type=_parse_ks, default=None, action=_Given,
                   help="pass@k values, comma-separated (default 1,8,16 up to n)")
    p.add_argument("--temperature", type=float, default=1.0, action=_Given)
    p.add_argument("--top-p", type=float, default=1.0, action=_Given)
    p.add_argument("--greedy", action="store_true", help="also decode greedily and report greedy accuracy")
    p.add_argument("--max-new-tokens", type=int, default=None, action=_Given,
                   help="longest response in tokens (default: the task's: 1024 for math, sql and countdown, 16 for "
                        "demo). On a CPU long responses are slow: the progress lines give tokens/s and the ETA; "
                        "--limit and a lower value shorten a trial run")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate call")
    p.add_argument("--out", default=None, help="output folder (default runs/eval/<model>-<task>)")
    p.add_argument("--base-results", default=None,
                   help="a base model's eval.json (or its folder): adds keep / exploration rates; it must have been "
                        "evaluated with the same n, temperature, top_p, max_new_tokens, grading, data and keep_k")
    p.add_argument("--name", default=None, help="name of this model in `compare` reports (default: the method of "
                                                 "its train run folder, else the model's folder name)")
    p.add_argument("--role", choices=["base", "trained", "method"], default=None,
                   help="role in `compare`: base (the model before RL) or trained (method: the older spelling). "
                        "Default: trained when --model is inside a train run folder, --out is one, or "
                        "--base-results is given; otherwise required")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="use --base-results even when its evaluation settings differ (recorded in eval.json)")
    p.add_argument("--keep-k", type=int, default=None,
                   help="pass@k that counts as solved for keep/explore (default 8, or n when n < 8)")
    p.add_argument("--task-opt", type=_parse_opt, action="append", default=[], metavar="KEY=VALUE",
                   help="task option, e.g. db_root=/data/bird/dev_databases or template=llama3 (repeatable)")
    p.add_argument("--source", default=None, help="dataset name to report (default: from the file name)")
    p.add_argument("--prompt-field", default=None, action=_Given, help="question field name, if not a usual one")
    p.add_argument("--label-field", default=None, action=_Given, help="answer/label field name (dotted for nested)")
    p.add_argument("--id-field", default=None, action=_Given, help="id field name")
    p.add_argument("--split", default=None, action=_Given, help="split of a saved Hugging Face DatasetDict (required when it has "
                                                 "several)")
    p.add_argument("--duplicate-ids", choices=["error", "rename"], default="error", action=_Given,
                   help="a repeated id: stop with an error naming both lines (default) or rename it id#k")
    p.add_argument("--prompt-template", default=None, action=_Given,
                   help="user message with {prompt} where the question goes (replaces the task's template)")
    p.add_argument("--system-prompt", default=None, action=_Given, help="system message replacing the task's ('' for none)")
    p.add_argument("--on-error", choices=["raise", "skip"], default="raise",
                   help="malformed dataset rows: stop with an error (default) or skip and count them")
    p.add_argument("--limit", type=int, default=None, action=_Given, help="first N problems per dataset")
    p.add_argument("--sampler", dest="engine", choices=["auto", "local", "hf", "vllm"], default="auto",
                   help="local: the training engine's KV-cache sampler; hf: Hugging Face generate; vllm: the "
                        "training engine's in-process vLLM sampler; auto (default): vllm when installed and a GPU "
                        "is present, else local. Every sampler takes every --model form (the model is loaded once, "
                        "as train loads it; a .gguf is de-quantized and cached)")
    p.add_argument("--engine", dest="engine", choices=["auto", "local", "hf", "vllm"], action=_OldSamplerFlag,
                   help=argparse.SUPPRESS)  # the old name: "engine" is the trainer (run --engine)
    p.add_argument("--vllm-eager", action="store_true",
                   help="vllm engine without torch.compile (rollout.vllm_enforce_eager): starts in seconds instead "
                        "of minutes on a CPU, samples slower")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--seed", type=int, default=0, action=_Given)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)


#: how far up from --model a train run folder is looked for (RUN/final_model, RUN/checkpoints/step_N/model)
RUN_FOLDER_DEPTH = 3


def train_run_folder(path: str):
    """The train run folder ``path`` is or lies in (a folder holding ``run_info.json``, which every
    engine's run folder has), looking up to :data:`RUN_FOLDER_DEPTH` levels; None when none."""
    from openrlhf_div.eval.results import RUN_INFO_FILE

    if not path or not os.path.exists(path):
        return None
    cur = os.path.abspath(path)
    for _ in range(RUN_FOLDER_DEPTH + 1):
        if os.path.isdir(cur) and os.path.isfile(os.path.join(cur, RUN_INFO_FILE)):
            return cur
        parent = os.path.dirname(cur)
        if parent == cur:
            break
        cur = parent
    return None


def resolve_role(args):
    """``(role, run_folder)``: ``--role`` when given, else ``trained`` for a model of a train run
    folder (or ``--out`` a run folder, or ``--base-results``); ``(None, None)`` when it cannot be
    told (the caller refuses in one line)."""
    from openrlhf_div.eval.results import RUN_INFO_FILE

    folder = train_run_folder(args.model)
    if folder is None and args.out and os.path.isfile(os.path.join(args.out, RUN_INFO_FILE)):
        folder = os.path.abspath(args.out)
    if args.role:
        return ("trained" if args.role == "method" else args.role), folder
    if folder is not None or args.base_results:
        return "trained", folder
    return None, None


def _run_info(folder):
    from openrlhf_div.eval.results import RUN_INFO_FILE

    if not folder:
        return {}
    try:
        with open(os.path.join(folder, RUN_INFO_FILE)) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def run_seed(folder):
    """The seed training used, from a run folder's ``run_info.json`` (None when unknown)."""
    seed = _run_info(folder).get("seed")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def run_method(folder):
    """The method a run folder trained (``run_info.json``'s settings or method), or None."""
    info = _run_info(folder)
    name = (info.get("settings") or {}).get("method.name") if isinstance(info.get("settings"), dict) else None
    if name is None and isinstance(info.get("method"), dict):
        name = info["method"].get("name")
    return str(name) if name else None


def run(args) -> int:
    from openrlhf_div.eval.evaluate import evaluate, results_markdown
    from openrlhf_div.eval.results import check_settings, data_hash, read_eval_json, write_eval
    from openrlhf_div.engines.local.samplers import make_generate_fn
    from openrlhf_div.tasks import get_task
    from openrlhf_div.tasks.datasets import DatasetError, load_examples

    apply_settings(args)  # key=value in the schema's names (a bad one: one line, exit 2)
    ks = args.k if args.k is not None else [k for k in (1, 8, 16) if k <= args.n]
    if args.keep_k is None:
        args.keep_k = min(8, args.n)
    if args.keep_k > args.n or args.keep_k < 1:
        print(f"error: --keep-k {args.keep_k} must be in [1, --n {args.n}]", file=sys.stderr)
        return 2
    bad = [k for k in ks if k > args.n]
    if bad:
        print(f"error: --k {bad} exceed --n {args.n}; pass@k needs k <= n", file=sys.stderr)
        return 2
    from openrlhf_div.engines.local.models import ModelNotFoundError, resolve_model

    try:
        resolve_model(args.model)
    except ModelNotFoundError as exc:
        print(f"error: --model: {exc}", file=sys.stderr)
        return 2
    try:
        task = get_task(args.task, **dict(args.task_opt))
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.max_new_tokens is None:
        args.max_new_tokens = int(getattr(task, "eval_max_new_tokens", 1024))

    examples, summaries = [], []
    for path in args.data:
        try:
            ex, summary = load_examples(path, args.task, source=args.source, prompt_field=args.prompt_field,
                                        label_field=args.label_field, id_field=args.id_field, split=args.split,
                                        on_error=args.on_error, limit=args.limit,
                                        duplicate_ids=args.duplicate_ids, hints=DATA_HINTS)
        except DatasetError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(summary, file=sys.stderr)
        examples.extend(ex)
        summaries.append({"path": path, "loaded": summary.loaded, "skipped": summary.skipped,
                          "errors": summary.errors[:10], "renamed_ids": summary.renamed_ids})
    if not examples:
        print("error: no examples loaded", file=sys.stderr)
        return 2
    role, run_folder = resolve_role(args)
    if role is None:
        print("error: --role is required: --model is not inside a train run folder (none holds run_info.json) "
              "and --out is not one; pass --role base (the model before RL) or --role trained (a trained model)",
              file=sys.stderr)
        return 2
    mismatch = []
    try:
        base = read_eval_json(args.base_results) if args.base_results else None
        if base is not None:
            mine = {"n": args.n, "temperature": args.temperature, "top_p": args.top_p,
                    "max_new_tokens": args.max_new_tokens, "keep_k": args.keep_k,
                    "grading": task.grading() if hasattr(task, "grading") else None,
                    "data": {"hash": data_hash(examples)}}
            mismatch = check_settings([("base", base["settings"]), ("this run", mine)], args.allow_mismatch,
                                      what="eval --base-results")
            for line in mismatch:
                print(f"warning: --allow-mismatch: {line}", file=sys.stderr)
    except (OSError, ValueError) as exc:
        print(f"error: --base-results: {exc}", file=sys.stderr)
        return 2

    print(f"eval: {len(examples)} problem(s) x {args.n} sample(s){' + greedy' if args.greedy else ''}, up to "
          f"{args.max_new_tokens} new tokens each (--max-new-tokens), sampler {args.engine}", file=sys.stderr)
    t0 = time.time()
    try:
        gen_fn, tokenizer, engine = make_generate_fn(args.model, engine=args.engine, device=args.device,
                                                     dtype=args.dtype, batch_size=args.batch_size, seed=args.seed,
                                                     vllm_enforce_eager=args.vllm_eager)
    except RuntimeError as exc:  # an engine that cannot run here: one line naming why and the alternative
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        result = evaluate(task, examples, gen_fn, n=args.n, ks=ks, greedy=args.greedy,
                          temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                          tokenizer=tokenizer, base_results=base, keep_k=args.keep_k, batch_size=args.batch_size,
                          prompt_template=args.prompt_template, system_prompt=args.system_prompt,
                          progress=not args.no_progress)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        getattr(gen_fn, "close", lambda: None)()  # the vllm engine's shutdown
    out = args.out or os.path.join("runs", "eval", f"{os.path.basename(os.path.normpath(args.model))}-{args.task}")
    model = os.path.abspath(args.model) if os.path.exists(args.model) else args.model
    info = {"source": "eval", "data": summaries, "task_options": dict(args.task_opt),
            "base_results": args.base_results, "settings_mismatch": mismatch, "seconds": round(time.time() - t0, 2),
            "eval_seed": args.seed, "run_dir": run_folder if role == "trained" else None}
    name = args.name or (run_method(run_folder) if role == "trained" else None) \
        or os.path.basename(os.path.normpath(args.model))
    # eval.json's seed is the training run's (compare groups seeds by it), never the sampling seed
    seed = run_seed(run_folder) if role == "trained" else None
    paths = write_eval(out, result, name=name, role=role, seed=seed, info=info,
                       model=model, engine=engine, data_paths=list(args.data))
    print(results_markdown(result))
    print(f"wrote {paths['json']}, {paths['markdown']}, {paths['samples']}", file=sys.stderr)
    return 0
