"""OpenRLHF's command line, read from its own source: the one module that reads and executes
OpenRLHF 0.11.2's ``openrlhf/cli/train_ppo_ray.py``.

OpenRLHF builds its argument parser inside ``if __name__ == "__main__":`` of that file, so it
cannot be imported. :func:`upstream_main` cuts that block in two around
``args = parser.parse_args()``; :func:`build_parser` executes the parser-building half, then adds
our ``--div.*`` group (every OpenRLHF flag is accepted, with OpenRLHF's own defaults and help);
:func:`finalize` executes the post-parse half (``hierarchize`` and its validation), i.e.
everything after ``parse_args`` except the final ``train(args)``. Nothing is copied from OpenRLHF.
"""
from __future__ import annotations

import argparse
import ast
import copy
import datetime
import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional

from ..flags import add_div_arguments

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
