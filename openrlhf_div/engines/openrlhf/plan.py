"""The plan of a Ray run: :func:`plan` merges config + command line + the flags the method
implies (:mod:`openrlhf_div.engines.flags`), validates them with OpenRLHF's own checks
(:func:`~.upstream.finalize`) and ours (:func:`_check_batches`, :func:`_check_token_budget`,
the authors' layout: :func:`authors_layout_lines`), counts GPUs (:func:`count_gpus`) and renders
the final command (:class:`Plan`). Imports no Ray and no vLLM (``--dry-run`` prints the plan and
exits). :func:`load_argv_plugins` imports the ``--plugin`` modules before the parser is built.
"""
from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from openrlhf_div.algorithms.authors import MICRO_BATCH_TOKEN_MEAN

from ..anchor_data import anchor_count
from ..flags import Derived, check_supported, derive_upstream_flags, div_namespace, method_from_args
from ..layout import EngineLayout
from .render import _given, _split_config, config_argv, config_values, load_config, split_overrides
from .upstream import PROG, build_parser, finalize


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
        from openrlhf_div.algorithms import preset as method_preset

        preset = method_preset(self.method.name).hparams  # the summary is the preset's: say what this run sets
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
    # the resolved method travels with the args (pickled to every Ray worker): each process builds
    # it once from this spec (flags.method_from_args), never again from the --div.* flags
    div_namespace(args).method_spec = method.spec()
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
