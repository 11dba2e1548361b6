"""Build, check and launch an OpenRLHF 0.11.2 run with an openrlhf-div method.

* **Flags.** OpenRLHF builds its argument parser inside ``if __name__ == "__main__":`` of
  ``openrlhf/cli/train_ppo_ray.py``, so it cannot be imported. :func:`build_parser` reads that
  file and executes its parser-building statements (everything before
  ``args = parser.parse_args()``), then adds our ``--div.*`` group: every OpenRLHF flag is
  accepted, with OpenRLHF's own defaults and help. :func:`finalize` executes the file's
  post-parse statements (``hierarchize`` and its validation), i.e. everything after
  ``parse_args`` except the final ``train(args)``. Nothing is copied from OpenRLHF.
* **Configs.** A YAML file (``configs/openrlhf/*.yaml``, read by the one loader
  :mod:`openrlhf_div.config`: ``extends:``, ``${VAR:-default}``) holds ``div:`` (``--div.*``),
  ``openrlhf:`` (OpenRLHF flags by dotted name) and ``cluster:`` (nodes x GPUs it must fit).
* **Plan.** :func:`plan` merges config + command line + the flags the method implies
  (:mod:`openrlhf_div.engines.flags`), validates them with OpenRLHF's own checks, counts GPUs and renders the
  final command. ``--dry-run`` prints it and exits without importing Ray or vLLM.
* **Run.** :func:`run` calls OpenRLHF's own ``train(args)`` with three classes swapped for the
  duration of the call, in the driver process only: ``PolicyModelActor`` ->
  :data:`~.actor.DivPolicyModelActor`, ``ReferenceModelActor`` ->
  :data:`~.logprob_actor.DivReferenceModelActor` (log-probs from hidden states, no
  ``[tokens, V]`` logits) and ``PPOTrainer`` -> :data:`~.trainer.DivPPOTrainer`.
  OpenRLHF then creates the reference actor only when ``--algo.kl.init_coef > 0`` (which
  the driver sets only for methods that need it) and no critic (no registered method uses GAE).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import datetime
import importlib.util
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from openrlhf_div.algorithms.authors import MICRO_BATCH_TOKEN_MEAN
from openrlhf_div.config import expand_env, load_experiment

from ..flags import (
    EXPLICIT_NONE,
    Derived,
    add_div_arguments,
    check_supported,
    derive_upstream_flags,
    div_namespace,
    METHOD_KEYS_IN_DIV,
    hparam_table,
    method_from_args,
)
from ..anchor_data import anchor_count
from ..layout import LAYOUT_KEYS, EngineLayout, deprecation, layout_argv

PROG = "python -m openrlhf_div.cli.train_ppo_ray"
_OUR_OPTIONS = ("config", "dry_run")


# ------------------------------------------------------------------ OpenRLHF's CLI source
def upstream_cli_path(module: str = "openrlhf.cli.train_ppo_ray") -> str:
    spec = importlib.util.find_spec("openrlhf")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("openrlhf is not installed: pip install openrlhf==0.11.2 (see requirements/)")
    rel = module.split(".")[1:]
    return os.path.join(list(spec.submodule_search_locations)[0], *rel) + ".py"


@dataclass
class _UpstreamMain:
    parser_code: Any   # statements before `args = parser.parse_args()`
    post_code: Any     # statements after it, without the final `train(args)`


_MAIN_CACHE: Dict[str, _UpstreamMain] = {}


def _is_parse_args(stmt: ast.stmt) -> bool:
    return (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Attribute) and stmt.value.func.attr == "parse_args")


def _is_call_of(stmt: ast.stmt, name: str) -> bool:
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == name)


def upstream_main(path: Optional[str] = None) -> _UpstreamMain:
    """The two halves of OpenRLHF's ``__main__`` block, compiled (cached)."""
    path = path or upstream_cli_path()
    if path in _MAIN_CACHE:
        return _MAIN_CACHE[path]
    with open(path) as fh:
        tree = ast.parse(fh.read(), filename=path)
    main = next((n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.dump(n.test)), None)
    if main is None:
        raise RuntimeError(f"{path}: no `if __name__ == '__main__':` block; is this OpenRLHF 0.11.2?")
    body = main.body
    cut = next((i for i, s in enumerate(body) if _is_parse_args(s)), None)
    if cut is None or not _is_call_of(body[-1], "train"):
        raise RuntimeError(
            f"{path}: expected `args = parser.parse_args()` and a final `train(args)` in the "
            "__main__ block (OpenRLHF 0.11.2 layout); this OpenRLHF version is not supported"
        )
    compile_part = lambda stmts, tag: compile(  # noqa: E731
        ast.fix_missing_locations(ast.Module(body=stmts, type_ignores=[])), f"{path}:{tag}", "exec")
    out = _UpstreamMain(compile_part(body[:cut], "parser"), compile_part(body[cut + 1:-1], "validate"))
    _MAIN_CACHE[path] = out
    return out


def build_parser() -> argparse.ArgumentParser:
    """OpenRLHF 0.11.2's ``train_ppo_ray`` parser plus ``--div.*``, ``--config`` and ``--dry-run``."""
    ns: Dict[str, Any] = {"argparse": argparse, "datetime": datetime.datetime, "os": os,
                          "__name__": "openrlhf_div_upstream_parser"}
    exec(upstream_main().parser_code, ns)  # noqa: S102 - OpenRLHF's own parser statements
    parser: argparse.ArgumentParser = ns["parser"]
    parser.prog = PROG
    parser.description = (
        "Train with an openrlhf-div method on OpenRLHF 0.11.2's Ray topology (vLLM rollouts, "
        "DeepSpeed policy actor, reference actor only when the method needs one). Accepts every "
        "OpenRLHF train_ppo_ray flag plus the --div.* group below."
    )
    add_div_arguments(parser)
    from openrlhf_div.engines import megatron as mg  # light: imports no megatron-core

    mg.add_megatron_arguments(parser)  # --megatron.* and --div.actor_backend
    ours = parser.add_argument_group("launcher")
    ours.add_argument("--config", default=None, metavar="YAML",
                      help="experiment config (configs/openrlhf/*.yaml); command-line flags override it")
    ours.add_argument("--dry-run", dest="dry_run", action="store_true",
                      help="print the final command and the topology, then exit (no Ray, no GPU)")
    ours.add_argument("--plugin", action="append", default=None, metavar="MODULE",
                      help="import a module (or .py file) that registers methods / components / tasks, here and "
                           "in every Ray worker (repeatable; also OPENRLHF_DIV_PLUGINS=a,b); see openrlhf_div.plugins")
    parser.error = _one_line_error(parser)
    return parser



def _one_line_error(parser: argparse.ArgumentParser):
    """argparse's error without its ~250-line usage: one line, the closest flag for a typo."""
    def error(message: str):
        import difflib

        hint = ""
        if message.startswith("unrecognized arguments: "):
            bad = message.split(": ", 1)[1].split()[0]
            flags = [s for s in parser._option_string_actions if s.startswith("--")]
            close = difflib.get_close_matches(bad.split("=", 1)[0], flags, n=3)
            hint = f". Did you mean {', '.join(close)}?" if close else ""
        m = re.match(r"argument (\S+): invalid choice: '([^']*)'", message)
        if m and m.group(1) in parser._option_string_actions:  # --div.method grpoo
            choices = [str(c) for c in parser._option_string_actions[m.group(1)].choices or ()]
            close = difflib.get_close_matches(m.group(2), choices, n=3)
            hint = f". Did you mean {', '.join(close)}?" if close else ""
        parser.exit(2, f"{parser.prog}: error: {message}{hint} (--help lists every flag)\n")
    return error


def finalize(parsed: argparse.Namespace):
    """OpenRLHF's post-parse statements (hierarchize + validation) on a copy of ``parsed``."""
    flat = copy.deepcopy(parsed)
    for k in _OUR_OPTIONS:
        if hasattr(flat, k):
            delattr(flat, k)
    ns: Dict[str, Any] = {"args": flat, "__name__": "openrlhf_div_upstream_validate"}
    try:
        exec(upstream_main().post_code, ns)  # noqa: S102 - OpenRLHF's own validation
    except AssertionError as exc:
        raise ValueError(f"OpenRLHF rejects this configuration: {exc}") from None
    return ns["args"]


# ------------------------------------------------------------------ YAML configs
def _flag_values(prefix: str, key: str, value, bool_values: bool = False) -> List[str]:
    """One config entry as flags. OpenRLHF's booleans are store_true switches (``true`` -> the
    bare flag, ``false`` -> nothing); ours take a value (``bool_values``)."""
    flag = f"--{prefix}{key}"
    if isinstance(value, bool) and bool_values:
        return [flag, "true" if value else "false"]
    if value is None or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, (list, tuple)):
        return [flag] + [expand_env(str(v)) for v in value]
    if isinstance(value, dict):
        raise ValueError(f"config key {prefix}{key}: nested mappings are not flags; use dotted keys")
    return [flag, expand_env(str(value))]


#: an experiment config through the one loader (YAML only; see openrlhf_div.config)
load_config = load_experiment


def config_argv(cfg: Dict[str, Any], method_values: bool = True) -> List[str]:
    """The flags a config stands for: ``method:`` (name + hyperparameters) and ``task:`` ->
    ``--div.method`` / ``--div.<key>`` / ``--div.task``, ``div:`` -> ``--div.*`` (its method keys and
    task: the old spelling, read with a one-line deprecation), ``layout:`` -> ``--engine.*``
    (:mod:`openrlhf_div.engines.layout`), ``openrlhf:`` -> ``--<key>``. A layout key
    still under ``div:`` is read as ``layout.<key>`` with a one-line deprecation.

    ``method_values=False``: the method's hyperparameters (and aggregation, dynamic_sampling) are
    left out; :func:`plan` puts them into the parsed namespace as the values the file holds
    (:func:`config_values`), so that a value is converted once, by the registry's
    ``coerce_hparam``, not rendered to text and parsed again. The rendered form stays the
    printed command's."""
    from openrlhf_div.schema import refuse_on_ray

    refused = refuse_on_ray(cfg)
    if refused:  # a setting of the schema with no OpenRLHF flag: refused, never dropped
        raise ValueError(f"config: {refused}")
    argv: List[str] = []
    hparams = hparam_table()
    method = dict(cfg.get("method") or {})
    method_argv: List[str] = []  # after div:'s flags: the new spelling wins (argparse keeps the last)
    if "name" in method:
        method_argv += ["--div.method", str(method.pop("name"))]
    if cfg.get("task"):
        method_argv += ["--div.task", str(cfg["task"])]
    for k, v in method.items():  # the method section: its hyperparameters, as --div.<key>
        if not method_values and k in METHOD_KEYS_IN_DIV():
            continue  # any other key is rendered: argparse refuses a typo, a layout key is read with its deprecation
        if v is None and k in hparams:
            method_argv += [f"--div.{k}", EXPLICIT_NONE]
        else:
            method_argv += _flag_values("div.", k, v, bool_values=True)
    div = cfg.get("div") or {}
    new = dict(cfg.get("method") or {}, **({"task": cfg["task"]} if cfg.get("task") else {}))
    for k, v in div.items():  # both spellings in one (merged) experiment must agree
        nk = "name" if k == "method" else k
        if nk in new and new[nk] != v and (k in ("method", "task") or k in METHOD_KEYS_IN_DIV()):
            where = "task" if k == "task" else f"method.{nk}"
            raise ValueError(f"config: div.{k}={v} and {where}={new[nk]} (one experiment, two spellings, e.g. a file "
                             f"in the old spelling over a base in the new one); write {where} only")
    old = [k for k in div if k == "method" or k == "task" or k in METHOD_KEYS_IN_DIV()]
    if old:
        print(deprecation(", ".join(f"div.{k}" for k in old),
                          ", ".join("method.name" if k == "method" else "task" if k == "task" else f"method.{k}"
                                    for k in old)), file=sys.stderr)
    layout = dict(cfg.get("layout") or {})
    unknown = sorted(set(layout) - set(LAYOUT_KEYS))
    if unknown:
        raise ValueError(f"config section `layout`: unknown key(s) {unknown}; the OpenRLHF driver reads "
                         f"{sorted(LAYOUT_KEYS)} there")
    for k, v in (cfg.get("div") or {}).items():
        if k in LAYOUT_KEYS:
            print(deprecation(f"div.{k}", f"layout.{k}"), file=sys.stderr)
            layout.setdefault(k, v)
            continue
        if not method_values and k in METHOD_KEYS_IN_DIV():
            continue
        if v is None and k in hparams:  # `dual_clip: null`: the method gets None, not its default
            argv += [f"--div.{k}", EXPLICIT_NONE]
            continue
        argv += _flag_values("div.", k, v, bool_values=True)
    argv += method_argv + layout_argv(layout)
    for k, v in (cfg.get("openrlhf") or {}).items():
        argv += _flag_values("", k, v)
    return argv


def config_values(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """``{namespace dest: value}`` of an experiment's method hyperparameters (and aggregation,
    dynamic_sampling) as its file (and ``section.key=value`` overrides, through the one loader)
    hold them: put into the driver's namespace as they are, converted once by the method
    (``Method.with_overrides`` -> ``coerce_hparam``). An explicit null is :data:`EXPLICIT_NONE`."""
    from openrlhf_div.engines.experiment import method_section

    out: Dict[str, Any] = {}
    for k, v in method_section(cfg).items():
        if k == "name" or k not in METHOD_KEYS_IN_DIV():
            continue
        out[f"div.{k}"] = EXPLICIT_NONE if v is None else (list(v) if isinstance(v, tuple) else v)
    return out


def _given(argv: Sequence[str], dest: str) -> bool:
    flag = "--" + dest
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def split_overrides(argv: Sequence[str]):
    """``(overrides, rest)``: the ``section.key=value`` items of a driver's command line (a section
    of an experiment file: ``method.anchor_eta=0.3``, ``openrlhf.train.batch_size=64``), merged
    into the experiment by the one loader, and everything else."""
    import re

    from openrlhf_div.config import EXPERIMENT_SECTIONS, RENAMED_SECTIONS

    over, rest = [], []
    for a in argv:
        m = re.match(r"^([A-Za-z_]+)(\.[^=\s]+)?=", a)
        (over if m and (m.group(1) in EXPERIMENT_SECTIONS or m.group(1) in RENAMED_SECTIONS) else rest).append(a)
    return over, rest


def _split_config(argv: Sequence[str]):
    """Pull ``--config PATH`` / ``--config=PATH`` out of argv."""
    rest, path = [], None
    it = iter(range(len(argv)))
    for i in it:
        tok = argv[i]
        if tok == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config needs a path")
            path = argv[i + 1]
            next(it, None)
        elif tok.startswith("--config="):
            path = tok.split("=", 1)[1]
        else:
            rest.append(tok)
    return path, rest


# ------------------------------------------------------------------ the plan
@dataclass
class Plan:
    argv: List[str]                    # final flags (config + user + derived), no launcher flags
    args: Any                          # OpenRLHF's hierarchized, validated namespace
    method: Any
    derived: Derived
    gpus: Dict[str, int] = field(default_factory=dict)
    cluster_gpus: Optional[int] = None
    config: Optional[str] = None
    dry_run: bool = False
    env: Dict[str, str] = field(default_factory=dict)   # the config's env: section
    experiment: Dict[str, Any] = field(default_factory=dict)  # the experiment as read (overrides merged)

    def needs(self) -> Dict[str, Any]:
        """What the live cluster must hold (:func:`~.jobs.check_resources`): one GPU and one CPU
        per bundle of OpenRLHF's placement groups."""
        detail = " + ".join(f"{k} {v}" for k, v in self.gpus.items() if k != "total")
        return {"GPU": self.gpus.get("total", 0), "CPU": self.gpus.get("total", 0), "detail": detail}

    @property
    def command(self) -> str:
        return " ".join([PROG] + [shlex.quote(a) for a in self.argv])

    def summary(self) -> str:
        a = self.args
        lines = [f"method      : {self.method.name} ({self.method.summary})"]
        from openrlhf_div.algorithms import get_method

        preset = get_method(self.method.name).hparams  # the summary is the preset's: say what this run sets
        changed = [f"{k}={v}" for k, v in sorted(self.method.hparams.items()) if preset.get(k) != v]
        if changed:
            lines.append("  hyperparameters set: " + ", ".join(changed))
        lines += [f"  {n}" for n in self.derived.notes]
        if getattr(a.div, "actor_backend", "deepspeed") == "megatron":
            m = a.megatron
            engine = (f"Megatron-core TP {m.tp} x PP {m.pp}"
                      + (", distributed optimizer" if m.distributed_optimizer else "")
                      + (", optimizer on the host" if m.optimizer_cpu_offload else ""))
        else:
            engine = f"DeepSpeed ZeRO-{a.ds.zero_stage}, TP {a.ds.tensor_parallel_size}"
        lines.append(f"policy actor: {a.actor.num_nodes} node(s) x {a.actor.num_gpus_per_node} GPU(s), {engine}")
        if self.derived.reference_actor:
            shared = " (colocated with the policy actor)" if (a.train.colocate_actor_ref or a.train.colocate_all) else ""
            lines.append(f"reference   : {a.ref.num_nodes} node(s) x {a.ref.num_gpus_per_node} GPU(s){shared}")
        else:
            lines.append("reference   : none (generator-form or reference-free method)")
        lines.append("critic      : none")
        if a.vllm.num_engines:
            lines.append(f"vLLM        : {a.vllm.num_engines} engine(s) x TP {a.vllm.tensor_parallel_size}"
                         + (" (colocated)" if a.train.colocate_all else ""))
        lines.append(f"reward      : {a.reward.remote_url}")
        lines += authors_layout_lines(self.method, a)
        lines.append(f"GPUs needed : {self.gpus.get('total', 0)} = " + " + ".join(
            f"{k} {v}" for k, v in self.gpus.items() if k != "total")
            + (f" (the config's cluster: block declares {self.cluster_gpus}; the live cluster is checked "
               "at start)" if self.cluster_gpus else ""))
        return "\n".join(lines)


def count_gpus(args, reference: bool) -> Dict[str, int]:
    actor = args.actor.num_nodes * args.actor.num_gpus_per_node
    out = {"actor": actor}
    if reference and not (args.train.colocate_actor_ref or args.train.colocate_all):
        out["reference"] = args.ref.num_nodes * args.ref.num_gpus_per_node
    if args.vllm.num_engines and not args.train.colocate_all:
        out["vllm"] = args.vllm.num_engines * args.vllm.tensor_parallel_size
    out["total"] = sum(out.values())
    return out


def plan(argv: Sequence[str], parser: Optional[argparse.ArgumentParser] = None) -> Plan:
    """Merge config + command line + method-implied flags; validate; count GPUs."""
    cfg_path, rest = _split_config(list(argv))
    overrides, rest = split_overrides(rest)
    if overrides and not cfg_path:
        raise ValueError(f"{overrides[0]}: a section.key=value override needs --config EXPERIMENT.yaml "
                         "(without one, give the --div.* / OpenRLHF flags)")
    if cfg_path:
        from openrlhf_div.engines.experiment import load as load_with_overrides

        cfg = load_with_overrides(cfg_path, overrides)  # the one loader: YAML, extends, overrides
    else:
        cfg = {}
    if cfg.get("plugins"):  # before the parser: their methods and tasks are choices
        from openrlhf_div.plugins import config_plugins, load_plugins

        load_plugins(config_plugins(cfg["plugins"], cfg_path))
    parser = parser or build_parser()
    # the method's hyperparameters go into the namespace as the file holds them (one conversion,
    # by the method); the printed command shows them rendered (config_argv)
    values = config_values(cfg)
    shown_argv = config_argv(cfg) + rest
    user_argv = config_argv(cfg, method_values=False) + rest

    def parse(argv_):
        ns = parser.parse_args(argv_)
        for dest, v in values.items():
            if not _given(rest, dest):  # a --div.<key> flag on the command line wins
                setattr(ns, dest, v)
        return ns

    first = parse(user_argv)
    dry_run = bool(first.dry_run)
    user_argv = [a for a in user_argv if a != "--dry-run"]
    shown_argv = [a for a in shown_argv if a != "--dry-run"]
    method = method_from_args(first)
    derived = derive_upstream_flags(method, user_argv, div_namespace(first))
    final_argv = shown_argv + derived.argv
    parsed = parse(user_argv + derived.argv)
    from openrlhf_div.engines.local.guards import check_group_size  # the local engine's guard: one home

    group_error = check_group_size(method, getattr(parsed, "rollout.n_samples_per_prompt"),
                                   key="rollout.n_samples_per_prompt")
    if group_error:  # before OpenRLHF's own assert (finalize), which names its estimator, not the method
        raise ValueError(group_error)
    if getattr(parsed, "actor.model_name_or_path", None) is None:
        raise ValueError("--actor.model_name_or_path is required (the policy to train)")
    if not getattr(parsed, "reward.remote_url", None):
        from openrlhf_div.tasks import list_tasks

        raise ValueError(f"no reward: pass --div.task {'|'.join(list_tasks())} or --reward.remote_url FILE.py")
    args = finalize(parsed)
    check_supported(method, args)
    _check_batches(method, args)
    gpus = count_gpus(args, derived.reference_actor)
    # the config's cluster: block documents the cluster the experiment was sized for; what decides
    # is the live cluster, checked when the run starts (jobs.check_resources), so a command-line
    # change of the topology is judged against the GPUs that exist, not against the block
    cluster = cfg.get("cluster") or {}
    cluster_gpus = None
    if cluster:
        cluster_gpus = int(cluster.get("nodes", 1)) * int(cluster.get("gpus_per_node", 8))
    env = {str(k): str(v) for k, v in (cfg.get("env") or {}).items()}
    return Plan(final_argv, args, method, derived, gpus, cluster_gpus, cfg_path, dry_run, env, cfg)


def authors_layout_lines(method, args) -> List[str]:
    """The authors' layout of one rollout step (``authors.layout_report``) for an anchor method
    under aggregation ``micro-batch-token-mean``; token budgets laid out at rows of
    ``data.max_len`` tokens."""
    if method.aggregation != MICRO_BATCH_TOKEN_MEAN or not method.needs.anchor_batch:
        return []
    from openrlhf_div.algorithms.authors import layout_report

    online = args.rollout.batch_size * args.rollout.n_samples_per_prompt
    div = div_namespace(args)
    n_anchor = anchor_count(online, div.anchor_batch_size, div.anchor_ratio)
    rows = int(args.data.max_len)
    layout = EngineLayout.from_args(args)
    budget = layout.micro_batch_tokens
    return layout_report(method, online, n_anchor, args.train.batch_size,
                         row_tokens=rows if budget is None else min(rows, int(budget)), layout=layout.to_dict())


def _check_token_budget(method, args) -> None:
    """Under ``micro-batch-token-mean`` with ``layout.micro_batch_tokens``, a micro-batch must hold
    the longest row a run can produce (``data.max_len`` = prompt budget + ``rollout.max_new_tokens``),
    as verl's ``rearrange_micro_batches`` asserts (``max_token_len >= max_seq_len``)."""
    if method.aggregation != MICRO_BATCH_TOKEN_MEAN:
        return
    budget = EngineLayout.from_args(args).micro_batch_tokens
    if budget is not None and int(args.data.max_len) > int(budget):
        raise ValueError(
            f"layout.micro_batch_tokens {budget} is smaller than data.max_len {args.data.max_len} (the longest row: "
            "prompt budget + rollout.max_new_tokens): a micro-batch must hold one whole row (the authors' "
            "ppo_max_token_len_per_gpu >= max_prompt_length + max_response_length); raise layout.micro_batch_tokens "
            "or lower data.max_len")


def _check_batches(method, args) -> None:
    """With anchors, online + anchor rows per rollout step must fill whole optimizer steps
    (DeepSpeed only steps at gradient-accumulation boundaries)."""
    _check_token_budget(method, args)
    if not method.needs.anchor_batch:
        return
    if method.aggregation == MICRO_BATCH_TOKEN_MEAN:
        # the authors' layout cuts its own steps (a short trailing anchor step is the point) and
        # sets DeepSpeed's accumulation boundary itself (loss.authors_micro_batches); at the
        # authors' GPU count their rows must split as their dispatch split them
        if EngineLayout.from_args(args).authors_world_size is not None:
            authors_layout_lines(method, args)  # raises what the authors' layout cannot do, before any GPU starts
        return
    online = args.rollout.batch_size * args.rollout.n_samples_per_prompt
    div = div_namespace(args)
    n_anchor = anchor_count(online, div.anchor_batch_size, div.anchor_ratio)
    rows = online + n_anchor
    if rows % args.train.batch_size:
        raise ValueError(
            f"each rollout step yields {online} online + {n_anchor} anchor = {rows} samples, not a "
            f"multiple of --train.batch_size {args.train.batch_size}: the last optimizer step would be "
            "partial. Adjust --div.anchor_batch_size / --div.anchor_ratio or --train.batch_size"
        )


# ------------------------------------------------------------------ running
@contextlib.contextmanager
def div_classes(args=None):
    """OpenRLHF's ``train()`` builds our policy actor and controller while this is active.

    With ``--div.actor_backend megatron`` the policy (and reference) actor classes are the
    Megatron-core ones; everything else (vLLM, rewards, the registry, anchors) is unchanged.
    """
    from openrlhf_div.compat.flash_attn_standin import install as install_flash_attn_standin

    install_flash_attn_standin()  # before openrlhf.models: a no-op where flash-attn is installed
    from openrlhf.cli import train_ppo_ray as upstream_cli
    from openrlhf.trainer import ppo_trainer

    from openrlhf_div.engines import megatron as mg

    from .actor import DivPolicyModelActor, _swapped
    from .trainer import DivPPOTrainer

    policy_cls = (mg.actor_class_for(args) if args is not None else None) or DivPolicyModelActor
    from .logprob_actor import DivReferenceModelActor

    ref_cls = (mg.reference_class_for(args) if args is not None else None) or DivReferenceModelActor
    with _swapped(upstream_cli, "PolicyModelActor", policy_cls), \
            _swapped(upstream_cli, "ReferenceModelActor", ref_cls), \
            _swapped(ppo_trainer, "PPOTrainer", DivPPOTrainer):
        yield upstream_cli


def apply_config_env(cfg_or_env) -> None:
    """A config's ``env:`` section into this process's environment (a variable already set wins);
    ``OPENRLHF_DIV_*`` ones then reach every Ray worker (:func:`~.jobs.task_env`)."""
    env = cfg_or_env.get("env") if isinstance(cfg_or_env.get("env"), dict) else cfg_or_env
    for k, v in (env or {}).items():
        os.environ.setdefault(str(k), str(v))


def run(p: Plan) -> None:
    from .jobs import init_ray

    apply_config_env(p.env)
    # the task's variables (OPENRLHF_DIV_*) reach every worker (jobs.py); the CPU layer without a
    # GPU; a private cluster when none runs; a run the live cluster cannot place stops here
    init_ray(need=p.needs())
    from .nodes import LOST_NODE_EXIT, NodeWatch, check_shared_paths, config_paths, lost_node_message, watch_nodes
    from .runfolder import record_failure, write_driver_files

    check_shared_paths(config_paths(p.args))  # several nodes: each sees every path (nodes.py)

    def lost(node):  # the line also goes into the run folder (error.txt), then the driver ends
        record_failure(p.args, lost_node_message(node))
        NodeWatch._exit(node)

    write_driver_files(p, p.experiment)  # config.yaml, run_info.json (the experiment with its overrides)
    watch = watch_nodes(on_lost=lost)  # a node lost mid-run ends the run in one line (nodes.py)
    with div_classes(p.args) as upstream_cli:
        try:
            upstream_cli.train(p.args)
        except Exception as exc:  # noqa: BLE001
            named = watch.explain() if watch else None
            if named:  # Ray's error about an actor on that node reached us before the watchdog
                record_failure(p.args, named)
                print(named, file=sys.stderr, flush=True)
                raise SystemExit(LOST_NODE_EXIT) from None
            _exit_naming(exc, p.args)
            raise


#: the exit code of a job whose Ray actor died (4: a dead vLLM engine process, nodes.LOST_NODE_EXIT: a lost node)
DEAD_ACTOR_EXIT = 5

#: what each of the run's Ray actor classes is, for the dead-actor line (a substring of the class name)
ACTOR_ROLES = (("PPOTrainer", "the controller"), ("PolicyModelActor", "the policy actor"),
               ("ReferenceModelActor", "the reference actor"), ("Rollout", "a vLLM rollout actor"),
               ("LLMRayActor", "a vLLM rollout actor"), ("Megatron", "a Megatron policy rank"))


def dead_actor_line(exc: BaseException, ckpt_path: Optional[str] = None) -> Optional[str]:
    """One line for a Ray actor of the run whose process died (SIGKILL from the OOM killer or a
    user, a crash, a preempted node): Ray's ``ActorDiedError`` anywhere in ``exc``'s chain (the
    controller's own, or one a controller task raised), its class, role, pid, node, Ray's exit
    detail, and where the run resumes (``latest`` of ``ckpt_path``/_actor). ``None``: not that."""
    try:
        from ray.exceptions import ActorDiedError
    except ImportError:  # pragma: no cover - Ray is a dependency of this engine
        return None
    # the controller's own death arrives as ActorDiedError; an actor dying under a controller task
    # arrives as that task's RayTaskError, whose cause Ray replaced by the traceback's text
    # (ActorDiedError holds a protobuf and does not pickle): "...ActorDiedError: ...\n\tclass_name: X"
    from .checkpoints import exception_chain

    text = None
    for e in exception_chain(exc):
        if isinstance(e, ActorDiedError):
            text = str(e)
            break
        s = str(e)
        at = s.rfind("ActorDiedError: ")
        if at >= 0 and "class_name: " in s[at:]:
            text = s[at:]
            break
    if text is None:
        return None
    import re

    def field(name):
        m = re.search(rf"^\s*{name}: (\S+)", text, re.M)
        return m.group(1) if m else None

    cls, pid, ip = field("class_name"), field("pid"), field("ip")
    role = next((r for part, r in ACTOR_ROLES if cls and part in cls), None)
    m = re.search(r"Worker exit detail: ([^\n]*?)(?:\s*(?:There are some potential root causes|Some common causes include)|\n|$)", text)
    detail = " ".join((m.group(1) if m else text.strip().splitlines()[0]).split()).rstrip(".")
    who = f"Ray actor {cls or '?'}" + (f" ({role})" if role else "")
    where = ", ".join(x for x in (f"pid {pid}" if pid else "", f"node {ip}" if ip else "") if x)
    line = f"{who}{f' ({where})' if where else ''} died: {detail}"
    if "connection error" in detail or "SIGKILL" in detail or "killed" in detail.lower():
        line += " (its process was killed: the OOM killer, a signal, a forced `ray stop`, or a crash)"
    if ckpt_path:
        from .checkpoints import read_latest

        save_dir = os.path.join(ckpt_path, "_actor")
        tag = read_latest(save_dir)
        line += (f"; resume from {save_dir}/{tag}: submit the same experiment again with --ckpt.load_enable"
                 if tag else f"; no checkpoint in {save_dir} yet: the run starts again from the beginning")
    return line


def _exit_naming(exc: BaseException, args=None) -> None:
    """A fault of :mod:`.checkpoints` (non-finite loss / weights, a failed or damaged checkpoint),
    a dead vLLM engine process (:mod:`openrlhf_div.compat.engine_death`) or a dead Ray actor
    (:func:`dead_actor_line`) ends the job with its traceback, then one line naming it, last:
    ``SystemExit(1)`` (a dead engine: ``SystemExit(4)``, the code of the CLI's engine line; a dead
    actor: ``SystemExit(5)``)."""
    from openrlhf_div.compat.engine_death import explain

    from .checkpoints import named_fault

    line, code = named_fault(exc), 1
    if line is None:
        line, code = explain(exc), 4
    if line is None:
        ckpt = getattr(getattr(args, "ckpt", None), "path", None)
        line, code = dead_actor_line(exc, ckpt if isinstance(ckpt, str) and ckpt else None), DEAD_ACTOR_EXIT
    if line is None:
        return
    if args is not None:
        from .runfolder import record_failure

        record_failure(args, f"error: {line}")
    import traceback

    traceback.print_exc()
    try:  # the actors' shutdown chatter would otherwise stream in after the line below
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except Exception:  # noqa: BLE001
        pass
    sys.stdout.flush()
    print(f"error: {line}", file=sys.stderr, flush=True)
    raise SystemExit(code)


#: a run folder whose run was stopped before its end holds this file (its one line: what, when, how to resume)
INCOMPLETE_FILE = "INCOMPLETE"
#: the exit status of a run stopped by Ctrl-C / SIGTERM (the shell's 128 + SIGINT)
STOPPED_EXIT = 130


def stopped(args, how: str, what: str = "the run") -> int:
    """A run stopped by the user (Ctrl-C, SIGTERM): its run folder marked incomplete
    (:data:`INCOMPLETE_FILE`), Ray shut down, and one line, the driver's last: what was stopped,
    the run folder, and how to resume from the last checkpoint (if one was saved). Returns
    :data:`STOPPED_EXIT`."""
    import time

    from .checkpoints import read_latest
    from .runfolder import run_dir_of

    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()  # before the line, so that the actors' shutdown chatter does not follow it
    except BaseException:  # noqa: BLE001 - a second Ctrl-C during the shutdown: the line still comes
        pass
    ckpt = getattr(getattr(args, "ckpt", None), "path", None)
    save_dir = os.path.join(ckpt, "_actor") if isinstance(ckpt, str) and ckpt else None
    tag = read_latest(save_dir) if save_dir else None
    run_dir = run_dir_of(args)
    if tag:
        resume = (f"resume from its last checkpoint {save_dir}/{tag}: the same command with RUN_DIR={run_dir} "
                  "and --ckpt.load_enable")
    else:
        resume = "no checkpoint was saved yet: the same command starts it again"
    if os.path.isdir(run_dir):
        where = f"run folder {run_dir} (marked incomplete: {INCOMPLETE_FILE})"
        try:
            from openrlhf_div.io import atomic_write_text

            atomic_write_text(os.path.join(run_dir, INCOMPLETE_FILE),
                              f"stopped by {how} at {time.strftime('%Y-%m-%d %H:%M:%S')}; {resume}\n")
        except OSError:
            pass
    else:
        where = f"before its run folder {run_dir} was written"
    print(f"stopped ({how}): {what}, {where}; {resume}", file=sys.stderr, flush=True)
    return STOPPED_EXIT


def load_argv_plugins(argv: Sequence[str]) -> None:
    """Import the ``--plugin`` modules of ``argv``, the ``plugins:`` of its ``--config`` file (and
    ``OPENRLHF_DIV_PLUGINS``) before the parser is built (``--div.method`` / ``--div.task`` list
    the registered ones) and export them to the Ray workers (:mod:`openrlhf_div.plugins`)."""
    from openrlhf_div.plugins import config_plugins, load_plugins, split_plugin_args

    specs, rest = split_plugin_args(argv)
    cfg_path, _ = _split_config(rest)
    if cfg_path:
        specs += config_plugins(load_config(cfg_path).get("plugins"), cfg_path)
    load_plugins(specs)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        load_argv_plugins(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser()
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        return 0
    try:
        p = plan(argv, parser)
    except (ValueError, NotImplementedError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(p.summary())
    print("command:")
    print(p.command)
    if p.dry_run:
        return 0
    from .jobs import PlacementError, private_cluster_done
    from .nodes import SharedPathError

    try:
        run(p)
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback (issue 43 item 5)
        return stopped(p.args, "Ctrl-C", what=f"training {p.method.name}")
    except SystemExit as exc:  # SIGTERM under a private cluster (jobs._note_interrupts exits with its number)
        from .jobs import _PRIVATE

        if _PRIVATE.get("interrupted") == "SIGTERM":
            return stopped(p.args, "SIGTERM", what=f"training {p.method.name}")
        raise exc
    except (SharedPathError, PlacementError) as exc:  # a path some node cannot see; a plan the cluster cannot place
        private_cluster_done()  # the line says it all: no cluster logs to keep
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a dead vLLM engine: end with the one line that names it
        from openrlhf_div.compat.engine_death import explain

        line = explain(exc)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 4
    private_cluster_done()
    return 0
