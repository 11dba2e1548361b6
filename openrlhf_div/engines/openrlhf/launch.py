"""Launch an OpenRLHF 0.11.2 run with an openrlhf-div method: :func:`main` (``python -m
openrlhf_div.cli.train_ppo_ray``) and :func:`run`, which calls OpenRLHF's own ``train(args)``.

Each job of the driver has its module; every name this module had before the split is still
importable from here:

* **Flags** (:mod:`.upstream`): OpenRLHF's parser and post-parse validation, executed from its own
  ``train_ppo_ray.py`` (``build_parser``, ``finalize``, ``upstream_main``, ``upstream_cli_path``).
* **Configs** (:mod:`.render`): an experiment file rendered into driver flags (``load_config``,
  ``config_argv``, ``config_values``, ``split_overrides``, ``apply_config_env``).
* **Plan** (:mod:`.plan`): config + command line + the flags the method implies, validated, GPUs
  counted, the final command (``Plan``, ``plan``, ``count_gpus``, ``authors_layout_lines``,
  ``load_argv_plugins``). ``--dry-run`` prints it and exits without importing Ray or vLLM.
* **Failure naming** (:mod:`.failures`): the one line a failed or stopped run ends with
  (``dead_actor_line``, ``stopped``, ``named_fault``).
* **Run** (here): :func:`run` calls OpenRLHF's own ``train(args)`` with three classes swapped for
  the duration of the call, in the driver process only (:func:`div_classes`): ``PolicyModelActor``
  -> :data:`~.actor.DivPolicyModelActor`, ``ReferenceModelActor`` ->
  :data:`~.logprob_actor.DivReferenceModelActor` (log-probs from hidden states, no
  ``[tokens, V]`` logits) and ``PPOTrainer`` -> :data:`~.trainer.DivPPOTrainer`.
  OpenRLHF then creates the reference actor only when ``--algo.kl.init_coef > 0`` (which
  the driver sets only for methods that need it) and no critic (no registered method uses GAE).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Optional, Sequence

from openrlhf_div.config import expand_env, load_experiment  # noqa: F401 - importable from here, as before

from .failures import (  # noqa: F401 - re-exported: the names launch.py had
    ACTOR_ROLES,
    DEAD_ACTOR_EXIT,
    INCOMPLETE_FILE,
    STOPPED_EXIT,
    _exit_naming,
    dead_actor_line,
    exception_chain,
    named_fault,
    stopped,
)
from .plan import (  # noqa: F401 - re-exported
    Plan,
    _check_batches,
    _check_token_budget,
    authors_layout_lines,
    count_gpus,
    load_argv_plugins,
    plan,
)
from .render import (  # noqa: F401 - re-exported
    _flag_values,
    _given,
    _split_config,
    apply_config_env,
    config_argv,
    config_values,
    load_config,
    split_overrides,
)
from .upstream import (  # noqa: F401 - re-exported
    _MAIN_CACHE,
    _OUR_OPTIONS,
    PROG,
    _is_call_of,
    _is_parse_args,
    _one_line_error,
    _UpstreamMain,
    build_parser,
    finalize,
    upstream_cli_path,
    upstream_main,
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
