"""``openrlhf-div``: one command, one subcommand per stage.

Each subcommand lives in its own module ``openrlhf_div/cli/<name>.py`` exposing
``add_parser(subparsers)`` (which sets ``func`` on its parser); add new ones to
``SUBCOMMANDS``. Modules are imported lazily so ``--help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import List, Optional

from openrlhf_div import __version__

# (subcommand module, one-line help). Order is the order of --help.
SUBCOMMANDS = [
    ("run", "run one experiment file on any engine: local (--toy: seconds on a CPU), openrlhf, megatron"),
    ("methods", "list the registered methods, their defaults and what they need"),
    ("bandit", "the controlled 50-arm bandit: LAD / GRPO / DS against their analytic optima"),
    ("presample", "DPH-RL pre-sampling: split training prompts into D_pef / D_exp"),
    ("train", "RL training with the local engine (any registered method)"),
    ("eval", "evaluate a model on a task: pass@k, mean@k, greedy, diversity, keep/explore"),
    ("demo", "the diversity demo from nothing: base model, pre-sampling, RL per method, report"),
    ("compare", "comparison report (metrics.json, report.md, plots) from run directories' eval.json"),
    ("config", "the settings' one schema: every field with its help (config fields), the converter (config convert)"),
    ("plan_memory", "memory plan of a Megatron actor layout on paper (--config configs/megatron/X.yaml)"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="openrlhf-div",
        description="Diversity-preserving RLVR: DPH-RL, Differential Smoothing, LAD and baselines.",
    )
    parser.add_argument("--version", action="version", version=f"openrlhf-div {__version__}")
    parser.add_argument("--plugin", action="append", metavar="MODULE",
                        help="import a module (or .py file) that registers methods, components or tasks before "
                             "anything runs (repeatable, anywhere on the line; also OPENRLHF_DIV_PLUGINS=a,b)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, _help in SUBCOMMANDS:
        mod = importlib.import_module(f"openrlhf_div.cli.{name}")
        mod.add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    from openrlhf_div.plugins import load_plugins, split_plugin_args

    argv = list(sys.argv[1:] if argv is None else argv)
    import faulthandler

    if not faulthandler.is_enabled():  # a native crash (an in-process vLLM engine's kernel) names its frame
        faulthandler.enable()
    try:  # before the parsers are built: the plug-ins' methods and tasks are then known everywhere
        plugins, argv = split_plugin_args(argv)
        load_plugins(plugins)
    except ValueError as exc:
        print(f"openrlhf-div: error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and getattr(args, "takes_settings", False):  # eval: key=value in the schema's names, anywhere
        args.settings = list(getattr(args, "settings", None) or []) + unknown
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `openrlhf-div ... | head`: the reader left; no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except (ValueError, FileNotFoundError) as exc:
        # bad input: one clear line, no traceback (set OPENRLHF_DIV_DEBUG=1 for the traceback)
        if os.environ.get("OPENRLHF_DIV_DEBUG"):
            raise
        print(f"openrlhf-div {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        # the sampler cannot run this model, or a vLLM engine process died: one line, no wall of
        # EngineDeadError frames (OPENRLHF_DIV_DEBUG=1 for the traceback)
        line = _one_line_failure(exc)
        if line is None or os.environ.get("OPENRLHF_DIV_DEBUG"):
            raise
        print(f"openrlhf-div {args.command}: error: {line}", file=sys.stderr)
        return 2 if _unavailable(exc) else 4
    return int(rc or 0)


def _unavailable(exc: BaseException) -> bool:
    """A sampler backend that cannot run here (engines/local: SamplerUnavailable, BackendUnavailable)."""
    return any(c.__name__ in ("SamplerUnavailable", "BackendUnavailable") for c in type(exc).__mro__)


def _one_line_failure(exc: BaseException) -> Optional[str]:
    if _unavailable(exc):  # the sampler cannot run this model here: the message has reason and fix
        return str(exc)
    from openrlhf_div.compat.engine_death import explain

    return explain(exc)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
