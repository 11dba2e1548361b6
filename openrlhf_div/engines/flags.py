"""The ``--div.*`` flag group and how a registered method maps onto OpenRLHF's flags.

No OpenRLHF, Ray or vLLM import here: the dry run, ``--help`` and the config tests use it on
any machine. It sits above both Ray-topology engines (the OpenRLHF driver and actors, and the
Megatron actor, which reads the same ``--div.*`` flags), so neither imports the other for it.

The method is the single source of truth for the algorithm. OpenRLHF flags are only set
where they change the *topology* or the *data flow*:

===========================  ===========================================================
method declares              OpenRLHF flags the driver sets
===========================  ===========================================================
any estimator                ``--algo.advantage.estimator`` (group_norm / dr_grpo / rloo):
                             critic-free topology; the advantages themselves come from
                             the registry inside our experience maker
``needs.ref_log_probs``      ``--algo.kl.init_coef <c> --algo.kl.use_loss --algo.kl.estimator k3``
                             (creates the reference actor and ships its log-probs to the
                             policy actor; the KL *value* is computed by the method)
no reference needed          ``--algo.kl.init_coef 0`` (OpenRLHF's default 0.01 would
                             create a reference actor)
``dynamic_sampling``         ``--algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0 1``
                             (drop all-0/all-1 groups at generation and refill)
``--div.task NAME``          ``--reward.remote_url <package>/tasks/reward_funcs/NAME.py``
===========================  ===========================================================

OpenRLHF flags that our training step would silently ignore (clip range, KL coefficient,
entropy coefficient, loss aggregation, length penalties, IS correction, ...) are refused
when given explicitly, with the ``--div.*`` flag to use instead.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

from openrlhf_div.algorithms.registry import (
    ADV_RESHAPING,
    ANCHORS,
    COMMON_HPARAMS,
    ESTIMATORS,
    POLICY_LOSSES,
    REGULARIZERS,
    REWARD_SHAPING,
    Method,
    coerce_hparam,
    hparam_help,
    hparam_type,
    list_methods,
    method_from_spec,
)

from openrlhf_div.plugins import load_plugins

from .layout import add_engine_arguments

from openrlhf_div.engines.contract import ANCHOR_FLAG, CORRECT_FLAG  # noqa: E402,F401 (Experience.info keys)
DEFAULT_ANCHOR_RATIO = 8.0  # DPH-RL: 128 prompts x 16 rollouts : 256 anchors

def estimator_flag(estimator: str) -> str:
    """OpenRLHF's ``--algo.advantage.estimator`` for a registry estimator (topology only: every one
    is critic-free), as the estimator declared it (``register_estimator(openrlhf_estimator=...)``)."""
    return ESTIMATORS[estimator].openrlhf_estimator
# registry aggregation -> OpenRLHF aggregate_loss(token_level_loss=...)
TOKEN_LEVEL = {"token-mean": True, "seq-mean-token-mean": False,
               # the DPH-RL authors' per-micro-batch token-mean (docs/ALGORITHMS.md 9, row 2): the
               # policy actor aggregates it itself (loss.div_actor_loss), not aggregate_loss
               "micro-batch-token-mean": None}



def hparam_table() -> Dict[str, Tuple[Any, str]]:
    """Every method hyperparameter -> (a default, the component that owns it)."""
    table: Dict[str, Tuple[Any, str]] = {}
    for comp, tab in (("common", {"": COMMON_HPARAMS}), ("estimator", ESTIMATORS),
                      ("reward shaping", REWARD_SHAPING), ("advantage reshaping", ADV_RESHAPING),
                      ("policy loss", POLICY_LOSSES), ("regularizer", REGULARIZERS),
                      ("anchor", ANCHORS)):
        for part, params in tab.items():
            for k, v in getattr(params, "defaults", params).items():
                where = f"{comp} {part}".strip()
                if k in table:
                    table[k] = (table[k][0], table[k][1] + f", {where}")
                else:
                    table[k] = (v, where)
    return table


def METHOD_KEYS_IN_DIV() -> set:
    """The keys of an experiment's ``method:`` section (hyperparameters, aggregation,
    dynamic_sampling) that the old spelling put under ``div:``."""
    return set(hparam_table()) | {"aggregation", "dynamic_sampling"}


#: what an explicit ``none`` / ``null`` parses to: the string ``"none"``, not ``None`` (argparse's
#: "flag not given"), so the override reaches the method, which reads it as ``None``
#: (:meth:`Method.with_overrides`). A plain string keeps the namespace picklable and JSON-safe.
EXPLICIT_NONE = "none"
from openrlhf_div.schema import NONE_WORDS  # noqa: E402  (the one coercion's words)


def _none_or(conv):
    def parse(s: str):
        if str(s).lower() in NONE_WORDS:
            return EXPLICIT_NONE
        return conv(s)
    parse.__name__ = getattr(conv, "__name__", "value")
    return parse


def _flag_type(name: str):
    """argparse's type of ``--div.<name>``: the registry's one coercion (``coerce_hparam``); an
    explicit none stays :data:`EXPLICIT_NONE` (argparse's None means "not given")."""
    def parse(s: str):
        v = coerce_hparam(name, s)
        return EXPLICIT_NONE if v is None else v
    kind = hparam_type(name)
    parse.__name__ = getattr(kind, "__name__", str(kind or "value"))
    return parse


def _bool(s: str) -> bool:
    from openrlhf_div.schema import BadValue, convert_scalar  # the one coercion

    try:
        return convert_scalar(bool, s)
    except BadValue:
        raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}") from None


def add_div_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the ``--div.*`` group (method, its hyperparameters, anchors, task) to ``parser``."""
    g = parser.add_argument_group(
        "openrlhf-div (--div.*)",
        "The training method comes from openrlhf_div's registry (`openrlhf-div methods`). "
        "Hyperparameters left unset take the method's paper default.",
    )
    load_plugins()  # OPENRLHF_DIV_PLUGINS: their methods are choices too
    g.add_argument("--div.method", default="grpo", choices=list(list_methods()), metavar="NAME",
                   help="registered method: " + ", ".join(list_methods()) + " (default: grpo)")
    from openrlhf_div.tasks import list_tasks

    g.add_argument("--div.task", default=None, choices=list_tasks(), metavar="TASK",
                   help="a registered task (" + ", ".join(list_tasks()) + "; plug-ins' too): reward through "
                        "openrlhf_div/tasks/reward_funcs/<task>.py, or reward_funcs/registered.py for a task "
                        "without its own file (sets --reward.remote_url unless given)")
    g.add_argument("--div.anchor_data", default=None, metavar="PATH",
                   help="D_pef from presample_ray (a presample output directory or its d_pef.jsonl); "
                        "required by anchor methods (dph_*). An experiment file writes it as data.presample_dir")
    g.add_argument("--div.anchor_batch_size", type=int, default=None, metavar="N",
                   help="D_pef anchor samples added per rollout step (default: online samples / "
                        "--div.anchor_ratio, rounded up). An experiment file writes it as optim.anchor_batch_size")
    g.add_argument("--div.anchor_ratio", type=float, default=DEFAULT_ANCHOR_RATIO, metavar="R",
                   help="online samples per anchor sample when --div.anchor_batch_size is unset "
                        "(default 8, DPH-RL's 128x16 : 256)")
    g.add_argument("--div.anchor_seed", type=int, default=None, metavar="SEED",
                   help="seed of the anchor sampler (default: --train.seed)")
    g.add_argument("--div.log_z_lr", type=float, default=None, metavar="LR",
                   help="FlowRL's log Z head learning rate (default: --actor.adam.lr)")
    g.add_argument("--div.eval_top_p", type=float, default=None, metavar="P",
                   help="top-p of `python -m openrlhf_div.engines.openrlhf.evaluate --config` (default: "
                        "--rollout.top_p); the DPH-RL authors train at 0.9 and evaluate at 0.95")
    g.add_argument("--div.truncate_prompts", type=_bool, default=False, metavar="BOOL",
                   help="let OpenRLHF cut prompts longer than data.max_len - rollout.max_new_tokens from the left "
                        "(default: stop before the run with their count)")
    g.add_argument("--div.drop_long_prompts", type=_bool, default=False, metavar="BOOL",
                   help="drop prompts longer than data.max_len - rollout.max_new_tokens from the training, "
                        "evaluation and pre-sampling data, counted in the log and run_info.json (the DPH-RL "
                        "authors' filter_overlong_prompts; authors'-mode configs: true)")
    g.add_argument("--div.eval_greedy", type=_bool, default=None, metavar="BOOL",
                   help="`python -m openrlhf_div.engines.openrlhf.evaluate --config` also scores one greedy "
                        "response per problem (the report's greedy column); the DPH-RL authors validate greedily")
    g.add_argument("--div.aggregation", default=None, choices=sorted(TOKEN_LEVEL),
                   help="override the method's loss aggregation")
    g.add_argument("--div.dynamic_sampling", type=_bool, default=None, metavar="BOOL",
                   help="override the method's dynamic sampling (DAPO)")
    helps = hparam_help()  # declared at registration: one line and its source
    for name, (default, owner) in sorted(hparam_table().items()):
        shown = "none" if default is None else default
        line, source = helps.get(name, {}).get("help", ""), helps.get(name, {}).get("source", "")
        kw: Dict[str, Any] = {"default": None, "metavar": "V",
                              "help": (f"{line} [source: {source}] " if line else "")
                              + f"({owner}; unset: the method's default, e.g. {shown})"}
        if not isinstance(default, (bool, str)):
            kw["help"] += "; none or null: no value (None)"
        if hparam_type(name) == "pair":
            kw.update(type=_none_or(float), nargs="+", metavar="LOW HIGH|none")
        else:
            kw.update(type=_flag_type(name))
        g.add_argument(f"--div.{name}", **kw)
    add_engine_arguments(parser)  # --layout.* (also --engine.*: the micro-batch layout), next to the method's flags
    return g


def div_namespace(args) -> Any:
    """``args.div`` of a hierarchized namespace, or the flat ``div.*`` keys of a parsed one."""
    div = getattr(args, "div", None)
    if div is not None:
        return div
    flat = {k[4:]: v for k, v in vars(args).items() if k.startswith("div.")}
    return argparse.Namespace(**flat)


def method_from_args(args) -> Method:
    """The run's :class:`Method`, built once per process (after importing the plug-ins of
    ``OPENRLHF_DIV_PLUGINS``). A driver's ``args`` carry the resolved method
    (``args.div.method_spec``, set by :func:`openrlhf_div.engines.openrlhf.plan.plan` and pickled
    with the args to every Ray worker): a worker builds it from that spec, reading no ``--div.*``
    flag again. Without one (the driver's own first build, a stand-alone evaluation): the method
    selected by ``--div.method`` with every ``--div.<hparam>`` applied."""
    load_plugins()
    div = div_namespace(args)
    spec = getattr(div, "method_spec", None)
    if spec is not None:
        return method_from_spec(spec)
    overrides: Dict[str, Any] = {}
    for name in hparam_table():
        v = getattr(div, name, None)
        if v is None:  # not given: the method's default
            continue
        if isinstance(v, (list, tuple)):
            if len(v) == 1 and v[0] == EXPLICIT_NONE:
                v = EXPLICIT_NONE
            elif len(v) == 2 and EXPLICIT_NONE not in v:
                v = tuple(v)
            else:
                raise ValueError(f"--div.{name} takes two numbers (LOW HIGH) or none, got {' '.join(map(str, v))}")
        overrides[name] = v  # an explicit none reaches the method as None (Method.with_overrides)
    partial: Dict[str, Any] = {"name": div.method, "hparams": overrides}
    if getattr(div, "aggregation", None) is not None:
        partial["aggregation"] = div.aggregation
    if getattr(div, "dynamic_sampling", None) is not None:
        partial["dynamic_sampling"] = div.dynamic_sampling
    method = method_from_spec(partial)  # the flags' values as a (partial) spec: once per process too
    if method.aggregation not in TOKEN_LEVEL:
        raise ValueError(
            f"method {method.name!r} aggregates with {method.aggregation!r}, which OpenRLHF's "
            f"aggregate_loss cannot express; use --div.aggregation token-mean, seq-mean-token-mean or "
            f"micro-batch-token-mean"
        )
    return method


# ------------------------------------------------------------------ OpenRLHF flags
# OpenRLHF flag -> what to use instead. Refused when given explicitly together with --div.*:
# our training step takes these from the method, so they would be silently ignored.
IGNORED_UPSTREAM = {
    "--actor.eps_clip": "--div.eps_low / --div.eps_high",
    "--actor.eps_clip_low_high": "--div.eps_low / --div.eps_high",
    "--actor.dual_clip": "--div.dual_clip",
    "--actor.loss_agg_mode": "--div.aggregation",
    "--actor.policy_loss_type": "--div.method (e.g. cispo, lad_js)",
    "--actor.entropy_coef": "--div.method entropy_bonus|entropy_penalty and --div.entropy_coef",
    "--algo.kl.estimator": "--div.kl_estimator (method rkl)",
    "--algo.kl.unbiased_gradient": "--div.method rkl with --div.kl_estimator",
    "--algo.kl.target": "--div.kl_coef (fixed coefficient)",
    "--algo.advantage.no_std_norm": "--div.method dr_grpo",
    "--algo.advantage.gamma": "(outcome rewards: the registry's estimators)",
    "--algo.advantage.lambd": "(outcome rewards: the registry's estimators)",
    "--algo.advantage.is_correction_level": "(not supported with --div methods)",
    "--reward.overlong_buffer_len": "--div.overlong_max_len / --div.overlong_cache_len",
    "--reward.overlong_penalty_factor": "--div.overlong_max_len / --div.overlong_cache_len",
    "--reward.stop_properly_penalty_coef": "(not supported with --div methods)",
    "--reward.normalize_enable": "(reward-model option; rewards come from the task verifier)",
}
# flags the driver derives from the method (a conflicting explicit value is an error)
DERIVED_UPSTREAM = ("--algo.advantage.estimator", "--algo.kl.init_coef", "--algo.kl.use_loss",
                    "--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range")


TASK_ENV = "OPENRLHF_DIV_TASK"  # read by tasks/reward_funcs/registered.py in the reward workers


def reward_func_path(task: str) -> str:
    """Absolute path of the reward-function file for ``task``: ``tasks/reward_funcs/<task>.py``
    where the package has one, else ``registered.py``, which builds the registered task named by
    ``OPENRLHF_DIV_TASK`` (set here for the Ray workers; a plug-in's task)."""
    import openrlhf_div

    folder = os.path.join(os.path.dirname(os.path.abspath(openrlhf_div.__file__)), "tasks", "reward_funcs")
    own = os.path.join(folder, f"{task}.py")
    if os.path.isfile(own):
        return own
    os.environ[TASK_ENV] = task
    return os.path.join(folder, "registered.py")


@dataclass
class Derived:
    """The OpenRLHF flags a method implies, plus a human summary of the topology."""

    argv: List[str]
    reference_actor: bool
    critic: bool
    notes: List[str]


def _flag_groups(argv: Sequence[str]) -> Dict[str, List[str]]:
    """``{--flag: [values...]}`` of an argv (values: the tokens up to the next option)."""
    out: Dict[str, List[str]] = {}
    cur = None
    for tok in argv:
        if tok.startswith("--"):
            name, _, val = tok.partition("=")
            cur = name
            out[cur] = [val] if val else []
        elif cur is not None:
            out[cur].append(tok)
    return out


def derive_upstream_flags(method: Method, argv: Sequence[str], div) -> Derived:
    """OpenRLHF flags implied by ``method`` (to append to the user's argv).

    Raises ``ValueError`` for an explicit flag that our actor would ignore or that conflicts
    with the method; a derived flag given with exactly the derived value (a printed command
    run again) is accepted and not repeated.
    """
    needs = method.needs
    out = ["--algo.advantage.estimator", estimator_flag(method.estimator)]
    notes = [f"advantages: registry estimator {method.estimator!r}"
             + (f" + reshaping {', '.join(method.adv_reshaping)}" if method.adv_reshaping else "")
             + (f" + reward shaping {', '.join(method.reward_shaping)}" if method.reward_shaping else "")]
    if needs.ref_log_probs:
        coef = float(method.hparams.get("kl_coef", 1.0))
        out += ["--algo.kl.init_coef", repr(coef if coef > 0 else 1.0), "--algo.kl.use_loss",
                "--algo.kl.estimator", "k3"]
        notes.append("reference actor: yes (the method reads pi_ref log-probs online)")
    else:
        out += ["--algo.kl.init_coef", "0"]
        notes.append("reference actor: no")
    if method.dynamic_sampling:
        out += ["--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0", "1"]
        notes.append("dynamic sampling: drop groups with all-equal 0/1 rewards at generation, refill")
    given = _flag_groups(argv)
    task = getattr(div, "task", None)
    if task and "--reward.remote_url" not in given:
        out += ["--reward.remote_url", reward_func_path(task)]
    if needs.anchor_batch:
        notes.append(f"anchors: D_pef at {getattr(div, 'anchor_data', None)}, eta={method.anchor_weight}")
    if needs.entropy:
        notes.append("entropy: full-vocabulary entropy computed in the training forward")

    derived = _flag_groups(out)
    for flag, values in given.items():
        if flag in derived:
            if [float(v) for v in values if _is_num(v)] != [float(v) for v in derived[flag] if _is_num(v)] \
                    or [v for v in values if not _is_num(v)] != [v for v in derived[flag] if not _is_num(v)]:
                raise ValueError(
                    f"{flag} {' '.join(values)} conflicts with method {method.name!r}, which implies "
                    f"{flag} {' '.join(derived[flag])}; remove it (openrlhf-div sets it from the method)"
                )
        elif flag in IGNORED_UPSTREAM:
            raise ValueError(
                f"{flag} is an OpenRLHF loss option that the openrlhf-div actor does not read "
                f"(the loss comes from --div.method {method.name}); use {IGNORED_UPSTREAM[flag]} instead"
            )
        elif flag in DERIVED_UPSTREAM:
            raise ValueError(
                f"{flag} is set by openrlhf-div from the method ({method.name}), which does not use it; "
                "remove it and choose the behaviour with --div.method / --div.* hyperparameters"
            )
    keep: List[str] = []
    for flag, values in derived.items():
        if flag not in given:
            keep += [flag, *values]
    return Derived(keep, reference_actor=needs.ref_log_probs, critic=False, notes=notes)


def _is_num(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False


def check_supported(method: Method, args, need_data: bool = True) -> None:
    """Refuse combinations the OpenRLHF engine does not implement (clear message each).
    ``need_data=False`` skips the ``--div.anchor_data`` checks (the policy actor never reads it)."""
    div = div_namespace(args)
    train = getattr(args, "train", None)
    ds = getattr(args, "ds", None)
    if method.needs.prompt_hidden and ds is not None and (
            getattr(ds, "packing_samples", False) or getattr(ds, "ring_attn_size", 1) > 1):
        raise NotImplementedError(
            f"method {method.name!r} pools the prompt's hidden states for its log Z head, which needs "
            "unpacked batches: drop --ds.packing_samples / --ds.ring_attn_size"
        )
    if train is not None and getattr(train, "async_enable", False):
        raise NotImplementedError(
            "--train.async_enable is not supported by openrlhf-div yet (OpenRLHF's async trainer "
            "builds its own training actor); run synchronously"
        )
    if method.aggregation == "micro-batch-token-mean":  # the authors' layout (loss.authors_micro_batches)
        if train is not None and getattr(train, "dynamic_batch_enable", False):
            raise NotImplementedError(
                "--train.dynamic_batch_enable with aggregation micro-batch-token-mean is not supported: the "
                "authors' layout makes its own micro-batches; for token budgets set --layout.micro_batch_tokens N")
        if method.needs.anchor_batch and method.hparams.get("anchor_weighting") != "microbatch_share":
            raise ValueError(
                f"method {method.name!r} with aggregation micro-batch-token-mean weights each anchor micro-batch "
                "eta, as the authors' code does: that is --div.anchor_weighting microbatch_share (set it), or use "
                "--div.aggregation token-mean for the spec's L_exp + eta L_pef")
    if method.needs.anchor_batch:
        if need_data and not getattr(div, "anchor_data", None):
            raise ValueError(
                f"method {method.name!r} trains an anchor loss on D_pef: pass --div.anchor_data "
                "PATH (written by `python -m openrlhf_div.cli.presample_ray`)"
            )
        if train is not None and getattr(train, "dynamic_batch_enable", False):
            raise NotImplementedError(
                "--train.dynamic_batch_enable with an anchor method is not supported: OpenRLHF's "
                "dynamic batches normalise by all action tokens, but L_exp and L_pef are each a "
                "token mean over their own tokens"
            )
    elif need_data and getattr(div, "anchor_data", None):
        raise ValueError(
            f"--div.anchor_data is set but method {method.name!r} has no anchor loss; "
            "use a dph_* method or drop the flag"
        )
